"""Mutation fuzzing of the TFLite converter: >= 600 damaged models, no traceback, nothing left behind
(per test run; scripts/fuzz.py runs for minutes)."""

from __future__ import annotations

import random
import shutil

import pytest
from fuzz_harness import MUTATIONS, FuzzStats, check_one, mutate, runtime_loads, scratch_dir
from tflite_fixtures import sample_model, sparse_model

from weightshare.options import ConvertOptions


@pytest.mark.slow
def test_fuzz_600_mutations(tmp_path):
    seeds = [
        sample_model(tmp_path / "m.tflite", fc_out=64).read_bytes(),
        sparse_model(tmp_path / "s.tflite").read_bytes(),
    ]
    stats = FuzzStats(keep_dir=tmp_path / "kept", keep_every=8)
    rng = random.Random(7)
    work = scratch_dir(tmp_path / "w")
    try:
        for i in range(600):
            data = seeds[i % 2]
            kind, mutated = mutate(data, rng, MUTATIONS[i % len(MUTATIONS)])
            options = ConvertOptions(unpack=frozenset({"sparse"})) if i % 4 == 1 else None
            try:
                check_one(mutated, "m.tflite", work, stats, kind, options=options)
            except AssertionError as e:
                (tmp_path / "failing.tflite").write_bytes(mutated)
                raise AssertionError(f"input {i} ({kind}): {e}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert stats.inputs == 600 and stats.rejected > 90 and stats.converted > 90, stats
    loads = runtime_loads(stats)  # LiteRT loads every kept conversion whose damaged input it loads
    assert loads["original_loads"] >= 5, loads
