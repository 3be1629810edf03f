"""`convert --prepack` (content-bound XNNPACK weight cache) and `weightshare.litert.compiled_model`.

Two fixture models of the same structure with different weights (A and B): XNNPACK keys its cache by buffer
index, so A's cache given to LiteRT with B computes with A's weights. The helper must never do that.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert.compiled_model import CompiledModel
from ai_edge_litert.cpu_options import CpuOptions
from ai_edge_litert.options import Options
from tflite_fixtures import run_compiled_model, sample_model

from weightshare._outputs_record import RECORD
from weightshare.api import convert
from weightshare.formats.tflite import xnnpack_cache
from weightshare.formats.tflite.cache_record import record_path
from weightshare.litert import compiled_model
from weightshare.options import ConvertOptions


def run(cm) -> dict:
    """Every signature of ``cm`` on the fixture inputs: {signature: {output: array}}."""
    return run_compiled_model(cm)


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for k in a
        for x, y in ((a[k][n], b[k][n]) for n in a[k])
    )


def copy_cache(cache: Path, dst: Path) -> Path:
    """A cache and the record convert --prepack wrote beside it (size, checksum), copied to ``dst``."""
    shutil.copy(cache, dst)
    shutil.copy(record_path(cache), record_path(dst))
    return dst


def with_cache(model: Path, cache: Path):
    """LiteRT directly, with whatever cache it is given (what the helper must avoid for foreign caches)."""
    return CompiledModel.from_file(
        str(model), options=Options(cpu_options=CpuOptions(num_threads=1, xnnpack_weight_cache_path=str(cache)))
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(A, B): original, converted with --prepack, its cache, its report, reference outputs (no cache)."""
    root = tmp_path_factory.mktemp("prepack")
    made = []
    for name, seed in (("a", 0), ("b", 7)):
        src = sample_model(root / f"{name}.tflite", seed=seed)
        report = convert(src, root / f"out_{name}", ConvertOptions(prepack=True))
        reference = run(CompiledModel.from_file(str(src)))
        made.append((src, root / f"out_{name}" / src.name, Path(report.outputs[-1]), report, reference))
    assert not same(made[0][4], made[1][4])  # different weights, different outputs
    return made


def test_cache_in_report_outputs_and_named_by_content(pair):
    _src, out, cache, report, _ref = pair[0]
    assert report.outputs == [str(out), str(cache)]
    assert cache.is_file() and cache.stat().st_size > 1 << 20  # the packed fp32 weights (4 MiB)
    assert cache.name == xnnpack_cache.cache_name(out.name, xnnpack_cache.content_digest(out))
    assert xnnpack_cache.litert_version() in cache.name
    assert any("built in a child process: peak RSS" in n for n in report.notes)
    assert oct(cache.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".weightshare-tmp")]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_helper_uses_cache_read_only_and_is_bit_identical(pair):
    _src, out, cache, _report, reference = pair[0]
    before = cache.stat()
    os.chmod(cache, 0o444)
    try:
        cms = [compiled_model(out) for _ in range(2)]
        assert all(cm.weightshare_cache == cache for cm in cms)
        assert all(same(run(cm), reference) for cm in cms)
    finally:
        os.chmod(cache, 0o644)
    after = cache.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


def test_foreign_cache_is_never_used(pair, tmp_path, caplog):
    (_sa, _oa, cache_a, _ra, _ref_a), (_sb, out_b, _cb, _rb, ref_b) = pair
    model_b = tmp_path / out_b.name
    shutil.copy(out_b, model_b)
    foreign = tmp_path / cache_a.name.replace(cache_a.name.split(".litert-")[0], model_b.name)
    shutil.copy(cache_a, foreign)  # A's cache, named like one of B's
    # The danger is real: LiteRT given A's cache with B computes with A's packed weights (B's ADD constants).
    assert not same(run(with_cache(model_b, foreign)), ref_b)
    shutil.copy(cache_a, foreign)
    stamp = foreign.stat().st_mtime_ns
    with caplog.at_level(logging.WARNING, logger="weightshare.litert"):
        cm = compiled_model(model_b)
    assert cm.weightshare_cache is None
    assert same(run(cm), ref_b)
    assert foreign.stat().st_mtime_ns == stamp  # not handed to LiteRT, so not rewritten either
    records = [r for r in caplog.records if r.name == "weightshare.litert"]
    assert len(records) == 1 and "does not match" in records[0].getMessage()
    statuses = xnnpack_cache.cache_status(model_b)
    assert [(s.path, s.matches) for s in statuses] == [(foreign, False)]
    assert "built for other content" in statuses[0].reason


