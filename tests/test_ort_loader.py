"""weightshare.ort.session: what it checks is what ORT runs; the blob's record is untrusted; plain conversions share."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from prepack_samples import mixed_onnx, sample_input

import weightshare.ort as wort
from weightshare._safetensors import read_safetensors_metadata
from weightshare.api import convert
from weightshare.errors import InvalidModel, WeightshareError
from weightshare.formats.onnx.ort.prepack import OPTIMIZED_PREFIX
from weightshare.formats.onnx.ort.prepack_record import METADATA_KEY, parse_record
from weightshare.options import ConvertOptions

_REAL_SESSION = ort.InferenceSession


def _blob(model: Path) -> Path:
    m = onnx.load(str(model), load_external_data=False)
    locs = {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
    assert len(locs) == 1
    return model.parent / locs.pop()


def _plain(path, level=None, **config):
    so = ort.SessionOptions()
    for k, v in config.items():
        so.add_session_config_entry(k, v)
    if level is not None:
        so.graph_optimization_level = level
    return _REAL_SESSION(str(path), so, providers=["CPUExecutionProvider"])


def _out(sess, src):
    return sess.run(None, sample_input(src, 4))[0]


def _flip(blob: Path, prefix: str) -> None:
    start, header, _meta = read_safetensors_metadata(str(blob))
    name = next(n for n in header if n.startswith(prefix))
    begin, end = header[name]["data_offsets"]
    pos = start + (begin + end) // 2 + 3  # a float's exponent byte
    with open(blob, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x40]))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two --prepack conversions of one architecture with other weights; the second's NCHWc weight flipped
    (ORT never validates those: alone, the helper refuses that blob and falls back)."""
    d = tmp_path_factory.mktemp("loader")
    (d / "a").mkdir()
    (d / "b").mkdir()
    a = mixed_onnx(d / "a" / "m.onnx", conv_layers=1, channels=16, dim=64)
    b = mixed_onnx(d / "b" / "m.onnx", conv_layers=1, channels=16, dim=64, seed=7)
    convert(a, d / "outa", ConvertOptions(prepack=True))
    convert(b, d / "outb", ConvertOptions(prepack=True))
    _flip(_blob(d / "outb" / "m.onnx"), OPTIMIZED_PREFIX)
    return a, d / "outa", d / "outb"


def _fresh(pair, tmp_path):
    a, outa, outb = pair
    out = tmp_path / "out"
    shutil.copytree(outa, out)
    shutil.copy(_blob(outb / "m.onnx"), out)  # B's (flipped) blob beside A's: a commit of B writes it first
    staged = out / ".next.onnx"
    shutil.copy(outb / "m.onnx", staged)
    return a, out, staged


@pytest.mark.slow
def test_a_model_renamed_over_between_check_and_load_does_not_change_what_runs(pair, tmp_path, monkeypatch):
    """The hook renames B over the model exactly when ORT is asked to load (after every check of A): the
    session computes A, as the model the helper checked; before, ORT opened B with its flipped weight."""
    a, out, staged = _fresh(pair, tmp_path)
    swapped = []

    def swap_then_load(*args, **kwargs):
        if not swapped:
            os.replace(staged, out / "m.onnx")
            swapped.append(True)
        return _REAL_SESSION(*args, **kwargs)

    monkeypatch.setattr(wort, "_warned", set())
    monkeypatch.setattr(ort, "InferenceSession", swap_then_load)
    sess = wort.session(out / "m.onnx")
    assert swapped
    assert np.array_equal(_out(sess, a), _out(_plain(a), a))


