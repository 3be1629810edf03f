"""XNNPACK weight caches bound to their content; cache builds that survive concurrent runs.

Every test reproduces a scenario that went wrong before: a damaged, truncated, foreign or linked cache under the
expected name was used by LiteRT (wrong outputs) or rebuilt in place by a reader; a concurrent run's
stale-temporary cleanup removed the cache build's staging directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from ai_edge_litert.compiled_model import CompiledModel
from tflite_fixtures import run_compiled_model, sample_model

from weightshare._atomic import clean_stale_temporaries
from weightshare.api import convert
from weightshare.formats.tflite import xnnpack_cache
from weightshare.formats.tflite.cache_record import record_path
from weightshare.litert import compiled_model
from weightshare.options import ConvertOptions


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k][n].tobytes() == b[k][n].tobytes() for k in a for n in a[k])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(out dir of A with its cache, A's reference outputs, B's cache + record built for another model)."""
    root = tmp_path_factory.mktemp("integrity")
    made = []
    for name, seed in (("a", 0), ("b", 7)):
        src = sample_model(root / f"{name}.tflite", seed=seed)
        report = convert(src, root / f"out_{name}", ConvertOptions(prepack=True))
        made.append(
            (
                root / f"out_{name}",
                src.name,
                Path(report.outputs[-1]),
                run_compiled_model(CompiledModel.from_file(str(src))),
            )
        )
    return made


def _copy_a(built, tmp_path: Path) -> tuple[Path, Path, dict]:
    out, name, cache, reference = built[0]
    for f in out.iterdir():
        shutil.copy(f, tmp_path / f.name)
    return tmp_path / name, tmp_path / cache.name, reference


def _not_used(model: Path, caplog) -> tuple[CompiledModel, str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="weightshare.litert"):
        cm = compiled_model(model)
    lines = [r.getMessage() for r in caplog.records if r.name == "weightshare.litert"]
    assert cm.weightshare_cache is None and len(lines) == 1, lines
    return cm, lines[0]


@pytest.mark.slow
def test_flipped_cache_bytes_are_not_used(built, tmp_path, caplog, cli):
    model, cache, reference = _copy_a(built, tmp_path)
    data = bytearray(cache.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 4096] = bytes(b ^ 0xFF for b in data[mid : mid + 4096])
    cache.write_bytes(bytes(data))
    cm, line = _not_used(model, caplog)
    assert "differs from the checksum recorded" in line
    assert same(run_compiled_model(cm), reference)
    assert cache.read_bytes() == bytes(data)  # LiteRT was never handed it, so it was not rewritten either
    res = cli("check", model, "--json")
    assert res.returncode == 1, res.stdout + res.stderr
    assert any(f["code"] == "xnnpack-cache-mismatch" for f in json.loads(res.stdout)["findings"])


def test_truncated_cache_is_never_rebuilt_by_a_reader(built, tmp_path, caplog):
    model, cache, reference = _copy_a(built, tmp_path)
    size = cache.stat().st_size
    os.truncate(cache, size // 3)
    stamp = cache.stat().st_mtime_ns
    for _ in range(2):
        cm, line = _not_used(model, caplog)
        assert "truncated or replaced" in line and same(run_compiled_model(cm), reference)
    assert cache.stat().st_size == size // 3 and cache.stat().st_mtime_ns == stamp


def test_foreign_cache_with_its_own_record_is_not_used(built, tmp_path, caplog):
    """Another model's cache (same structure) copied with its record under the expected name."""
    model, cache, reference = _copy_a(built, tmp_path)
    foreign = built[1][2]
    shutil.copy(foreign, cache)
    shutil.copy(record_path(foreign), record_path(cache))
    cm, line = _not_used(model, caplog)
    assert "built for other model content" in line and same(run_compiled_model(cm), reference)
    assert not [s for s in xnnpack_cache.cache_status(model) if s.matches]


def test_foreign_cache_without_a_record_is_not_used(built, tmp_path, caplog):
    model, cache, reference = _copy_a(built, tmp_path)
    shutil.copy(built[1][2], cache)
    record_path(cache).unlink()
    cm, line = _not_used(model, caplog)
    assert "no record" in line and same(run_compiled_model(cm), reference)


def test_symlinked_cache_is_not_used(built, tmp_path, caplog):
    """Even a link to the model's own, intact cache: what is checked must be the file LiteRT maps."""
    model, cache, reference = _copy_a(built, tmp_path)
    real = tmp_path / "elsewhere"
    os.replace(cache, real)
    os.symlink(real, cache)
    cm, line = _not_used(model, caplog)
    assert "symbolic link" in line and same(run_compiled_model(cm), reference)


def test_intact_cache_is_used(built, tmp_path):
    model, cache, reference = _copy_a(built, tmp_path)
    cm = compiled_model(model)
    assert cm.weightshare_cache == cache and same(run_compiled_model(cm), reference)


def test_cache_build_survives_a_concurrent_runs_cleanup(built, tmp_path, monkeypatch):
    """Another run into the same OUTDIR cleans stale temporaries while the cache builds. The
    staging directory used to be an unlocked temporary, removed under the build (5 of 5 runs killed)."""
    src = built[0][0].parent / built[0][1]
    real_build = xnnpack_cache.build
    removed: list[Path] = []

    def concurrent_cleanup_then_build(model: Path, cache: Path):
        removed.extend(clean_stale_temporaries(tmp_path))  # what a concurrent run does when it starts
        return real_build(model, cache)

    monkeypatch.setattr(xnnpack_cache, "build", concurrent_cleanup_then_build)
    report = convert(src, tmp_path, ConvertOptions(prepack=True))
    assert removed == []
    cache = Path(report.outputs[-1])
    assert compiled_model(tmp_path / src.name).weightshare_cache == cache
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".weightshare-tmp")]