@pytest.mark.slow
def test_check_flags_a_foreign_cache_and_passes_a_matching_one(pair, tmp_path, cli):
    """`check` exits 1 with xnnpack-cache-mismatch when a cache beside the model was built for other content."""
    (_sa, _oa, cache_a, _ra, _ref_a), (_sb, out_b, cache_b, _rb, _ref_b) = pair
    model_b = tmp_path / out_b.name
    for f in out_b.parent.iterdir():  # the model, its blob and its own cache
        shutil.copy(f, tmp_path / f.name)
    ok = cli("check", model_b, "--json")
    assert ok.returncode == 0 and "xnnpack-cache-mismatch" not in ok.stdout, ok.stdout + ok.stderr
    foreign = tmp_path / cache_b.name.replace(".litert-", ".litert-0")  # another cache name beside B ...
    shutil.copy(cache_a, foreign)  # ... holding A's packed weights
    bad = cli("check", model_b, "--json")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    found = [f for f in json.loads(bad.stdout)["findings"] if f["code"] == "xnnpack-cache-mismatch"]
    assert len(found) == 1 and foreign.name in found[0]["message"] and found[0]["severity"] == "error"


def test_missing_cache_falls_back_with_one_message(pair, tmp_path, caplog):
    _src, out, _cache, _report, reference = pair[1]
    model = tmp_path / out.name
    shutil.copy(out, model)
    with caplog.at_level(logging.WARNING, logger="weightshare.litert"):
        cm = compiled_model(model)
    assert cm.weightshare_cache is None and same(run(cm), reference)
    records = [r for r in caplog.records if r.name == "weightshare.litert"]
    assert len(records) == 1 and "no XNNPACK weight cache" in records[0].getMessage()
    assert sorted(p.name for p in tmp_path.iterdir()) == [model.name]  # LiteRT was given no path to write


def test_changed_model_no_longer_matches(pair, tmp_path):
    """Any byte of the model (here: one weight byte at the end of the file) is part of the binding."""
    _src, out, cache, _report, _ref = pair[0]
    model = tmp_path / out.name
    shutil.copy(out, model)
    copy_cache(cache, tmp_path / cache.name)
    assert [s.matches for s in xnnpack_cache.cache_status(model)] == [True]
    data = bytearray(model.read_bytes())
    data[-100] ^= 1
    model.write_bytes(bytes(data))
    assert [s.matches for s in xnnpack_cache.cache_status(model)] == [False]
    other_version = cache.name.replace(f"litert-{xnnpack_cache.litert_version()}", "litert-0.0.1")
    shutil.copy(cache, tmp_path / other_version)
    reasons = {s.path.name: s.reason for s in xnnpack_cache.cache_status(model)}
    assert "built with LiteRT 0.0.1" in reasons[other_version]
    other_model = cache.name.replace(out.name, f"{out.name}.b.tflite")  # another model's cache: not this one's
    shutil.copy(cache, tmp_path / other_model)
    assert other_model not in {s.path.name for s in xnnpack_cache.cache_status(model)}


def test_external_prepack_binds_the_blob(pair, tmp_path):
    src, _out, _cache, _report, reference = pair[0]
    report = convert(src, tmp_path, ConvertOptions(external=True, prepack=True))
    model, blob, cache = (Path(p) for p in report.outputs)
    assert blob.suffix == ".safetensors" and cache.name.endswith(xnnpack_cache.CACHE_SUFFIX)
    cm = compiled_model(model)
    assert cm.weightshare_cache == cache and same(run(cm), reference)
    with open(blob, "r+b") as f:  # one payload byte of the blob changes: the cache no longer matches
        f.seek(-64, os.SEEK_END)
        byte = f.read(1)
        f.seek(-64, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    assert compiled_model(model).weightshare_cache is None


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != RECORD)  # the outputs record: bookkeeping


def _with_records(*caches: Path) -> list[str]:
    return [n for c in caches for n in (c.name, record_path(c).name)]


