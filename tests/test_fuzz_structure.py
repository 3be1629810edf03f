"""Structure-aware fuzzing in the suite (the long runs are `scripts/fuzz.py --mode structure`): mutated fields
of parsed ONNX and TFLite models must convert or be refused in one line, and whenever the original runs, the
converted model must give byte-identical outputs in the real runtime."""

from __future__ import annotations

import random

import numpy as np
import pytest
from fuzz_structure import Finding, Runner, StructStats, one_input, seeds


@pytest.fixture(scope="module")
def runner():
    r = Runner()
    yield r
    r.close()


@pytest.mark.slow
@pytest.mark.parametrize("fmt,count", [("onnx", 80), ("tflite", 100)])
def test_structure_mutations(tmp_path, runner, fmt, count):
    corpus = seeds(fmt, tmp_path)
    rng = random.Random(20261130)
    stats = StructStats()
    for _ in range(count):
        name, model, extra = rng.choice(corpus)
        try:
            one_input(fmt, model, name, rng, tmp_path / "w", extra, runner, stats)
        except Finding as e:
            raise AssertionError(f"input {stats.inputs}: {e}") from None
    assert stats.internal_errors == stats.mismatches == 0
    # both outcomes, and real comparisons, really happen
    assert stats.converted > count // 4 and stats.rejected > count // 20 and stats.compared > count // 20, stats


def test_unset_tensor_reads_are_not_compared(tmp_path):
    from ai_edge_litert import schema_py_generated as s
    from fuzz_structure import load_seed, tflite_concat_seed, tflite_reads_unset

    model = load_seed("tflite", tflite_concat_seed(tmp_path / "c.tflite"))
    assert not tflite_reads_unset(model)
    op = model.subgraphs[0].operators[-1]
    op.inputs = np.array([op.outputs[0], op.inputs[1]], np.int32)  # CONCATENATION reads its own unwritten output
    assert tflite_reads_unset(model) and isinstance(model, s.ModelT)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prepack", "ort-cpu"])
def test_structure_mutations_of_the_onnx_runtime_modes(tmp_path, runner, mode):
    """The same invariants for ``--prepack`` and ``--unpack ort-cpu`` (the long runs: scripts/fuzz.py --convert)."""
    corpus = seeds("onnx", tmp_path / "seeds", mode)
    rng = random.Random(20261201)
    stats = StructStats()
    for _ in range(12):
        name, model, extra = rng.choice(corpus)
        try:
            one_input("onnx", model, name, rng, tmp_path / "w", extra, runner, stats, mode)
        except Finding as e:
            raise AssertionError(f"input {stats.inputs}: {e}") from None
    assert stats.internal_errors == stats.mismatches == 0
    assert stats.converted and stats.compared, stats


@pytest.mark.slow
def test_structure_mutations_of_tflite_prepack(tmp_path, runner):
    """``convert --prepack`` of TFLite: the converted model with its XNNPACK cache (weightshare.litert) gives the
    original's XNNPACK outputs (the long runs: scripts/fuzz.py --convert prepack --format tflite)."""
    corpus = seeds("tflite", tmp_path / "seeds", "prepack")
    rng = random.Random(20261202)
    stats = StructStats()
    for _ in range(6):
        name, model, extra = rng.choice(corpus)
        try:
            one_input("tflite", model, name, rng, tmp_path / "w", extra, runner, stats, "prepack")
        except Finding as e:
            raise AssertionError(f"input {stats.inputs}: {e}") from None
    assert stats.internal_errors == stats.mismatches == 0
    assert stats.converted and stats.compared, stats