def test_a_blob_replaced_during_load_is_refused_in_one_line(pair, tmp_path, monkeypatch):
    """The blob's name renamed over while ORT loads: the session is dropped, InvalidModel (never B's bytes)."""
    a, out, _staged = _fresh(pair, tmp_path)
    blob = _blob(out / "m.onnx")
    other = tmp_path / "other.safetensors"
    shutil.copy(_blob(pair[2] / "m.onnx"), other)

    def swap_then_load(*args, **kwargs):
        if other.exists():
            os.replace(other, blob)
        return _REAL_SESSION(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", swap_then_load)
    with pytest.raises(InvalidModel, match="replaced while the session was created"):
        wort.session(out / "m.onnx")


def test_a_symlinked_model_or_blob_is_refused(pair, tmp_path):
    a, out, _staged = _fresh(pair, tmp_path)
    (tmp_path / "link.onnx").symlink_to(out / "m.onnx")
    with pytest.raises(InvalidModel, match="symlink"):
        wort.session(tmp_path / "link.onnx")
    blob = _blob(out / "m.onnx")
    os.replace(blob, tmp_path / "real.safetensors")
    blob.symlink_to(tmp_path / "real.safetensors")
    with pytest.raises(WeightshareError):  # resolves outside the model directory, or is a symlink: never opened
        wort.session(out / "m.onnx")


def _set_record(blob: Path, value) -> None:
    """Rewrite the blob's --prepack record in place, the header padded to its old length (offsets unchanged)."""
    with open(blob, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        if value is None:
            del header["__metadata__"][METADATA_KEY]
        else:
            header["__metadata__"][METADATA_KEY] = value if isinstance(value, str) else json.dumps(value)
        raw = json.dumps(header, separators=(",", ":")).encode()
        assert len(raw) <= n
        f.seek(8)
        f.write(raw + b" " * (n - len(raw)))


def _record(blob: Path) -> dict:
    _start, _header, _meta = read_safetensors_metadata(str(blob))
    with open(blob, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(json.loads(f.read(n))["__metadata__"][METADATA_KEY])


@pytest.mark.parametrize(
    "change",
    [
        {"portable_model": "../victim.onnx"},
        {"portable_model": "/tmp/victim.onnx"},
        {"portable_model": "sub/victim.onnx"},
        {"portable_model": "m.onnx"},
        {"nchwc_block": "8"},
        {"cpu_features": "avx2"},
        {"machine": None},
    ],
)
def test_a_hostile_record_is_invalid_model_and_opens_nothing_outside(pair, tmp_path, change, monkeypatch):
    """Before: ``../victim.onnx`` opened and ran a model outside OUTDIR (the fallback, on a flipped payload),
    and a wrong type raised AttributeError/TypeError out of the helper."""
    a, out, _staged = _fresh(pair, tmp_path)
    shutil.copy(pair[2] / "m.portable.onnx", tmp_path / "victim.onnx")  # a model outside OUTDIR, with its blob
    shutil.copy(_blob(pair[2] / "m.onnx"), tmp_path)
    blob = _blob(out / "m.onnx")
    rec = {**_record(blob), **change}
    _flip(blob, OPTIMIZED_PREFIX)  # so that the old helper falls back to the named portable model
    _set_record(blob, {k: v for k, v in rec.items() if v is not None})
    monkeypatch.setattr(wort, "_verified", set())
    with pytest.raises(InvalidModel, match=METADATA_KEY):
        wort.session(out / "m.onnx")


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", '"a string"', "7"])
def test_malformed_record_json_is_invalid_model(pair, tmp_path, raw):
    a, out, _staged = _fresh(pair, tmp_path)
    _set_record(_blob(out / "m.onnx"), raw)
    with pytest.raises(InvalidModel, match=METADATA_KEY):
        wort.session(out / "m.onnx")


def test_parse_record_is_the_shared_validation():
    good = {
        "onnxruntime": "1",
        "machine": "x86_64",
        "cpu_features": ["avx2"],
        "nchwc_block": 8,
        "prepacked_model": "m.onnx",
        "portable_model": "m.portable.onnx",
    }
    assert parse_record(json.dumps(good), "b")["packed_prefix"] == "ort.prepacked/"
    for bad in ("..\\x.onnx", "C:x.onnx", ".hidden.onnx", "a\x00.onnx", "x.txt", "", None, 3):
        with pytest.raises(InvalidModel):
            parse_record(json.dumps({**good, "portable_model": bad}), "b")
    with pytest.raises(InvalidModel):
        parse_record(json.dumps({**good, "nchwc_block": True}), "b")
    with pytest.raises(InvalidModel):
        parse_record(b"{}", "b")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    d = tmp_path_factory.mktemp("plain")
    (d / "mm").mkdir()
    (d / "cv").mkdir()
    mm = mixed_onnx(d / "mm" / "mm.onnx", conv_layers=0, channels=64, mm_layers=2, dim=128)
    cv = mixed_onnx(d / "cv" / "cv.onnx", conv_layers=2, channels=16, mm_layers=1, dim=32)
    convert(mm, d / "out")
    convert(cv, d / "out")
    return mm, cv, d / "out"


def test_a_plain_matmul_conversion_opens_with_disable_prepacking(plain, caplog, monkeypatch):
    """Before: default options, so every session packed a private copy of each MatMul/Gemm weight."""
    mm, _cv, out = plain
    monkeypatch.setattr(wort, "_warned", set())
    with caplog.at_level(logging.INFO, logger="weightshare.ort"):
        sess = wort.session(out / mm.name)
        wort.session(out / mm.name)
    said = [r.getMessage() for r in caplog.records if r.name == "weightshare.ort"]
    assert len(said) == 1 and "session.disable_prepacking=1" in said[0] and "EXTENDED" not in said[0]
    off = {"session.disable_prepacking": "1"}
    assert np.array_equal(_out(sess, mm), _out(_plain(mm, **off), mm))


def test_a_plain_conv_conversion_opens_at_the_level_that_does_not_copy(plain, caplog, monkeypatch):
    _mm, cv, out = plain
    if not wort.this_machine()["nchwc_block"]:
        pytest.skip("no NCHWc kernels on this CPU: ORT_ENABLE_ALL copies nothing")
    monkeypatch.setattr(wort, "_warned", set())
    with caplog.at_level(logging.INFO, logger="weightshare.ort"):
        sess = wort.session(out / cv.name)
    said = [r.getMessage() for r in caplog.records if r.name == "weightshare.ort"]
    assert len(said) == 1 and "ORT_ENABLE_EXTENDED" in said[0] and "2 Conv" in said[0]
    level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    expected = _out(_plain(cv, level, **{"session.disable_prepacking": "1"}), cv)
    assert np.array_equal(_out(sess, cv), expected)


def test_a_model_without_external_data_opens_with_the_defaults(tmp_path, caplog):
    src = mixed_onnx(tmp_path / "inline.onnx", conv_layers=0, channels=8, mm_layers=1, dim=8)
    model = onnx.load(str(src))  # weights read in: an ordinary self-contained model
    onnx.save(model, str(tmp_path / "self.onnx"))
    with caplog.at_level(logging.INFO, logger="weightshare.ort"):
        sess = wort.session(tmp_path / "self.onnx")
    assert not [r for r in caplog.records if r.name == "weightshare.ort"]
    assert np.array_equal(_out(sess, src), _out(_plain(tmp_path / "self.onnx"), src))


_PSS = """
import json, sys
import weightshare.ort as wort
from weightshare._runtimes.memory import memory_now
from prepack_samples import sample_input
path, src = sys.argv[1:]
sessions, rows = [], []
base = memory_now()["pss_mib"]
for n in range(4):
    s = wort.session(path)
    s.run(None, sample_input(src, 4))
    sessions.append(s)
    rows.append(memory_now()["pss_mib"] - base)
print(json.dumps(rows))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["matmul", "conv"])
def test_four_sessions_of_a_plain_conversion_cost_about_one(tmp_path, kind):
    """4 sessions <= 1.10x one (PSS above the interpreter's own), for MatMul and for Conv weights."""
    # ~55-65 MiB of weights: what a session holds besides them (activations, ORT's arena: 0.2-0.8 MiB at
    # these shapes) stays small beside them, as it does for real models
    if kind == "conv":
        src = mixed_onnx(tmp_path / "c.onnx", conv_layers=6, channels=512, mm_layers=0, dim=16, spatial=4)
    else:
        src = mixed_onnx(tmp_path / "m.onnx", conv_layers=0, channels=1024, mm_layers=4, dim=2048)
    convert(src, tmp_path / "out")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    res = subprocess.run(
        [sys.executable, "-c", _PSS, str(tmp_path / "out" / src.name), str(src)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout.splitlines()[-1])
    assert rows[3] <= 1.10 * rows[0], rows


def test_the_prepacked_choice_is_logged_once(pair, tmp_path, caplog, monkeypatch):
    a, out, _staged = _fresh(pair, tmp_path)
    monkeypatch.setattr(wort, "_warned", set())
    with caplog.at_level(logging.INFO, logger="weightshare.ort"):
        wort.session(out / "m.onnx")
        wort.session(out / "m.onnx")
    said = [r.getMessage() for r in caplog.records if r.name == "weightshare.ort"]
    assert len(said) == 1 and "pre-packed" in said[0]
