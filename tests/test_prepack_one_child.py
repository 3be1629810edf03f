"""--prepack of a model family starts one onnxruntime child for the whole run (``server.OrtChild``, ``child.serve``).

Before: each model of a folder started its own child (python, onnx and onnxruntime imported and the CPU probed
again per model: 0.33 s of CPU each), so a 3-model T5-like folder started 3 of them. Under test: the number of
ORT child processes a folder conversion starts (every ``subprocess.Popen`` naming the child module, counted as the
run makes them) and what the reports say of each model (started the child or not; the ORT sessions it ran); the
child ends with the run; a model that fails leaves the next model of another run a fresh child. After: the outputs
are those of a child per model, byte for byte, and bit-identical to onnxruntime on the originals at batch 1 and 8.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import decoder_fixtures as fx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T

import weightshare

pytestmark = pytest.mark.slow  # ORT children

CHILD = "weightshare.formats.onnx.ort.child"
HEADS, SIZE = 4, 64
DIMS = {"num_heads": HEADS, "d_kv": SIZE, "d_model": HEADS * SIZE, "past_decoder_sequence_length": 5}


class _Counted(subprocess.Popen):  # type: ignore[type-arg]
    """``subprocess.Popen`` recording the ORT children started (``run_child_peak``'s wrapper names the module too)."""

    started: list[list[str]] = []

    def __init__(self, args, *a, **k):  # noqa: ANN001 - Popen's own signature
        if any(CHILD in str(x) for x in (args if isinstance(args, list | tuple) else [args])):
            _Counted.started.append([str(x) for x in args])
        super().__init__(args, *a, **k)


@pytest.fixture
def counted(monkeypatch):
    _Counted.started = []
    monkeypatch.setattr(subprocess, "Popen", _Counted)
    return _Counted.started


def _feeds(path: Path, batch: int) -> dict[str, np.ndarray]:
    model = onnx.load(str(path), load_external_data=False)
    rng = np.random.default_rng(batch)
    named = {**DIMS, "batch_size": batch, "decoder_sequence_length": 1 if "with_past" in path.name else 3}
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


def _children_alive() -> list[int]:
    """This process's live children running the ORT child module."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) == os.getpid() and stat[0] != "Z" and CHILD.encode() in (entry / "cmdline").read_bytes():
                alive.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return alive


def test_a_three_model_folder_starts_one_onnxruntime_child(tmp_path, counted):
    src = tmp_path / "src"
    fx.t5_like(src, heads=HEADS, size=SIZE)
    report = weightshare.convert_folder(src, tmp_path / "out", prepack=True)
    by_name = {Path(m.model).name: m.prepack for m in report.models}
    assert len(by_name) == 3
    # the cost driver: one interpreter + onnx + onnxruntime start for the run, not one per model
    assert len(counted) == 1, counted
    assert sum(p["ort_child_started"] for p in by_name.values()) == 1
    # sessions: each model's optimization, plus one per node packed for the first time in the run; the
    # decoder_with_past's nodes all took the decoder's packings, so it ran its optimization session only
    past = by_name["decoder_with_past_model.onnx"]
    assert past["node_sessions"] == 0 and past["nodes_reused"] >= 5
    assert past["ort_sessions"] == 1
    for p in by_name.values():  # the nodes packed by a session share sessions (a batch of nodes is one)
        assert p["ort_sessions"] >= 1 + p["pack_sessions"] and p["pack_sessions"] <= p["node_sessions"]
    assert _children_alive() == []  # the child ended with the run
    for name in by_name:
        for batch in (1, 8):
            feeds = _feeds(src / name, batch)
            a, b = ort.InferenceSession(str(src / name)), ort.InferenceSession(str(tmp_path / "out" / name))
            assert all(np.array_equal(x, y) for x, y in zip(a.run(None, feeds), b.run(None, feeds))), (name, batch)


def test_a_zoo_starts_one_child_and_ends_it_with_the_run(tmp_path, counted):
    src = tmp_path / "src"
    fx.t5_like(src, heads=HEADS, size=SIZE)
    models = [src / "decoder_model.onnx", src / "decoder_with_past_model.onnx"]
    zoo = weightshare.convert(models, tmp_path / "zoo", prepack=True, shared_blob="t5")
    assert len(counted) == 1
    assert [m.prepack["ort_child_started"] for m in zoo.models] == [True, False]
    assert _children_alive() == []


def test_one_child_writes_what_a_child_per_model_writes(tmp_path, counted):
    """The same three models converted one run each (a child each) and as one folder (one child): every output
    byte-identical; the second run's child is a new one (the first ended with its run)."""
    src = tmp_path / "src"
    fx.t5_like(src, heads=HEADS, size=SIZE)
    weightshare.convert_folder(src, tmp_path / "folder", prepack=True)
    for name in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"):
        weightshare.convert(src / name, tmp_path / "alone", prepack=True)
    assert len(counted) == 4  # the folder's one, then one per separate run
    for name in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx"):
        assert (tmp_path / "folder" / name).read_bytes() == (tmp_path / "alone" / name).read_bytes()
    assert _children_alive() == []


def test_a_failed_model_ends_the_child_and_the_next_run_starts_a_fresh_one(tmp_path, counted):
    """A model over its memory limit kills nothing else: its run fails in one line; the next run's child is new
    and bounded by its own limits."""
    from weightshare.errors import Unsupported
    from weightshare.options import ConvertOptions

    src = tmp_path / "src"
    fx.t5_like(src, heads=HEADS, size=SIZE)
    with pytest.raises(Unsupported, match="memory limit"):
        weightshare.convert(
            src / "encoder_model.onnx", tmp_path / "low", ConvertOptions(prepack=True, ort_child_memory_mib=64)
        )
    assert _children_alive() == []
    weightshare.convert(src / "encoder_model.onnx", tmp_path / "ok", prepack=True)
    assert len(counted) == 2
