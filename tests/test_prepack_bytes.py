"""``convert --prepack`` writes each byte once: the bytes a conversion writes (its process tree's ``ru_oublock``,
read with ``os.wait4``) stay within 1.3x of its outputs' size, for a model ORT optimizes in one piece and packs
node by node, for one it optimizes segment by segment, for a MatMul+Conv model (NCHWc-reordered Conv weights
beside packed MatMul weights), and with ``--unpack ort-cpu`` (an fp16 decoder, whose rounding check saves the
original's weights folded to fp32).

Before, the staged blob was copied into the final one and every ORT session wrote every weight it saved to a
file of its own: 2.5-3x. A byte count, not a timing: the same on a loaded machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import model_forms as mf
import pytest
from prepack_samples import mixed_onnx

from weightshare.formats.onnx.disk_use import SCRATCH_ENV, SCRATCH_PREFIX, sweep_scratch
from weightshare.formats.onnx.ort.segments import BUDGET_ENV

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 1.3
CHILD_ENV = {
    "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
    "PYTHONDONTWRITEBYTECODE": "1",  # a .pyc written on first import is not the conversion's
}


def written_by(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, bytes]:
    """Bytes the process tree of ``cmd`` wrote (its ``ru_oublock`` x 512: every descendant was waited for), and
    its stdout (small: read once it exited)."""
    p = subprocess.Popen(
        cmd, env={**os.environ, **CHILD_ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    _pid, status, usage = os.wait4(p.pid, 0)
    assert p.stderr is not None and p.stdout is not None
    assert os.waitstatus_to_exitcode(status) == 0, p.stderr.read().decode()[-2000:]
    return usage.ru_oublock * 512, p.stdout.read()


def outputs(out: Path) -> int:
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and not f.name.startswith("."))


@pytest.fixture
def counted(tmp_path: Path) -> Path:
    """``tmp_path``, where writes are counted (not a memory-backed file system, which counts none)."""
    probe = tmp_path / "probe"
    code = f"import os; f = open({str(probe)!r}, 'wb'); f.write(os.urandom(1 << 20)); f.flush(); os.fsync(f.fileno())"
    if written_by([sys.executable, "-c", code])[0] < 1 << 20:
        pytest.skip("the temporary directory's file system does not count bytes written")
    probe.unlink()
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize(
    ("form", "budget", "segments"),
    [
        ("merged_decoder", None, 1),  # an If: one piece, packed node by node
        ("fp32", 1 << 20, 2),  # cut in segments, each segment's session saving its packed copies
        ("mixed", 3 << 20, 2),  # Conv chain then MatMul/Gemm layers, in segments
        ("llama_fp16", None, 1),  # --unpack ort-cpu: its rounding check's saved windows are never written
    ],
)
def test_prepack_writes_each_byte_once(counted: Path, form: str, budget: int | None, segments: int) -> None:
    if form == "mixed":
        (counted / "src").mkdir()
        src = mixed_onnx(counted / "src" / "model.onnx", conv_layers=3, channels=256, mm_layers=4, dim=768)
    else:
        src = mf.build(form, counted / "src" / "model.onnx", mib=8)
    out = counted / "out"
    env = {BUDGET_ENV: str(budget)} if budget else {}
    shm = Path(tempfile.mkdtemp(dir="/dev/shm")) if os.path.isdir("/dev/shm") else None
    if shm is not None:  # a private root for the run's scratch: what it leaves behind is seen
        env[SCRATCH_ENV] = str(shm)
    cmd = [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "--prepack", "-q", "--json"]
    if form == "llama_fp16":
        cmd += ["--unpack", "ort-cpu"]
    try:
        written, stdout = written_by(cmd, env)
        assert shm is None or not list(shm.iterdir())  # the scratch went with the run
    finally:
        if shm is not None:
            shutil.rmtree(shm)
    (report,) = json.loads(stdout)["reports"]
    assert report["prepack"]["segments"]["segments"] >= segments  # the route this case is for
    size = outputs(out)
    assert size > 8 << 20  # the plain weights and their packed (or reordered) copies
    assert written <= LIMIT * size, f"{written / 2**20:.1f} MiB written for {size / 2**20:.1f} MiB of outputs"


def test_a_dead_runs_scratch_is_swept_a_live_ones_kept(tmp_path: Path) -> None:
    """A run killed with -9 leaves its scratch in memory: the next run removes it, never one a live run holds."""
    import fcntl

    live, other = tmp_path / f"{SCRATCH_PREFIX}live", tmp_path / "other"
    dead = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=tmp_path))  # as a run makes it
    yours = tmp_path / f"{SCRATCH_PREFIX}notes"  # named like one, but not as a run makes it: a user's
    for d in (live, other, yours):
        d.mkdir()
    for d in (dead, live, other, yours):
        (d / "ort.seg0-4.bin").write_bytes(b"x" * 4096)
    (tmp_path / f"{SCRATCH_PREFIX}link").symlink_to(other)  # a name like a scratch's, a directory it never made
    held = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        sweep_scratch(str(tmp_path))
        assert not dead.exists() and live.exists() and other.exists()
        assert (yours / "ort.seg0-4.bin").exists()
        assert (other / "ort.seg0-4.bin").exists()  # nothing removed through the link
    finally:
        os.close(held)


@pytest.mark.slow
def test_a_header_outgrowing_its_room_streams_a_new_blob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the final header would not fit the room the staged blob reserved, every payload is streamed into a new
    blob, as before: the same outputs as the blob written in place."""
    import numpy as np
    import onnxruntime as ort

    import weightshare
    from weightshare._safetensors import SafetensorsBlob, read_safetensors_metadata

    src = mf.build("fp32", tmp_path / "src" / "model.onnx", mib=1)
    weightshare.convert(src, tmp_path / "in_place", prepack=True)
    monkeypatch.setattr(SafetensorsBlob, "header_fits", lambda self: False)
    streamed = weightshare.convert(src, tmp_path / "streamed", prepack=True)
    (blob,) = [o for o in streamed.outputs if o.endswith(".safetensors")]
    _start, tensors, _payloads = read_safetensors_metadata(blob)
    assert any(name.startswith("ort.prepacked/") for name in tensors)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    for out in ("in_place", "streamed"):
        got = ort.InferenceSession(str(tmp_path / out / "model.onnx"), providers=["CPUExecutionProvider"])
        for batch in (1, 8):
            feeds = mf.feeds(src, batch=batch)
            assert all(np.array_equal(a, b) for a, b in zip(want.run(None, feeds), got.run(None, feeds))), out


