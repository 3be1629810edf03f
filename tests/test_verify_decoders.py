"""`verify` drives decoder-style inputs unaided.

Before: a decoder_with_past-like model whose attention_mask has the expression dim
``past_sequence_length + sequence_length`` (Concat makes ORT check it), and a model with two inputs verify cannot
make up. Under test: the CLI. After: the expression is computed from the other dims, ``--dim
past_sequence_length=0`` (a prefill step) is accepted, and every missing input is named at once with a runnable
``--input`` example.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper


def _decoder_with_past(path):
    rng = np.random.default_rng(0)
    e = rng.standard_normal((50, 16)).astype(np.float32)
    w = rng.standard_normal((16, 50)).astype(np.float32)
    total = "past_sequence_length + sequence_length"
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["e"]),
        helper.make_node("MatMul", ["e", "W"], ["logits"]),
        helper.make_node("Reshape", ["e", "kv_shape"], ["k4"]),
        helper.make_node("Transpose", ["k4"], ["k"], perm=[0, 2, 1, 3]),
        helper.make_node("Concat", ["past_key", "k"], ["present_key"], axis=2),
        helper.make_node("ReduceSum", ["present_key", "axes13"], ["per_pos"], keepdims=0),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=T.FLOAT),
        helper.make_node("Concat", ["mask_f", "per_pos"], ["mask_and_sum"], axis=0),  # lengths must agree
    ]
    graph = helper.make_graph(
        nodes,
        "decoder_with_past",
        [
            helper.make_tensor_value_info("input_ids", T.INT64, ["batch", "sequence_length"]),
            helper.make_tensor_value_info("attention_mask", T.INT64, ["batch", total]),
            helper.make_tensor_value_info("past_key", T.FLOAT, ["batch", 2, "past_sequence_length", 8]),
        ],
        [
            helper.make_tensor_value_info("logits", T.FLOAT, ["batch", "sequence_length", 50]),
            helper.make_tensor_value_info("present_key", T.FLOAT, ["batch", 2, total, 8]),
            helper.make_tensor_value_info("mask_and_sum", T.FLOAT, [None, total]),
        ],
        [
            numpy_helper.from_array(e, "E"),
            numpy_helper.from_array(w, "W"),
            numpy_helper.from_array(np.array([0, 0, 2, 8], np.int64), "kv_shape"),
            numpy_helper.from_array(np.array([1, 3], np.int64), "axes13"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.slow
def test_expression_dims_computed_and_past_length_zero_accepted(cli, tmp_path):
    src = _decoder_with_past(tmp_path / "decoder_with_past_model.onnx")
    assert cli("convert", src, "-o", tmp_path / "out", "-q").returncode == 0
    out = tmp_path / "out" / src.name
    res = cli("verify", src, out)
    assert res.returncode == 0, res.stdout + res.stderr
    res = cli("verify", src, out, "--dim", "past_sequence_length=0", "--dim", "sequence_length=4")
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_every_missing_input_is_named_at_once(cli, tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Identity", ["a"], ["x"]), helper.make_node("Identity", ["b"], ["y"])],
        "g",
        [helper.make_tensor_value_info(n, T.STRING, [1]) for n in ("a", "b")],
        [helper.make_tensor_value_info(n, T.STRING, [1]) for n in ("x", "y")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "m.onnx"))
    res = cli("verify", tmp_path / "m.onnx", tmp_path / "m.onnx")
    assert res.returncode == 2 and "--input a=a.npy --input b=b.npy" in res.stderr, res.stderr


@pytest.mark.slow
def test_merged_decoder_verifies_with_no_options(cli, tmp_path):
    import model_forms

    src = model_forms.merged_decoder(tmp_path / "decoder_model_merged.onnx", mib=0.1)
    assert cli("convert", src, "-o", tmp_path / "out", "-q").returncode == 0
    res = cli("verify", src, tmp_path / "out" / src.name)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_decoder_without_past_verifies_with_no_options(cli, tmp_path):
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["e"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=T.FLOAT),
        helper.make_node("Unsqueeze", ["m", "ax"], ["m3"]),
        helper.make_node("Mul", ["e", "m3"], ["em"]),
        helper.make_node("MatMul", ["em", "W"], ["logits"]),
        helper.make_node("Reshape", ["em", "kv_shape"], ["k4"]),
        helper.make_node("Transpose", ["k4"], ["present.0.key"], perm=[0, 2, 1, 3]),
        helper.make_node("Identity", ["present.0.key"], ["present.0.value"]),
    ]
    graph = helper.make_graph(
        nodes,
        "decoder",
        [
            helper.make_tensor_value_info("input_ids", T.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info("attention_mask", T.INT64, ["batch_size", "sequence_length"]),
        ],
        [
            helper.make_tensor_value_info("logits", T.FLOAT, ["batch_size", "sequence_length", 50]),
            helper.make_tensor_value_info("present.0.key", T.FLOAT, ["batch_size", 2, "sequence_length", 8]),
            helper.make_tensor_value_info("present.0.value", T.FLOAT, ["batch_size", 2, "sequence_length", 8]),
        ],
        [
            numpy_helper.from_array(rng.standard_normal((50, 16)).astype(np.float32), "E"),
            numpy_helper.from_array(rng.standard_normal((16, 50)).astype(np.float32), "W"),
            numpy_helper.from_array(np.array([0, 0, 2, 8], np.int64), "kv_shape"),
            numpy_helper.from_array(np.array([2], np.int64), "ax"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    src = tmp_path / "decoder_model.onnx"
    onnx.save(model, str(src))
    assert cli("convert", src, "-o", tmp_path / "out", "-q").returncode == 0
    res = cli("verify", src, tmp_path / "out" / src.name)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_gqa_decoder_verifies_with_no_options(cli, tmp_path):
    """onnxruntime-genai's layout: seqlens_k / total_sequence_length derived in-graph from attention_mask
    (ReduceSum - 1, Shape[1]); past_key_values.0.key [batch, kv_num_heads, past_sequence_length, head_size]."""
    rng = np.random.default_rng(0)
    H, KV, D = 4, 2, 8
    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["x"]),
        helper.make_node("MatMul", ["x", "Wq"], ["q"]),
        helper.make_node("MatMul", ["x", "Wk"], ["k"]),
        helper.make_node("MatMul", ["x", "Wv"], ["v"]),
        helper.make_node("ReduceSum", ["attention_mask", "one"], ["s"], keepdims=0),
        helper.make_node("Sub", ["s", "one"], ["s1"]),
        helper.make_node("Cast", ["s1"], ["seqlens_k"], to=T.INT32),
        helper.make_node("Shape", ["attention_mask"], ["ms"]),
        helper.make_node("Gather", ["ms", "one"], ["tl"], axis=0),
        helper.make_node("Cast", ["tl"], ["total_sequence_length"], to=T.INT32),
        helper.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "past_key_values.0.key", "past_key_values.0.value", "seqlens_k", "total_sequence_length"],
            ["o", "present.0.key", "present.0.value"],
            domain="com.microsoft",
            num_heads=H,
            kv_num_heads=KV,
        ),
        helper.make_node("MatMul", ["o", "Wo"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "gqa",
        [
            helper.make_tensor_value_info("input_ids", T.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info("attention_mask", T.INT64, ["batch_size", "total_sequence_length"]),
            helper.make_tensor_value_info(
                "past_key_values.0.key", T.FLOAT, ["batch_size", KV, "past_sequence_length", D]
            ),
            helper.make_tensor_value_info(
                "past_key_values.0.value", T.FLOAT, ["batch_size", KV, "past_sequence_length", D]
            ),
        ],
        [
            helper.make_tensor_value_info("logits", T.FLOAT, ["batch_size", "sequence_length", 50]),
            helper.make_tensor_value_info("present.0.key", T.FLOAT, ["batch_size", KV, "total_sequence_length", D]),
            helper.make_tensor_value_info("present.0.value", T.FLOAT, ["batch_size", KV, "total_sequence_length", D]),
        ],
        [
            numpy_helper.from_array(a, n)
            for n, a in [
                ("E", rng.standard_normal((50, 32)).astype(np.float32)),
                ("Wq", rng.standard_normal((32, H * D)).astype(np.float32)),
                ("Wk", rng.standard_normal((32, KV * D)).astype(np.float32)),
                ("Wv", rng.standard_normal((32, KV * D)).astype(np.float32)),
                ("Wo", rng.standard_normal((H * D, 50)).astype(np.float32)),
                ("one", np.array([1], np.int64)),
            ]
        ],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    src = tmp_path / "model.onnx"
    onnx.save(m, str(src))
    assert cli("convert", src, "-o", tmp_path / "out", "-q").returncode == 0
    res = cli("verify", src, tmp_path / "out" / src.name)
    assert res.returncode == 0, res.stdout + res.stderr