@pytest.mark.slow
def test_reconvert_replaces_the_cache(pair, tmp_path):
    """With no grace period (--blob-grace 0) a cache goes as soon as a re-conversion no longer matches it."""
    src, _out, _cache, _report, _ref = pair[0]
    now = {"blob_grace_s": 0.0}
    first = Path(convert(src, tmp_path, ConvertOptions(prepack=True, **now)).outputs[-1])
    second = Path(convert(src, tmp_path, ConvertOptions(prepack=True, inline_threshold=4096, **now)).outputs[-1])
    assert first != second
    assert _names(tmp_path) == sorted([src.name, *_with_records(second)])
    again = Path(convert(src, tmp_path, ConvertOptions(prepack=True, inline_threshold=4096, **now)).outputs[-1])
    assert again == second  # deterministic output, same name
    convert(src, tmp_path, ConvertOptions(inline_threshold=4096, **now))  # same output without --prepack: kept
    assert _names(tmp_path) == sorted([src.name, *_with_records(second)])
    convert(src, tmp_path, ConvertOptions(**now))  # other output: the cache no longer matches and goes
    assert _names(tmp_path) == [src.name]


@pytest.mark.slow
def test_superseded_cache_stays_for_the_grace_period(pair, tmp_path):
    """A re-conversion removed the old cache at once, so a reader that had opened the old
    model hit a raw FileNotFoundError. The old cache now stays until --blob-grace has passed since the commit that
    superseded it (its drop time in the outputs record)."""
    src, _out, _cache, _report, _ref = pair[0]
    first = Path(convert(src, tmp_path, ConvertOptions(prepack=True)).outputs[-1])
    second = Path(convert(src, tmp_path, ConvertOptions(prepack=True, inline_threshold=4096)).outputs[-1])
    assert _names(tmp_path) == sorted([src.name, *_with_records(first, second)])
    convert(src, tmp_path, ConvertOptions(prepack=True, inline_threshold=4096, blob_grace_s=3600))
    assert first.exists()  # within the grace period
    convert(src, tmp_path, ConvertOptions(prepack=True, inline_threshold=4096, blob_grace_s=0))
    assert _names(tmp_path) == sorted([src.name, *_with_records(second)])


def test_interpreter_costs(pair):
    src, out, cache, _report, _ref = pair[0]
    fp32 = 4 * 1024 * 1024  # the fixture's FULLY_CONNECTED weights (1024 x 1024) dominate
    orig = {c.setting: c for c in xnnpack_cache.interpreter_costs(src)}
    conv = {c.setting: c for c in xnnpack_cache.interpreter_costs(out)}
    nodelegate, xnn, cached = (
        "Interpreter, no delegate",
        "Interpreter, default XNNPACK",
        "CompiledModel + XNNPACK weight cache",
    )
    assert orig[nodelegate].per_instance_bytes >= fp32 and conv[nodelegate].per_instance_bytes == 0
    assert orig[xnn].per_instance_bytes >= fp32 and conv[xnn].per_instance_bytes >= fp32
    # default XNNPACK: the converted model costs more (the fp32 file pages), never less
    assert conv[xnn].total(1) - orig[xnn].total(1) >= fp32 // 2
    assert conv[cached].per_instance_bytes == 0
    assert cache.stat().st_size <= conv[cached].shared_bytes < cache.stat().st_size + fp32 // 8


def test_unpack_note_and_keep_packed(pair, tmp_path):
    _src, _out, _cache, report, _ref = pair[0]
    assert any("gains nothing from this conversion" in n and "compiled_model" in n for n in report.notes)
    packed = convert(pair[0][0], tmp_path, ConvertOptions(keep_packed=True))
    assert not any("gains nothing" in n for n in packed.notes)


def test_cli_prepack_with_shared_blob_is_a_usage_error(pair, tmp_path):
    src = pair[0][0]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightshare",
            "convert",
            str(src),
            "-o",
            str(tmp_path / "z"),
            "--external",
            "--shared-blob",
            "zoo.safetensors",
            "--prepack",
            "-q",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--prepack" in r.stderr
    assert not (tmp_path / "z").exists() or not any((tmp_path / "z").iterdir())


@pytest.mark.slow
def test_verify_runs_compiled_model_with_the_cache(pair):
    from weightshare._dispatch import verify

    src, out, cache, _report, _ref = pair[0]
    report = verify(src, out, runs=1)
    assert report.passed and report.mismatches == [] and any(cache.name in p for p in report.paths)
    other = verify(pair[1][0], out, runs=1)  # B's original against A's conversion: both runtimes see it
    assert any(m.startswith("run 0: output CompiledModel + ") for m in other.mismatches)


