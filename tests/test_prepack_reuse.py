"""--prepack packs each distinct one-node model once per run (``child.packing_key``, ``prepack.PackCache``).

A T5-like decoder and decoder_with_past share their weights: the second model's nodes take the packings the first
one's sessions made, and its outputs are the files a run without reuse writes, byte for byte (so the packings
handed over are exactly the ones its own sessions would make). A weight whose bytes another node packed is not
reused when the kernel differs (the same bytes as other dims, or read by a Gemm with transB). Every output stays
bit-identical to onnxruntime on the original at default options, at batch 1 and 8.
"""

from __future__ import annotations

from pathlib import Path

import decoder_fixtures as fx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import weightshare
from weightshare.formats.onnx.ort.prepack import REUSE_ENV

pytestmark = pytest.mark.slow  # ORT children per model

HEADS, SIZE = 4, 64  # 256x256 fp32 projections: external weights that MLAS packs
DIMS = {"num_heads": HEADS, "d_kv": SIZE, "d_model": HEADS * SIZE, "past_decoder_sequence_length": 5}


def _t5_feeds(path: Path, batch: int) -> dict[str, np.ndarray]:
    model = onnx.load(str(path), load_external_data=False)
    rng = np.random.default_rng(batch)
    decoding = 1 if "with_past" in path.name else 3
    named = {**DIMS, "batch_size": batch, "decoder_sequence_length": decoding}
    named |= {"encoder_sequence_length": 6, "encoder_sequence_length_out": 6}
    feeds = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        shape = [named[d.dim_param] if d.dim_param else d.dim_value for d in tt.shape.dim]
        if vi.name == "input_ids":
            feeds[vi.name] = rng.integers(0, fx.VOCAB, shape, dtype=np.int64)
        elif tt.elem_type == T.INT64:
            feeds[vi.name] = np.ones(shape, np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(shape, dtype=np.float32)
    return feeds


def _exact(original: Path, converted: Path, feeds: dict[str, np.ndarray]) -> bool:
    a, b = ort.InferenceSession(str(original)), ort.InferenceSession(str(converted))
    return all(np.array_equal(x, y) for x, y in zip(a.run(None, feeds), b.run(None, feeds)))


def _files(out: Path) -> dict[str, bytes]:
    """The outputs (the run record, which names its time, aside)."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and not p.name.startswith(".")}


@pytest.fixture(scope="module")
def t5_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("t5")
    fx.t5_like(d / "src", heads=HEADS, size=SIZE)
    return d


def test_decoder_with_past_reuses_the_decoders_packings(t5_pair, monkeypatch):
    src = t5_pair / "src"
    reused = weightshare.convert_folder(src, t5_pair / "reused", prepack=True)
    monkeypatch.setenv(REUSE_ENV, "0")
    alone = weightshare.convert_folder(src, t5_pair / "alone", prepack=True)
    by_name = {Path(m.model).name: m.prepack for m in reused.models}
    # the decoder packs its projections; decoder_with_past reads the same weights through the same kernels
    assert by_name["decoder_model.onnx"]["node_sessions"] >= 5
    assert by_name["decoder_with_past_model.onnx"]["node_sessions"] == 0
    assert by_name["decoder_with_past_model.onnx"]["nodes_reused"] >= 5
    assert all(m.prepack["nodes_reused"] == 0 for m in alone.models)
    sessions = sum(m.prepack["node_sessions"] for m in reused.models)
    assert sessions < sum(m.prepack["node_sessions"] for m in alone.models)
    # what was handed over is what the model's own sessions make: every file byte-identical
    assert _files(t5_pair / "reused") == _files(t5_pair / "alone")
    for name in ("decoder_model.onnx", "decoder_with_past_model.onnx", "encoder_model.onnx"):
        for batch in (1, 8):
            assert _exact(src / name, t5_pair / "reused" / name, _t5_feeds(src / name, batch)), (name, batch)


def test_a_zoo_reuses_across_its_models(t5_pair, monkeypatch):
    """--shared-blob: the packing is read from the first model's staging (kept until the zoo's blob is written)."""
    src = t5_pair / "src"
    models = [src / "decoder_model.onnx", src / "decoder_with_past_model.onnx"]
    zoo = weightshare.convert(models, t5_pair / "zoo", prepack=True, shared_blob="t5")
    monkeypatch.setenv(REUSE_ENV, "0")
    weightshare.convert(models, t5_pair / "zoo0", prepack=True, shared_blob="t5")
    assert zoo.models[1].prepack["node_sessions"] == 0 and zoo.models[1].prepack["nodes_reused"] >= 5
    assert _files(t5_pair / "zoo") == _files(t5_pair / "zoo0")
    for m in models:
        assert _exact(m, t5_pair / "zoo" / m.name, _t5_feeds(m, 8))


def _one_weight(path: Path, w: np.ndarray, node: onnx.NodeProto, x: list, y: list) -> Path:
    graph = h.make_graph(
        [node],
        path.stem,
        [h.make_tensor_value_info("x", T.FLOAT, x)],
        [h.make_tensor_value_info("y", T.FLOAT, y)],
        [numpy_helper.from_array(w, "W")],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_the_same_bytes_read_by_another_kernel_are_packed_again(tmp_path, monkeypatch):
    """One run: MatMul x[., 256] @ W[256, 128]; then the same bytes as W[128, 256] (other dims); then as W[256,
    128] read by Gemm with transB; then the first model again under other names (reused: the control). A wrong
    reuse would not change the outputs (a session whose packing differs from the saved one packs its own, silently):
    the files must be those a run without reuse writes, whose packed copies the sessions map."""
    w = (np.random.default_rng(0).standard_normal((256, 128)) / 16).astype(np.float32)
    src = tmp_path / "src"
    src.mkdir()
    a = _one_weight(src / "a.onnx", w, h.make_node("MatMul", ["x", "W"], ["y"]), ["n", 256], ["n", 128])
    b = _one_weight(src / "b.onnx", w.reshape(128, 256), h.make_node("MatMul", ["x", "W"], ["y"]), ["n", 128], None)
    gemm = h.make_node("Gemm", ["x", "W"], ["y"], transB=1)
    c = _one_weight(src / "c.onnx", w, gemm, ["n", 128], ["n", 256])
    d = _one_weight(src / "d.onnx", w, h.make_node("MatMul", ["x", "W"], ["y"], name="renamed"), ["n", 256], None)
    reports = weightshare.convert([a, b, c, d], tmp_path / "out", prepack=True)
    counts = [(r.prepack["node_sessions"], r.prepack["nodes_reused"]) for r in reports]
    assert counts == [(1, 0), (1, 0), (1, 0), (0, 1)]
    assert all(r.prepack["packed_buffers"] == 1 for r in reports)
    monkeypatch.setenv(REUSE_ENV, "0")
    weightshare.convert([a, b, c, d], tmp_path / "alone", prepack=True)
    assert _files(tmp_path / "out") == _files(tmp_path / "alone")
    rng = np.random.default_rng(1)
    for m, k in ((a, 256), (b, 128), (c, 128), (d, 256)):
        for n in (1, 8, 64):
            feeds = {"x": rng.standard_normal((n, k), dtype=np.float32)}
            assert _exact(m, tmp_path / "out" / m.name, feeds), (m.name, n)


def test_a_model_stamped_with_another_ir_version_reuses_the_packing(tmp_path, monkeypatch):
    """optimum stamps its merged decoder IR 9 and the decoders it merged IR 8: the same node reads the same weight
    in both. The one-node model ORT packs carries the IR version its opsets and types need, not its graph's, so the
    second model runs no session (the T5 folder's merged decoder: 64 sessions before), and its files are those a run
    without reuse writes."""
    w = (np.random.default_rng(0).standard_normal((256, 128)) / 16).astype(np.float32)
    src = tmp_path / "src"
    src.mkdir()
    matmul = h.make_node("MatMul", ["x", "W"], ["y"])
    a = _one_weight(src / "a.onnx", w, matmul, ["n", 256], ["n", 128])
    b = _one_weight(src / "b.onnx", w, matmul, ["n", 256], ["n", 128])
    stamped = onnx.load(str(b))
    stamped.ir_version = 9
    onnx.save(stamped, str(b))
    reports = weightshare.convert([a, b], tmp_path / "out", prepack=True)
    assert [(r.prepack["node_sessions"], r.prepack["nodes_reused"]) for r in reports] == [(1, 0), (0, 1)]
    assert [r.prepack["ort_sessions"] for r in reports] == [2, 1]  # b: its graph's optimization alone
    assert all(set(r.prepack["ort_child_cpu_s"]) == {"optimize", "settle", "pack"} for r in reports)
    monkeypatch.setenv(REUSE_ENV, "0")
    weightshare.convert([a, b], tmp_path / "alone", prepack=True)
    assert _files(tmp_path / "out") == _files(tmp_path / "alone")
    feeds = {"x": np.random.default_rng(1).standard_normal((8, 256), dtype=np.float32)}
    assert _exact(b, tmp_path / "out" / b.name, feeds)
