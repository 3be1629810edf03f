"""ONNX conversion end to end: checker, ONNX Runtime outputs, blob layout, unpacking."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx_fixtures import D, N, kitchen_sink, sparse_model
from safetensors import safe_open

import weightshare
from weightshare._outputs_record import RECORD
from weightshare._safetensors import read_safetensors_metadata
from weightshare.formats.onnx.fold import shape_tensor_names
from weightshare.formats.onnx.graph import iter_scopes


def run(path: Path, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def feeds(seed: int, cond: bool) -> dict:
    x = np.random.default_rng(seed).standard_normal((N, D)).astype(np.float32)
    return {"x": x, "cond": np.array(cond)}


def all_tensors(model: onnx.ModelProto):
    for scope in iter_scopes(model):
        if isinstance(scope, onnx.GraphProto):
            yield from scope.initializer
            for sp in scope.sparse_initializer:
                yield sp.values
                yield sp.indices
        for node in scope.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("sparse_tensor"):
                    yield attr.sparse_tensor.values
                    yield attr.sparse_tensor.indices


def embedded_bytes(t: onnx.TensorProto) -> int:
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return 0
    return t.ByteSize() - len(t.name) - 8 * len(t.dims) - 4


@pytest.fixture(scope="module")
def sink(tmp_path_factory):
    d = tmp_path_factory.mktemp("sink")
    src = kitchen_sink(d)
    report = weightshare.convert(src, d / "out")
    return src, d / "out" / "sink.onnx", report


def test_converted_model_passes_full_check(sink):
    _, out, _ = sink
    onnx.checker.check_model(str(out), full_check=True)


@pytest.mark.parametrize("seed,cond", [(0, True), (1, False), (2, True)])
def test_outputs_are_bit_identical(sink, seed, cond):
    src, out, _ = sink
    before, after = run(src, feeds(seed, cond)), run(out, feeds(seed, cond))
    assert len(before) == len(after) == 26
    for a, b in zip(before, after):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_nothing_large_stays_embedded_except_shape_tensors(sink):
    _, out, report = sink
    model = onnx.load(str(out), load_external_data=False)
    shapes = shape_tensor_names(model)
    leftovers = [
        t.name
        for t in all_tensors(model)
        if embedded_bytes(t) >= 1024 and not (t.data_type == onnx.TensorProto.INT64 and t.name in shapes)
    ]
    assert leftovers == []
    # every kind the fixture has ended up external: main graph, nested subgraphs, function, Loop body
    external = {e.value for t in all_tensors(model) for e in t.external_data if e.key == "location"}
    (blob,) = out.parent.glob("*.safetensors")  # the name carries a content digest
    assert external == {blob.name} and blob.name.startswith("sink.weights.")
    fn_const = model.functions[0].node[0].attribute[0].t
    assert fn_const.data_location == onnx.TensorProto.EXTERNAL
    assert report.tensors_moved >= 25


def test_fp16_casts_folded_and_typed_fields_unpacked(sink):
    src, out, report = sink
    model = onnx.load(str(out), load_external_data=False)
    casts = [n for s in iter_scopes(model) for n in s.node if n.op_type == "Cast"]
    # Only the Casts of "mixed16" (also cast to double) and of the int typed tensors (behind Identity) remain.
    assert {n.input[0] for n in casts} == {"mixed16", "mixed16_d"} | {
        f"t_{k}_id" for k in ("int8", "uint8", "int16", "bool", "int32", "int64", "double", "uint32", "uint64")
    }
    # fp16 main graph, bf16, two16, t_fp16, Constant c16, deep16, else16 = 8 Casts gone (two16 had two)
    assert report.ops_removed == 8
    by_name = {t.name: t for t in all_tensors(model)}
    assert by_name["w16_f"].data_type == onnx.TensorProto.FLOAT
    assert by_name["mixed16"].data_type == onnx.TensorProto.FLOAT16
    for t in all_tensors(model):
        assert not (t.float_data or t.int32_data or t.int64_data or t.double_data or t.uint64_data), t.name
    assert report.unpacked >= 17


def test_blob_is_valid_safetensors_aligned_and_deduplicated(sink):
    _, out, report = sink
    (blob,) = out.parent.glob("sink.weights.*.safetensors")
    assert oct(blob.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    data_start, header, meta = read_safetensors_metadata(str(blob))
    with safe_open(str(blob), "np") as f:
        names = set(f.keys())
        assert np.array_equal(f.get_tensor("wbig").shape, (D, 4096))
    model = onnx.load(str(out), load_external_data=False)
    for t in all_tensors(model):
        info = {e.key: e.value for e in t.external_data}
        if info:
            offset, length = int(info["offset"]), int(info["length"])
            assert offset % (65536 if length >= 1 << 20 else 64) == 0, t.name
            assert offset >= data_start
    assert report.deduplicated == 1 and "w32_copy" in meta["w32"]["aliases"]
    assert "w32_copy" not in names
    assert report.blob_bytes == blob.stat().st_size


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_sparse_initializer_and_sparse_constant(tmp_path):
    src = sparse_model(tmp_path)
    report = weightshare.convert(src, tmp_path / "out")
    out = tmp_path / "out" / "sparse.onnx"
    onnx.checker.check_model(str(out))
    x = {"x": np.random.default_rng(3).standard_normal((N, D)).astype(np.float32)}
    for a, b in zip(run(src, x), run(out, x)):
        assert np.array_equal(a, b)
    assert report.tensors_moved == 2 and report.inline_kept == 2  # values move; indices stay for onnx.checker


def test_keep_packed_keeps_fp16_and_casts(tmp_path):
    src = kitchen_sink(tmp_path)
    report = weightshare.convert(src, tmp_path / "out", weightshare.ConvertOptions(keep_packed=True))
    out = tmp_path / "out" / "sink.onnx"
    onnx.checker.check_model(str(out), full_check=True)
    model = onnx.load(str(out), load_external_data=False)
    by_name = {t.name: t for t in all_tensors(model)}
    assert by_name["w16"].data_type == onnx.TensorProto.FLOAT16
    assert report.ops_removed == 0 and report.unpacked == 0
    assert len(by_name["t_int8"].int32_data) == N * D  # typed fields untouched
    for a, b in zip(run(src, feeds(5, True)), run(out, feeds(5, True))):
        assert np.array_equal(a, b)


def test_conversion_is_deterministic(tmp_path):
    src = kitchen_sink(tmp_path)
    weightshare.convert(src, tmp_path / "a")
    weightshare.convert(src, tmp_path / "b")
    assert sorted(os.listdir(tmp_path / "a")) == sorted(os.listdir(tmp_path / "b"))  # same digest, same blob name
    for name in set(os.listdir(tmp_path / "a")) - {RECORD}:  # the record holds each file's inode and time
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_cli_convert_json_and_blob_name(tmp_path, cli):
    src = kitchen_sink(tmp_path)
    res = cli("convert", src, "-o", tmp_path / "out", "--blob", "shared.safetensors", "--json")
    assert res.returncode == 0, res.stderr
    (report,) = json.loads(res.stdout)["reports"]
    blob = Path(report["outputs"][1])  # --blob NAME is a stable prefix: NAME.<digest12>.safetensors
    assert report["outputs"] == [str(tmp_path / "out" / "sink.onnx"), str(blob)]
    assert blob.parent == tmp_path / "out" and re.fullmatch(r"shared\.[0-9a-f]{12}\.safetensors", blob.name)
    assert report["tensors_moved"] > 0 and report["peak_rss_mib"] > 0 and report["wall_time_s"] > 0
    assert sorted(os.listdir(tmp_path / "out")) == [RECORD, blob.name, "sink.onnx"]


def test_align_options(tmp_path):
    src = kitchen_sink(tmp_path)
    opts = weightshare.ConvertOptions(align=weightshare.AlignPolicy(large=4096, threshold=2048))
    weightshare.convert(src, tmp_path / "out", opts)
    model = onnx.load(str(tmp_path / "out" / "sink.onnx"), load_external_data=False)
    for t in all_tensors(model):
        info = {e.key: e.value for e in t.external_data}
        if info:
            assert int(info["offset"]) % (4096 if int(info["length"]) >= 2048 else 64) == 0


def test_converting_a_converted_model_is_stable(sink, tmp_path):
    src, out, _ = sink
    again = weightshare.convert(out, tmp_path / "again")
    assert again.ops_removed == 0 and again.unpacked == 0 and again.tensors_moved > 0
    for a, b in zip(run(src, feeds(9, False)), run(tmp_path / "again" / "sink.onnx", feeds(9, False))):
        assert np.array_equal(a, b)


def test_bool_in_int32_data_is_nonzero_as_ort_reads_it(tmp_path):
    # Found by scripts/fuzz.py --mode structure: ORT casts each int32 to bool (256 -> true); keeping the low
    # byte (256 -> 0) changed outputs.
    values = np.resize(np.array([0, 1, 2, 256, -1, 0x3C00, 1 << 20], np.int64), 2000)
    t = onnx.TensorProto(name="b", data_type=onnx.TensorProto.BOOL, dims=[values.size])
    t.int32_data.extend(values.tolist())
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["b"], ["y"])],
        "g",
        [],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.BOOL, None)],
        [t],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    weightshare.convert(tmp_path / "m.onnx", tmp_path / "out")
    before, after = run(tmp_path / "m.onnx", {})[0], run(tmp_path / "out" / "m.onnx", {})[0]
    assert before.tobytes() == after.tobytes() == (values != 0).tobytes()
