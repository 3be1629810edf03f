"""Mutation fuzzing of the Core ML converter: >= 600 damaged packages, no traceback, nothing left behind
(per test run; scripts/fuzz.py runs for minutes).

Before: five small valid packages (fp16, nested blocks, iOS18 sub-byte constexpr inputs, iOS16 constexpr
attributes, a coremltools multifunction package). Under test: weightshare.api.convert on each package with one
of weight.bin, model.mlmodel or Manifest.json damaged (byte mutations and structured lies, tests/coreml_fuzz.py).
After: a conversion or a one-line WeightshareError naming a file; OUTDIR empty on failure; bounded allocation.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import coreml_fixtures as F
import pytest
from coreml_fuzz import MODEL, TARGETS, check_package, coreml_seeds, mutate_package, save_package
from fuzz_harness import FuzzStats, scratch_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightshare.api import convert
from weightshare.errors import InvalidModel


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return coreml_seeds(tmp_path_factory.mktemp("coreml_fuzz_seeds"))


@pytest.mark.slow
def test_fuzz_600_packages(seeds, tmp_path):
    stats = FuzzStats()
    rng = random.Random(20261130)
    work = scratch_dir(tmp_path / "w")
    per_target = {t: [0, 0] for t in TARGETS}
    try:
        for i in range(600):
            seed, target = seeds[i % len(seeds)], TARGETS[i // len(seeds) % len(TARGETS)]
            kind, files = mutate_package(seed, rng, target)
            rejected = stats.rejected
            try:
                check_package(seed.name, files, work, stats, kind)
            except Exception as e:  # a broken invariant or an exception that is not a WeightshareError
                saved = save_package(files, tmp_path / "failing" / seed.name)
                raise AssertionError(f"input {i} ({kind}): {type(e).__name__}: {e}; saved as {saved}") from e
            per_target[target][stats.rejected > rejected] += 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert stats.inputs == 600
    assert stats.rejected > 180 and stats.converted > 90, stats  # both paths really exercised
    assert all(converted > 6 and rejected > 30 for converted, rejected in per_target.values()), per_target
    structured = {k for k in stats.by_kind if k.split(":")[1] in ("record", "spec-offset", "spec-file", "manifest")}
    assert len(structured) == 4, stats.by_kind


@pytest.mark.slow
def test_fuzz_check_and_verify(seeds, tmp_path):
    """inspect/check and verify read the same untrusted packages: findings, mismatches or a WeightshareError."""
    from weightshare._check import check
    from weightshare._dispatch import verify
    from weightshare.errors import WeightshareError

    rng = random.Random(5)
    outcomes = {"findings": 0, "clean": 0, "error": 0, "verify failed": 0}
    for i in range(150):
        seed = seeds[i % len(seeds)]
        kind, files = mutate_package(seed, rng, TARGETS[i // len(seeds) % len(TARGETS)])
        work = tmp_path / str(i)
        original = save_package(seed.files, work / "a" / seed.name)
        damaged = save_package(files, work / "b" / seed.name)
        try:
            _, findings = check([damaged])
            outcomes["findings" if findings else "clean"] += 1
            outcomes["verify failed"] += not verify(original, damaged).passed
        except WeightshareError as e:
            assert "\n" not in str(e) and str(work) in str(e), (kind, str(e))
            outcomes["error"] += 1
        shutil.rmtree(work)
    assert min(outcomes.values()) >= 5, outcomes


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@pytest.mark.slow
@given(st.binary(max_size=300))
def test_fuzz_random_spec_bytes(seeds, tmp_path, data):
    seed = seeds[0]
    check_package(seed.name, {**seed.files, MODEL: data}, tmp_path / "w", FuzzStats())


def _nested_spec(seed_pkg: Path, depth: int) -> bytes:
    """The seed's program with one weight-bearing const moved under ``depth`` nested op blocks."""
    spec = F.load_spec(seed_pkg)
    block = spec.mlProgram.functions["main"].block_specializations["CoreML6"]
    const = next(op for op in block.operations if op.type == "const" and F.blob_values_of(op))
    op = block.operations.add()
    op.type = "cond"
    for _ in range(depth):
        op = op.blocks.add().operations.add()
        op.type = "cond"
    op.CopyFrom(const)
    return spec.SerializeToString()


@pytest.mark.parametrize("depth, ok", [(30, True), (200, False)])
def test_deeply_nested_blocks(seeds, tmp_path, depth, ok):
    pkg = save_package(seeds[0].files, tmp_path / seeds[0].name)
    (pkg / MODEL).write_bytes(_nested_spec(pkg, depth))
    if ok:
        assert convert(pkg, tmp_path / "out").tensors_moved == 4
    else:
        with pytest.raises(InvalidModel, match="not a valid Core ML Model protobuf") as err:
            convert(pkg, tmp_path / "out")
        assert "\n" not in str(err.value) and str(pkg) in str(err.value)
        assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