def test_model_replaced_while_loading_leaves_no_misnamed_cache(pair, tmp_path, monkeypatch):
    """A re-conversion commits between the helper's digest and LiteRT's load, and the old cache is gone: LiteRT
    then packs the NEW model into a file named for the OLD one. The helper notices, removes it and loads again."""
    import weightshare.litert as helper

    (_sa, out_a, cache_a, _ra, _ref_a), (_sb, out_b, _cb, _rb, ref_b) = pair
    model = tmp_path / out_a.name
    shutil.copy(out_a, model)
    copy_cache(cache_a, tmp_path / cache_a.name)
    real = helper.open_cache
    calls = []

    def find_then_replace(path):
        found = real(path)
        if not calls:  # first lookup: A's cache matches; then B's conversion lands and A's cache is removed
            shutil.copy(out_b, tmp_path / "incoming")
            os.replace(tmp_path / "incoming", model)
            (tmp_path / cache_a.name).unlink()
            record_path(tmp_path / cache_a.name).unlink()
        calls.append(found)
        return found

    monkeypatch.setattr(helper, "open_cache", find_then_replace)
    cm = helper.compiled_model(model)
    assert calls[0][0] == tmp_path / cache_a.name and calls[1][0] is None
    assert cm.weightshare_cache is None and same(run(cm), ref_b)
    assert sorted(p.name for p in tmp_path.iterdir()) == [model.name]  # LiteRT's misnamed cache was removed


def test_group_names_of_damaged_models_fail_cleanly(pair, tmp_path):
    """The helper's own flatbuffer walk (no schema module): damaged files give WeightshareError, nothing else."""
    from weightshare.errors import WeightshareError

    src = pair[0][0]
    model, blob = (Path(p) for p in convert(src, tmp_path / "ext", ConvertOptions(external=True)).outputs)
    assert xnnpack_cache.referenced_files(model) == [blob]
    data = model.read_bytes()
    rng = np.random.default_rng(0)
    damaged = tmp_path / "ext" / "damaged.tflite"
    for i in range(300):
        b = bytearray(data[: int(rng.integers(0, len(data)))] if i % 3 == 0 else data)
        for _ in range(4):
            if b:
                b[int(rng.integers(0, min(len(b), 256)))] = int(rng.integers(0, 256))
        damaged.write_bytes(bytes(b))
        try:
            xnnpack_cache.referenced_files(damaged)
        except WeightshareError:
            pass


_PSS_PROBE = """
import json, sys
import numpy as np
from ai_edge_litert.compiled_model import CompiledModel
from weightshare.litert import compiled_model

def pss():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024

path, n, use_helper = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
base, keep = pss(), []
for _ in range(n):
    cm = compiled_model(path) if use_helper else CompiledModel.from_file(path)
    ins, outs = cm.create_input_buffers(0), cm.create_output_buffers(0)
    ins[0].write(np.ones((1, 8, 8, 3), np.float32))
    cm.run_by_index(0, ins, outs)
    keep.append((cm, ins, outs))
print(json.dumps(pss() - base))
"""


@pytest.mark.slow
def test_compiled_models_share_the_cache(tmp_path):
    """PSS of 4 CompiledModels through the helper stays near one; without the cache each packs its own 32 MiB."""
    src = sample_model(tmp_path / "wide.tflite", fc_out=8192)  # FULLY_CONNECTED 8192 x 1024: 32 MiB as fp32
    out = Path(convert(src, tmp_path / "out", ConvertOptions(prepack=True)).outputs[0])

    def pss(n: int, helper: bool) -> float:
        r = subprocess.run(
            [sys.executable, "-c", _PSS_PROBE, str(out), str(n), "1" if helper else "0"],
            capture_output=True,
            text=True,
            check=True,
        )
        return float(r.stdout.strip().splitlines()[-1])

    weights = 32.0
    one, four = pss(1, True), pss(4, True)
    assert four < one + weights / 2, (one, four)
    assert pss(4, False) > one + 2 * weights  # the same model without the cache: a packed copy per instance


def test_failed_cache_build_leaves_nothing(pair, tmp_path, monkeypatch):
    """The cache builder dies (here: the interpreter it runs exits 1 at once): one error, no model, no cache."""
    from weightshare.errors import Unsupported

    monkeypatch.setattr(sys, "executable", shutil.which("false"))
    with pytest.raises(Unsupported, match="could not build the XNNPACK weight cache"):
        convert(pair[0][0], tmp_path, ConvertOptions(prepack=True))
    assert list(tmp_path.iterdir()) == []
