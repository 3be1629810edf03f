"""`weightshare verify` as a CI gate: byte comparison, every output kind, runtime failures, real inputs.

Regression models are built here as equivalents of the real ones that broke verify: onnxruntime's
logreg_iris (a ZipMap output: sequence of maps), the onnx backend tests test_if_seq and test_if_opt (an If
returning a sequence / an optional), a Gather whose indices are a graph input, and a TFLite model with a
dynamic dimension.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from weightshare._compare import differences, tensor_difference
from weightshare._dispatch import inventory, verify
from weightshare.api import convert

W = np.arange(512, dtype=np.float32).reshape(1, 512) / 7  # 2 KiB: above the inline threshold, moves to the blob


def _save(model: onnx.ModelProto, path) -> str:
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return str(path)


def _model(nodes, inputs, outputs, inits, path, opset=17, ml=False, **graph_kw):
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("ai.onnx.ml", 3)] if ml else [])
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits, **graph_kw)
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return _save(model, path)


def _zipmap(path):
    """logreg_iris-like: scores = x + W, a ZipMap output (sequence of maps) beside a tensor output."""
    labels = [f"c{i}" for i in range(512)]
    nodes = [
        helper.make_node("Add", ["x", "W"], ["scores"]),
        helper.make_node("ZipMap", ["scores"], ["probs"], domain="ai.onnx.ml", classlabels_strings=labels),
    ]
    probs = helper.make_value_info(
        "probs",
        helper.make_sequence_type_proto(
            helper.make_map_type_proto(TensorProto.STRING, helper.make_tensor_type_proto(TensorProto.FLOAT, []))
        ),
    )
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 512])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 512]), probs],
        [numpy_helper.from_array(W, "W")],
        path,
        ml=True,
    )


def _if_seq(path):
    """test_if_seq-like: an If whose branches build a sequence from outer-scope initializers."""
    then = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["t0"]), helper.make_node("SequenceConstruct", ["t0", "W"], ["s_then"])],
        "then",
        [],
        [helper.make_tensor_sequence_value_info("s_then", TensorProto.FLOAT, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Sub", ["x", "W"], ["e0"]), helper.make_node("SequenceConstruct", ["e0"], ["s_else"])],
        "else",
        [],
        [helper.make_tensor_sequence_value_info("s_else", TensorProto.FLOAT, None)],
    )
    node = helper.make_node("If", ["cond"], ["seq"], then_branch=then, else_branch=other)
    return _model(
        [node],
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 512]),
        ],
        [helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(W, "W")],
        path,
    )


def _if_opt(path):
    """test_if_opt-like: an If returning an optional tensor, empty in one branch."""
    opt_type = helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, [1, 512]))
    then = helper.make_graph(
        [helper.make_node("Mul", ["x", "W"], ["m"]), helper.make_node("Optional", ["m"], ["o_then"])],
        "then",
        [],
        [helper.make_value_info("o_then", opt_type)],
    )
    other = helper.make_graph(
        [helper.make_node("Optional", [], ["o_else"], type=opt_type.optional_type.elem_type)],
        "else",
        [],
        [helper.make_value_info("o_else", opt_type)],
    )
    node = helper.make_node("If", ["cond"], ["opt"], then_branch=then, else_branch=other)
    return _model(
        [node],
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 512]),
        ],
        [helper.make_value_info("opt", opt_type)],
        [numpy_helper.from_array(W, "W")],
        path,
        opset=18,
    )


def _blob_of(converted) -> tuple[str, int, int]:
    """(blob path, offset, length) of the largest external payload, read from the converted model."""
    p = max((p for p in inventory(converted).payloads if p.location == "external"), key=lambda p: p.nbytes)
    return str(converted.parent / p.file), p.offset, p.nbytes


def _flip(converted, at: int = 100) -> None:
    blob, offset, _ = _blob_of(converted)
    with open(blob, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)
        f.seek(offset + at)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify")
    return d, {
        "zipmap": _zipmap(d / "zipmap.onnx"),
        "if_seq": _if_seq(d / "if_seq.onnx"),
        "if_opt": _if_opt(d / "if_opt.onnx"),
    }


def _convert(cli, src, out):
    """In-process (the CLI's convert has its own tests): the converted model's path from the report."""
    return Path(convert(src, out).outputs[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zipmap", "if_seq", "if_opt"])
def test_sequence_map_and_optional_outputs_pass_then_fail_on_a_flipped_byte(built, cli, tmp_path, name):
    d, models = built
    src = models[name]
    out = _convert(cli, src, tmp_path)
    res = cli("verify", src, out, "--json", "--runs", "4")
    assert res.returncode == 0, res.stdout + res.stderr
    (report,) = json.loads(res.stdout)["reports"]
    assert report["passed"] and report["runs"] == 4 and report["outputs_compared"] >= 4
    _flip(out)
    res = cli("verify", src, out, "--json", "--runs", "4")
    (report,) = json.loads(res.stdout)["reports"]
    assert res.returncode == 1 and report["checksum_mismatches"], res.stdout
    if name != "if_opt":  # the optional is empty in half of the runs, full in the others: still differs somewhere
        assert any("elements differ, first at" in m for m in report["mismatches"]), report["mismatches"]
    assert report["mismatches"], report
    assert "internal error" not in res.stderr


@pytest.mark.slow
def test_zipmap_difference_names_the_map_entry(built, cli, tmp_path):
    _, models = built
    out = _convert(cli, models["zipmap"], tmp_path)
    blob, offset, _ = _blob_of(out)
    with open(blob, "r+b") as f:  # W[0, 5] changes: map key 'c5' of every row differs
        f.seek(offset + 5 * 4)
        f.write(np.float32(1e6).tobytes())
    res = cli("verify", models["zipmap"], out)
    assert res.returncode == 1
    assert "output 'probs'[0]['c5']" in res.stdout and "output 'scores'" in res.stdout


def _edit(converted, change) -> None:
    model = onnx.load(str(converted), load_external_data=False)
    change(model)
    onnx.save(model, str(converted))


@pytest.mark.slow
def test_missing_output_and_changed_dtype_fail_one_line_each(built, cli, tmp_path):
    _, models = built
    out = _convert(cli, models["zipmap"], tmp_path / "a")
    _edit(out, lambda m: m.graph.output.pop())  # the ZipMap output is gone
    res = cli("verify", models["zipmap"], out)
    assert res.returncode == 1
    assert "FAIL: output 'probs' is missing from the converted model" in res.stdout.splitlines()

    def to_fp16(m):
        m.graph.node[0].output[0] = "scores32"
        m.graph.node[1].input[0] = "scores32"
        m.graph.node.append(helper.make_node("Cast", ["scores32"], ["scores"], to=TensorProto.FLOAT16))
        m.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16

    out = _convert(cli, models["zipmap"], tmp_path / "b")
    _edit(out, to_fp16)
    res = cli("verify", models["zipmap"], out, "--runs", "1")
    assert res.returncode == 1
    fails = [line for line in res.stdout.splitlines() if line.startswith("FAIL:")]
    assert fails == ["FAIL: run 0: output 'scores': float32[1, 512] vs float16[1, 512]"], res.stdout


def _reshape(path):
    """x[N, 4] -> Reshape to [3, -1]: runs only when 4N is a multiple of 3."""
    nodes = [helper.make_node("Add", ["x", "B"], ["s"]), helper.make_node("Reshape", ["s", "shape"], ["y"])]
    inits = [
        numpy_helper.from_array(np.ones((1, 4), np.float32), "B"),
        numpy_helper.from_array(np.array([3, -1], np.int64), "shape"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])],
        inits,
        path,
    )


@pytest.mark.slow
def test_original_that_fails_is_exit_2_with_a_hint_only_converted_failing_is_exit_1(cli, tmp_path):
    src = _reshape(tmp_path / "reshape.onnx")
    out = _convert(cli, src, tmp_path / "out")
    res = cli("verify", src, out)  # N defaults to 1: 4 values cannot become [3, -1]
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "the original model fails in onnxruntime:" in lines[0] and "--dim" in lines[0], lines
    assert cli("verify", src, out, "--dim", "N=3").returncode == 0
    res = cli("verify", src, out, "--dim", "batch=3")  # a typo must not silently leave N at 1
    assert res.returncode == 2 and "no input of reshape.onnx has a dimension of that name" in res.stderr
    _edit(
        out, lambda m: m.graph.initializer[-1].CopyFrom(numpy_helper.from_array(np.array([5, -1], np.int64), "shape"))
    )
    res = cli("verify", src, out, "--dim", "N=3")
    assert res.returncode == 1 and "the converted model fails in onnxruntime" in res.stdout, res.stdout
    assert "internal error" not in res.stderr


@pytest.mark.slow
def test_truncated_blob_names_the_tensor_without_runtime_log_spam(built, cli, tmp_path):
    _, models = built
    out = _convert(cli, models["if_seq"], tmp_path)
    blob, offset, length = _blob_of(out)
    with open(blob, "r+b") as f:
        f.truncate(offset + length // 2)
    res = cli("verify", models["if_seq"], out)
    assert res.returncode == 1 and res.stderr == "", res.stderr
    assert "FAIL: tensor 'W':" in res.stdout and "runs past the end" in res.stdout, res.stdout


def _gather(path, data_known: bool):
    """y = Gather(table, idx): table an initializer [2, 600] (size known) or a graph input [M, 600]."""
    table = np.random.default_rng(0).standard_normal((2, 600)).astype(np.float32)
    if data_known:
        return _model(
            [helper.make_node("Gather", ["table", "idx"], ["y"])],
            [helper.make_tensor_value_info("idx", TensorProto.INT64, [8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 600])],
            [numpy_helper.from_array(table, "table")],
            path,
        )
    nodes = [helper.make_node("Gather", ["t", "idx"], ["y"]), helper.make_node("Mul", ["y", "scale"], ["z"])]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("t", TensorProto.FLOAT, ["M", 600]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, [8]),
        ],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [8, 600])],
        [numpy_helper.from_array(table[0], "scale")],
        path,
    )


@pytest.mark.slow
def test_integer_indices_stay_in_range_or_require_input(cli, tmp_path):
    known = _gather(tmp_path / "known.onnx", True)
    out = _convert(cli, known, tmp_path / "k")
    report = verify(known, out, runs=5)  # values 0..2 would be out of range for 2 rows
    assert report.passed and report.runs == 5, report
    unknown = _gather(tmp_path / "unknown.onnx", False)
    out = _convert(cli, unknown, tmp_path / "u")
    res = cli("verify", unknown, out, "--dim", "M=4")
    assert res.returncode == 2 and "--input idx=idx.npy" in res.stderr and len(res.stderr.splitlines()) == 1
    np.save(tmp_path / "idx.npy", np.array([3, 0, 1, 2, 3, 3, 0, 1], np.int64))
    res = cli("verify", unknown, out, "--dim", "M=4", "--input", f"idx={tmp_path / 'idx.npy'}", "--runs", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    res = cli("verify", unknown, out, "--input", f"idx={tmp_path / 'nope.npy'}")
    assert res.returncode == 2 and "--input idx: cannot read" in res.stderr


def test_tensor_difference_says_where_and_how_much():
    a = np.zeros((2, 3), np.float32)
    b = a.copy()
    b[1, 2] = np.nextafter(np.float32(0), np.float32(1)) * 3  # 3 ULP above 0
    b[0, 1] = -0.0  # same value, other bytes
    assert tensor_difference(a, b) == "2 of 6 elements differ, first at [0, 1], max abs diff 4.2039e-45, max ULP diff 3"
    assert tensor_difference(a, a.copy()) == ""
    nan = np.array([np.nan], np.float32)
    assert tensor_difference(nan, nan.copy()) == ""
    assert tensor_difference(a, a.astype(np.float16)) == "float32[2, 3] vs float16[2, 3]"
    assert differences([a, None], [a.copy(), None], "o") == []
    assert differences({"k": a}, {"k": b}, "o")[0].startswith("o['k']: 2 of 6")
    assert differences(None, a, "o") == ["o: empty optional vs tensor"]
    assert differences([a], [a, a], "o") == ["o: sequence of 1 vs 2 elements"]


@pytest.mark.slow
def test_unreferenced_blob_records_are_rehashed_too(cli, tmp_path):
    """A record no tensor points at (as --prepack's packed copies are) is still checked against its SHA-256."""
    from weightshare._safetensors import read_safetensors_metadata

    a, b = W, W[:, ::-1] * 3
    src = _model(
        [helper.make_node("Add", ["x", "A"], ["s"]), helper.make_node("Mul", ["s", "B"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 512])],
        [numpy_helper.from_array(a, "A"), numpy_helper.from_array(np.ascontiguousarray(b), "B")],
        tmp_path / "ab.onnx",
    )
    out = _convert(cli, src, tmp_path / "out")
    blob, _, _ = _blob_of(out)
    _edit(out, lambda m: m.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(b), "B")))
    res = cli("verify", src, out, "--json", "--runs", "1")
    (report,) = json.loads(res.stdout)["reports"]
    assert res.returncode == 0 and report["payloads_hashed"] == 2, report  # A as a tensor, B as a bare record
    data_start, header, _ = read_safetensors_metadata(blob)
    at = data_start + header["B"]["data_offsets"][0] + 8
    with open(blob, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    res = cli("verify", src, out, "--json", "--runs", "1")
    (report,) = json.loads(res.stdout)["reports"]
    assert res.returncode == 1 and not report["mismatches"], report  # outputs still equal: B is inline now
    assert report["checksum_mismatches"] == [
        f"blob record 'B' in {Path(blob).name} at offset "
        f"{at - 8}: its checksum differs from the one recorded in the blob"
    ]


@pytest.mark.slow
def test_onnx_backend_if_tests_convert_and_verify_with_their_own_inputs(tmp_path):
    """test_if, test_if_seq and test_if_opt as onnx defines them, through scripts/verify_backend_suite.py."""
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "scripts" / "verify_backend_suite.py"
    spec = importlib.util.spec_from_file_location("verify_backend_suite", script)
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    outcomes = {
        name: suite.run_one(name, src, model, inputs, tmp_path)
        for name, src, model, inputs in suite.generated_cases(tmp_path, "If")
    }
    assert outcomes == {name: ("verified", "") for name in ("test_if", "test_if_seq", "test_if_opt")}, outcomes
