"""check measures one model at a time and reuses a measured verdict while nothing it depends on changed.

Before: every `check` started its measuring children again for every model (2 children per ONNX model, a dozen
sessions each, seconds to minutes per model), on every CI run of an unchanged folder. (Now one child measures a
folder's models one after another: tests/test_check_cost.py.)
Under test: `weightshare.check` in this process (``subprocess.Popen`` wrapped to count the runtime children it
starts, calling through to the real one; the children run the real onnxruntime) and the CLI.
After: a second check of an unchanged model starts no runtime child and says "measured (cached, DATE)" in text and
JSON with the same figures; a changed weight byte (same size, mtime restored), another runtime version or an
edited cache entry is measured again, never trusted, never a crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import weightshare

sys.path.insert(0, str(Path(__file__).parent))
import model_forms as mf  # noqa: E402

pytest.importorskip("onnxruntime")


@pytest.fixture
def started(monkeypatch):
    """The argv of every child process started from now on (through subprocess.Popen, as every runtime child is),
    and how many children of this process were alive when each started."""
    argvs: list[list[str]] = []
    live: list[int] = []
    real = subprocess.Popen

    class Counting(real):  # type: ignore[misc,valid-type]
        def __init__(self, args, *a, **k):
            argvs.append([str(x) for x in args])
            live.append(_live_children())
            super().__init__(args, *a, **k)

    monkeypatch.setattr(subprocess, "Popen", Counting)
    started_by = type("Started", (), {"argvs": argvs, "live": live})
    return started_by


def _live_children() -> int:
    me = os.getpid()
    n = 0
    for tid in os.listdir(f"/proc/{me}/task"):
        try:
            with open(f"/proc/{me}/task/{tid}/children") as f:
                n += len(f.read().split())
        except OSError:
            pass
    return n


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    home = tmp_path / "cache-home"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home / "weightshare" / "measured"


def _converted(tmp_path: Path, name: str = "m", seed: int = 0) -> Path:
    src = mf.build("fp32", tmp_path / f"src-{name}" / f"{name}.onnx", mib=0.25, seed=seed)
    weightshare.convert(src, tmp_path / "out")
    return tmp_path / "out" / f"{name}.onnx"


def _summary(report: weightshare.CheckReport) -> tuple[dict, str, list[str]]:
    (inv,) = report.models
    return dict(inv.measured), getattr(inv, "measured_cached", ""), list(inv.measure_notes)


@pytest.mark.slow
def test_a_second_check_of_an_unchanged_model_reuses_the_verdict(tmp_path, cache_home, started, cli):
    model = _converted(tmp_path)
    first = weightshare.check([model])
    measured, cached, _ = _summary(first)
    assert measured and not cached and started.argvs  # measured in runtime children
    started.argvs.clear()
    again = weightshare.check([model])
    assert started.argvs == []  # no runtime child started
    measured_again, cached, notes = _summary(again)
    assert measured_again == measured and cached
    assert notes[0].startswith(f"measured (cached, {cached})"), notes
    assert [f.line() for f in again.findings] == [f.line() for f in first.findings]
    assert again.exit_code == first.exit_code
    # the CLI says so in text (stderr notes) and JSON
    text = cli("check", model)
    assert f"note: {model}: measured (cached, {cached})" in text.stderr, text.stderr
    doc = json.loads(cli("check", model, "--json").stdout)
    assert doc["reports"][0]["measured_cached"] == cached and doc["reports"][0]["copies_source"] == "measured"
    assert doc["reports"][0]["measure_notes"][0].startswith("measured (cached,")
    # --no-cache measures again
    started.argvs.clear()
    fresh = weightshare.check([model], cache=False)
    assert started.argvs and not _summary(fresh)[1]


@pytest.mark.slow
def test_a_changed_weight_byte_is_measured_again(tmp_path, cache_home, started):
    model = _converted(tmp_path)
    weightshare.check([model])
    started.argvs.clear()
    assert _summary(weightshare.check([model]))[1] and not started.argvs  # cached
    inv = weightshare.inspect(model)
    payload = max((p for p in inv.payloads if p.location == "external"), key=lambda p: p.nbytes)
    blob = model.parent / payload.file
    st = blob.stat()
    with open(blob, "r+b") as f:  # one byte of a weight, same size, mtime put back
        f.seek(payload.offset + payload.nbytes // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert blob.stat().st_size == st.st_size and blob.stat().st_mtime_ns == st.st_mtime_ns
    report = weightshare.check([model])
    assert started.argvs, "the changed model was not measured again"
    assert not _summary(report)[1]
    assert any(f.code.value == "checksum-mismatch" for f in report.findings)


@pytest.mark.slow
def test_another_runtime_version_is_measured_again(tmp_path, cache_home, started, monkeypatch):
    from weightshare.formats.onnx import measure

    model = _converted(tmp_path)
    weightshare.check([model])
    started.argvs.clear()
    assert _summary(weightshare.check([model]))[1] and not started.argvs  # cached
    real = measure.runtime_facts

    def upgraded(name: str) -> dict[str, str]:  # what the key sees after `pip install -U onnxruntime`
        return {**real(name), "version": "99.0.0"}

    monkeypatch.setattr(measure, "runtime_facts", upgraded)
    report = weightshare.check([model])
    assert started.argvs and not _summary(report)[1]
    started.argvs.clear()
    assert _summary(weightshare.check([model]))[1] and not started.argvs  # the new key's own entry
    monkeypatch.setattr(measure, "runtime_facts", lambda name: {**real(name), "cpu_kind": "another-cpu"})
    assert not _summary(weightshare.check([model]))[1] and started.argvs


def _entries(cache_home: Path) -> list[Path]:
    return sorted(p for p in cache_home.iterdir() if len(p.name) == 48)


@pytest.mark.slow
def test_an_edited_cache_entry_is_ignored_and_rewritten(tmp_path, cache_home, started):
    model = _converted(tmp_path)
    measured = _summary(weightshare.check([model]))[0]
    (entry,) = _entries(cache_home)
    body, _, seal = entry.read_bytes().rpartition(b"\n")
    doc = json.loads(body)
    forged = {**doc, "measured": {k: 0 for k in doc["measured"]}}  # a model made to pass, seal left as it was
    key = (cache_home / "key").read_bytes()
    import hashlib
    import hmac

    sealed_garbage = json.dumps({**doc, "measured": {"ort-default": "lots"}, "notes": 7}).encode()
    for content in (
        json.dumps(forged).encode() + b"\n" + seal,
        b"\x00\xff not json" + entry.read_bytes()[:40],  # damaged
        sealed_garbage
        + b"\n"
        + hmac.new(key, sealed_garbage, hashlib.sha256).hexdigest().encode(),  # sealed, ill-typed
    ):
        entry.write_bytes(content)
        started.argvs.clear()
        report = weightshare.check([model])
        got, cached, _ = _summary(report)
        assert started.argvs and not cached, content  # measured again: never trusted
        assert set(got) == set(measured)
        started.argvs.clear()
        assert _summary(weightshare.check([model]))[1] and not started.argvs  # rewritten: reused again
    # a cache directory others can write to is not used at all
    cache_home.chmod(0o777)
    started.argvs.clear()
    assert not _summary(weightshare.check([model]))[1] and started.argvs
    cache_home.chmod(0o700)


@pytest.mark.slow
def test_a_folder_is_measured_one_model_at_a_time(tmp_path, cache_home, started, monkeypatch):
    a, b = _converted(tmp_path, "a", 0), _converted(tmp_path, "b", 1)
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("WEIGHTSHARE_MEASURE_TRACE", str(trace))
    started.argvs.clear()
    report = weightshare.check([tmp_path / "out"])
    assert [Path(m.model).name for m in report.models] == ["a.onnx", "b.onnx"]
    assert len(started.argvs) == 1 and started.live == [0]  # one measuring child for the folder
    calls = [json.loads(line) for line in trace.read_text().splitlines()]
    order = [Path(c["model"]).name for c in calls]
    assert order == sorted(order) and set(order) == {a.name, b.name}, order  # every call of a, then b's
    assert all(c["earlier_alive"] == 0 for c in calls), calls  # no session of an earlier call still open


def test_the_content_digest_covers_every_data_file_byte_a_payload_holds(tmp_path):
    """No runtime: the key's content part changes with any payload byte and not with the file's mtime."""
    from weightshare import _measure_cache

    model = _converted(tmp_path)
    inv = weightshare.inspect(model)
    before = _measure_cache.content_digest(inv, model)
    os.utime(model.parent / inv.external_files[0], (1, 1))
    assert _measure_cache.content_digest(weightshare.inspect(model), model) == before
    model.write_bytes(model.read_bytes())  # same bytes rewritten
    assert _measure_cache.content_digest(weightshare.inspect(model), model) == before
    config = model.parent / "config.json"  # a side file the measuring run sizes inputs from
    absent = _measure_cache.content_digest(inv, model, [config])
    config.write_text("{}")
    assert _measure_cache.content_digest(inv, model, [config]) not in (absent, before)