def _io_written() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def test_a_staged_duplicate_is_hashed_before_it_is_written(counted: Path) -> None:
    """A zoo's models are staged alike: a staged range whose bytes the blob already holds is recognised before it is
    copied, not written and truncated away (the zoo's blob then writes its shared weights once)."""
    from weightshare._placement import BlobWriter
    from weightshare.formats.onnx.disk_use import ReleasedRange

    if not os.path.exists("/proc/self/io"):
        pytest.skip("no per-process I/O accounting here")
    data = os.urandom(2 << 20)
    staged = counted / "staged"
    staged.write_bytes(data + data)  # model 1's weight and model 2's copy of it
    fd = os.open(counted / "blob", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        w = BlobWriter(fd)
        first = w.add(ReleasedRange(str(staged), 0, len(data), releasable=False))
        before = _io_written()
        again = w.add(ReleasedRange(str(staged), len(data), len(data), releasable=False))
        written = _io_written() - before
    finally:
        os.close(fd)
    assert again.duplicate and again.offset == first.offset
    assert written < len(data) // 2, f"{written} bytes written for a duplicate of {len(data)}"


FAMILY = ("decoder_model.onnx", "decoder_with_past_model.onnx", "decoder_model_merged.onnx")


@pytest.mark.slow
@pytest.mark.parametrize("route", ["models", "folder"])
@pytest.mark.parametrize("prepack", [True, False], ids=["prepack", "plain"])
def test_a_shared_blob_writes_each_byte_once(counted: Path, route: str, prepack: bool) -> None:
    """``--shared-blob``: a decoder family (three models holding the same weights) given as models or as its folder.
    Its one blob holds each weight (and, with --prepack, each packed copy) once, and each is written once: a later
    model's payload is recognised by its digest before it is written, and with --prepack every model is staged
    into one blob, which becomes the zoo's in place. Before: staged per model then copied, 2.8-2.9x. Every model
    (and portable twin) computes the original's outputs, bit for bit, at batch 1 and 8."""
    import numpy as np
    import onnxruntime as ort

    from weightshare.formats.onnx.ort.prepack import portable_name

    src = counted / "src"
    mf.decoder_family(src, mib=8)
    out = counted / "out"
    given = [str(src)] if route == "folder" else [str(src / n) for n in FAMILY]
    cmd = [sys.executable, "-m", "weightshare", "convert", *given, "-o", str(out), "--shared-blob", "fam", "-q"]
    written, _ = written_by(cmd + (["--prepack"] if prepack else []))
    size = outputs(out)
    assert len(list(out.glob("fam.*.safetensors"))) == 1
    assert size > (14 << 20 if prepack else 7 << 20)  # the weights once (and their packed copies)
    assert written <= LIMIT * size, f"{written / 2**20:.1f} MiB written for {size / 2**20:.1f} MiB of outputs"
    off = ort.SessionOptions()
    off.add_session_config_entry("session.disable_prepacking", "1")
    for name in FAMILY:
        pairs = [(ort.InferenceSession(str(src / name)), ort.InferenceSession(str(out / name)))]
        if prepack:  # the portable twin, at the options it is for
            pairs.append(
                (ort.InferenceSession(str(src / name), off), ort.InferenceSession(str(out / portable_name(name)), off))
            )
        for batch in (1, 8):
            for cache in (True, False) if "merged" in name else (True,):
                feeds = mf.feeds(src / name, batch=batch, use_cache_branch=cache)
                for want, got in pairs:
                    for a, b in zip(want.run(None, feeds), got.run(None, feeds)):
                        assert np.array_equal(a, b), (name, batch, cache)


@pytest.mark.slow
@pytest.mark.parametrize("fits", [True, False], ids=["in_place", "streamed"])
def test_a_zoo_packing_again_what_it_holds_keeps_the_same_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fits: bool
) -> None:
    """A zoo whose later models pack again what an earlier one packed (no packing reused): what their children
    append only repeats the staged blob and is cut off, so the outputs are the files of a run that reused the
    packings, byte for byte. Where the header would not fit its room, every payload is streamed into a new blob
    from the staged one (the repeated ranges read where their first copy is): the same outputs as the originals."""
    import numpy as np
    import onnxruntime as ort

    import weightshare
    from weightshare._safetensors import SafetensorsBlob
    from weightshare.formats.onnx.ort.prepack import REUSE_ENV

    src = tmp_path / "src"
    mf.decoder_family(src, mib=1)
    models = [src / n for n in FAMILY]
    weightshare.convert(models, tmp_path / "reused", prepack=True, shared_blob="fam")
    monkeypatch.setenv(REUSE_ENV, "0")
    if not fits:
        monkeypatch.setattr(SafetensorsBlob, "header_fits", lambda self: False)
    again = weightshare.convert(models, tmp_path / "again", prepack=True, shared_blob="fam")
    assert all(m.prepack["nodes_reused"] == 0 for m in again.models)

    def files(out: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and not p.name.startswith(".")}

    if fits:
        assert files(tmp_path / "reused") == files(tmp_path / "again")
    for name in FAMILY:
        want, got = ort.InferenceSession(str(src / name)), ort.InferenceSession(str(tmp_path / "again" / name))
        for batch in (1, 8):
            feeds = mf.feeds(src / name, batch=batch)
            assert all(np.array_equal(a, b) for a, b in zip(want.run(None, feeds), got.run(None, feeds))), name
