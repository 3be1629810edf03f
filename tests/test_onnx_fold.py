"""Cast(fp16 constant) folding: duplicate names, odd Casts, shadowing subgraphs, training bindings, NaN bits.

Each model runs in ONNX Runtime before and after conversion; outputs must be byte-identical (dtype, shape,
``.tobytes()``), and a model weightshare cannot fold must still convert (unfolded) or be refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import weightshare
from weightshare.formats.onnx import dtypes

N = 1000  # elements: 2 KB of fp16, above the inline threshold, and not a multiple of ORT's SIMD block of 16


def _model(nodes, inits=(), outputs=("y",), inputs=(), opset=17, **kw) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes),
        "g",
        [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in inputs],
        [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in outputs],
        list(inits),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **kw)
    model.ir_version = 8
    return model


def _cast(src: str, dst: str) -> onnx.NodeProto:
    return helper.make_node("Cast", [src], [dst], to=TP.FLOAT)


def _fp16(name: str, seed: int, bits: np.ndarray | None = None) -> onnx.TensorProto:
    arr = np.random.default_rng(seed).standard_normal(N).astype(np.float16) if bits is None else bits.view(np.float16)
    return numpy_helper.from_array(arr, name)


def _const(name: str, tensor: onnx.TensorProto) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=tensor)


def _run(path: Path, feeds=None) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds or {})


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes())


def _convert_and_compare(tmp_path: Path, model: onnx.ModelProto, feeds=None):
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    report = weightshare.convert(src, tmp_path / "out")
    before, after = _run(src, feeds), _run(tmp_path / "out" / "m.onnx", feeds)
    _same(before, after)
    return report, before


@pytest.mark.parametrize("layout", ["two initializers", "two Constants", "initializer and Constant"])
def test_duplicate_constant_names_are_refused(tmp_path, cli, layout):
    # ORT loads these, but which definition wins depends on storage (inline: the first of two 2 KB
    # initializers; external: the last), so no conversion can promise the same outputs: refuse, in one line.
    first, second = _fp16("w", 1), _fp16("w", 2)
    nodes, inits = [_cast("w", "y")], []
    if layout == "two initializers":
        inits = [first, second]
    elif layout == "two Constants":
        nodes = [_const("w", first), _const("w", second), *nodes]
    else:
        inits, nodes = [first], [_const("w", second), *nodes]
    src = tmp_path / "m.onnx"
    onnx.save(_model(nodes, inits), src)
    _run(src)  # the original loads in ORT
    res = cli("convert", src, "-o", tmp_path / "out")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert str(src) in res.stderr and "'w' is defined twice" in res.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_graph_input_with_initializer_default_is_accepted(tmp_path):
    # An initializer that gives a graph input its default value is not a duplicate.
    x = np.random.default_rng(5).standard_normal(N).astype(np.float32)
    model = _model([helper.make_node("Neg", ["x"], ["y"])], [numpy_helper.from_array(x, "x")], inputs=("x",))
    _convert_and_compare(tmp_path, model, {"x": -x})


def test_cast_without_output_is_not_folded(tmp_path, cli):
    # scripts/fuzz.py --seed 777001 found this: an IndexError inside the fold
    model = _model([_cast("w", "y"), helper.make_node("Cast", ["w"], [], to=TP.FLOAT)], [_fp16("w", 1)])
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    res = cli("convert", src, "-o", tmp_path / "out")
    assert res.returncode == 0, res.stderr  # ORT refuses the model, but moving its bytes is still well defined
    out = onnx.load(tmp_path / "out" / "m.onnx", load_external_data=False)
    assert [n.op_type for n in out.graph.node] == ["Cast", "Cast"]  # w has a reader that is no foldable Cast
    assert out.graph.initializer[0].data_type == TP.FLOAT16


def test_subgraph_shadowing_a_cast_output_still_loads(tmp_path):
    # An If placed before the Cast defines its own "c" in a branch, shadowing the Cast's output: ORT accepts
    # that while "c" is a node output computed later, but refuses it (SSA) once "c" is an initializer, which
    # is what folding would make it. The fold must be skipped.
    then_g = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["c"]), helper.make_node("Add", ["c", "c"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TP.FLOAT, None)],
    )
    else_g = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", TP.FLOAT, None)]
    )
    cond = numpy_helper.from_array(np.array(True), "cond")
    nodes = [
        helper.make_node("If", ["cond"], ["i"], then_branch=then_g, else_branch=else_g),
        _cast("w", "c"),
        helper.make_node("Add", ["i", "c"], ["y"]),
    ]
    x = np.random.default_rng(3).standard_normal(N).astype(np.float32)
    report, _ = _convert_and_compare(tmp_path, _model(nodes, [_fp16("w", 1), cond], inputs=("x",)), {"x": x})
    assert report.ops_removed == 0


def test_training_bindings_still_name_initializers(tmp_path):
    algorithm = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["w_new"])],
        "algo",
        [],
        [helper.make_tensor_value_info("w_new", TP.FLOAT16, None)],
    )
    info = onnx.TrainingInfoProto(algorithm=algorithm)
    binding = info.update_binding.add()
    binding.key, binding.value = "w", "w_new"
    model = _model([_cast("w", "y")], [_fp16("w", 1)])
    model.training_info.append(info)
    _, _ = _convert_and_compare(tmp_path, model)
    out = onnx.load(tmp_path / "out" / "m.onnx", load_external_data=False)
    names = {t.name: t for t in out.graph.initializer}
    for b in out.training_info[0].update_binding:
        assert b.key in names and names[b.key].data_type == TP.FLOAT16  # still the tensor the algorithm updates


def test_many_casts_fold_and_match(tmp_path):
    # Several constants, one shared by two Casts, one of them a graph output: the one-pass rename must keep
    # every reader pointing at the right tensor.
    nodes = [
        _cast("a", "a1"),
        _cast("a", "a2"),
        _cast("b", "y"),
        helper.make_node("Add", ["a1", "a2"], ["s"]),
        helper.make_node("Add", ["s", "y"], ["z"]),
        _const("k", _fp16("kt", 4)),
        _cast("k", "k1"),
        helper.make_node("Mul", ["z", "k1"], ["m"]),
    ]
    model = _model(nodes, [_fp16("a", 1), _fp16("b", 2)], outputs=("y", "m"))
    report, _ = _convert_and_compare(tmp_path, model)
    assert report.ops_removed == 4
    out = onnx.load(tmp_path / "out" / "m.onnx", load_external_data=False)
    assert not any(n.op_type == "Cast" for n in out.graph.node)


SPECIAL = np.array(
    [0x7C01, 0x7D55, 0xFC01, 0x7E00, 0x7E01, 0xFE00, 0x7C00, 0xFC00, 0x8000, 0x0000, 0x0001, 0x83FF, 0x03FF, 0x3C00],
    np.uint16,
)


def _special_bits(with_snan: bool) -> np.ndarray:
    bits = np.resize(SPECIAL if with_snan else SPECIAL[3:], N)  # spread over SIMD blocks and the scalar tail
    return bits.astype(np.uint16)


@pytest.mark.parametrize("with_snan", [True, False])
def test_fp16_special_values_are_byte_identical_to_ort(tmp_path, with_snan):
    # Concat copies bits: no arithmetic that would quiet a NaN between the Cast and the output.
    nodes = [_cast("w", "c"), helper.make_node("Concat", ["x", "c"], ["y"], axis=0)]
    model = _model(nodes, [_fp16("w", 0, _special_bits(with_snan))], inputs=("x",))
    report, before = _convert_and_compare(tmp_path, model, {"x": np.zeros(3, np.float32)})
    # With a signalling NaN no fixed conversion matches ORT on every CPU: the Cast stays. Otherwise it folds.
    assert report.ops_removed == (0 if with_snan else 1)
    if with_snan:
        assert {0x7FC02000, 0x7F802000} <= set(before[0].view(np.uint32).tolist())  # ORT itself mixes both


def test_bf16_special_values_fold_to_ort_bits(tmp_path):
    bits = np.resize(np.array([0x7F81, 0x7FC1, 0xFF81, 0x7F80, 0x8000, 0x0001, 0x3F80], np.uint16), N)
    w = helper.make_tensor("w", TP.BFLOAT16, [N], bits.tobytes(), raw=True)
    nodes = [_cast("w", "c"), helper.make_node("Concat", ["x", "c"], ["y"], axis=0)]
    report, before = _convert_and_compare(tmp_path, _model(nodes, [w], inputs=("x",)), {"x": np.zeros(3, np.float32)})
    assert report.ops_removed == 1  # ORT's bf16 Cast is a shift, signalling NaNs included: folding is exact
    assert before[0].view(np.uint32)[3:].tobytes() == (bits.astype(np.uint32) << 16).tobytes()


def test_signalling_nan_detection():
    for b in range(0x10000):  # every fp16 pattern, against the definition
        exp_all_ones, mantissa = (b & 0x7C00) == 0x7C00, b & 0x3FF
        expected = exp_all_ones and mantissa != 0 and not (mantissa & 0x200)
        assert dtypes.fp16_has_signalling_nan([np.array([b], np.uint16).tobytes()]) == expected, hex(b)
