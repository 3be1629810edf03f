"""Collisions, staging, the bounded ORT child, zoo markers and re-conversion of --prepack outputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prepack_samples import mixed_onnx

from weightshare._atomic import TMP_PREFIX, OutputTransaction
from weightshare.errors import UsageError


def _nothing_left(out: Path) -> bool:
    return not out.exists() or list(out.iterdir()) == []


def _one_line(res) -> bool:
    return len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_a_companion_onto_another_models_output_is_refused_before_writing(tmp_path, cli):
    """Before: exit 0, and a.onnx's portable model was a.portable.onnx's prepacked graph (max diff 2.08)."""
    (tmp_path / "in").mkdir()
    a = mixed_onnx(tmp_path / "in" / "a.onnx", conv_layers=0, channels=8, mm_layers=1, dim=16)
    b = mixed_onnx(tmp_path / "in" / "a.portable.onnx", conv_layers=0, channels=8, mm_layers=1, dim=16, seed=3)
    res = cli("convert", a, b, "-o", tmp_path / "out", "--prepack", "-q")
    assert res.returncode == 2, res.stderr
    assert _one_line(res) and "a.portable.onnx" in res.stderr
    assert _nothing_left(tmp_path / "out")


def test_a_transaction_refuses_two_outputs_on_one_path(tmp_path):
    """The commit-time guard behind the up-front check: whatever a format stages (caches, blobs)."""
    with pytest.raises(UsageError, match="two outputs"):
        with OutputTransaction() as tx:
            tx.new_file(tmp_path / "x").write_bytes(b"1")
            tx.new_file(tmp_path / "x").write_bytes(b"2")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_reconverting_a_prepack_output_is_refused_in_one_line(tmp_path, cli):
    """Before: exit 0 with ORT's CPU-specific NCHWc graph written as a "portable" model."""
    from weightshare.api import convert
    from weightshare.options import ConvertOptions

    src = mixed_onnx(tmp_path / "m.onnx", conv_layers=1, channels=8, mm_layers=1, dim=16)
    convert(src, tmp_path / "one", ConvertOptions(prepack=True))
    res = cli("convert", tmp_path / "one" / "m.onnx", "-o", tmp_path / "two", "-q")
    assert res.returncode == 2, res.stderr
    assert _one_line(res) and "m.portable.onnx" in res.stderr
    assert _nothing_left(tmp_path / "two")
    with pytest.raises(UsageError, match="portable model m.portable.onnx"):  # refused before ORT runs
        convert(tmp_path / "one" / "m.onnx", tmp_path / "two", ConvertOptions(prepack=True))
    assert _nothing_left(tmp_path / "two")
    # its portable model is an ordinary converted model: that converts
    convert(tmp_path / "one" / "m.portable.onnx", tmp_path / "three")


def _zoo(tmp_path, listed):
    from weightshare.api import convert_zoo

    src = mixed_onnx(tmp_path / "m.onnx", conv_layers=0, channels=8, mm_layers=1, dim=16)
    out = tmp_path / "zoo"
    convert_zoo([src], out, "w")
    marker = out / ".weightshare-zoo.json"
    marker.write_text(json.dumps({"blob": "x", "models": listed}))
    (out / "keep.txt").write_text("not a model")
    return src, out, marker


def _refused_then_moved(src: Path, out: Path, marker: Path) -> None:
    """An edited marker is no longer the file weightshare wrote: the re-run replaces nothing, in one error; the
    marker moved away as the error asks, the next run goes on."""
    from weightshare.api import convert_zoo

    text = marker.read_bytes()
    with pytest.raises(UsageError, match="was changed or replaced since weightshare wrote it"):
        convert_zoo([src], out, "w")
    assert marker.read_bytes() == text
    marker.rename(out.parent / "marker.moved")


def test_a_zoo_marker_listing_a_nul_name_is_no_internal_error(tmp_path):
    """Before: the committed run ended in "internal error: ValueError" (os.unlink of a name with a NUL)."""
    from weightshare.api import convert_zoo

    src, out, marker = _zoo(tmp_path, ["a\x00b.onnx", "m.onnx", "keep.txt"])
    _refused_then_moved(src, out, marker)
    convert_zoo([src], out, "w")
    assert (out / "m.onnx").exists() and (out / "keep.txt").exists()  # and a listed non-model is not removed


def test_a_zoo_marker_listing_itself_keeps_the_new_marker(tmp_path):
    from weightshare.api import convert_zoo

    src, out, marker = _zoo(tmp_path, [".weightshare-zoo.json", "m.onnx"])
    _refused_then_moved(src, out, marker)
    convert_zoo([src], out, "w")
    assert json.loads(marker.read_text())["models"] == ["m.onnx"]


def _holder(directory: Path) -> subprocess.Popen[str]:
    """Another run's live writer: a process holding ``directory`` under flock until its stdin closes."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True)\n"
            "sys.stdin.read()\n",
            str(directory),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.slow
def test_a_stage_under_this_pid_held_by_another_namespace_survives(tmp_path):
    """Two containers sharing OUTDIR, the other run's PID equal to ours: its staging directory (old-style,
    PID-derived name) is held by its writer. Before: ``rmtree``d without its lock, so the other run failed."""
    from weightshare.api import convert
    from weightshare.options import ConvertOptions

    src = mixed_onnx(tmp_path / "m.onnx", conv_layers=1, channels=8, mm_layers=1, dim=16)
    out = tmp_path / "out"
    theirs = out / f"{TMP_PREFIX}{os.getpid()}-prepack"
    (theirs / "stage").mkdir(parents=True)
    (theirs / "stage" / "work").write_bytes(b"the other run's")
    holder = _holder(theirs)
    try:
        convert(src, out, ConvertOptions(prepack=True))
        assert (theirs / "stage" / "work").read_bytes() == b"the other run's"
    finally:
        holder.stdin.close()  # type: ignore[union-attr]
        holder.wait()
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith((TMP_PREFIX, ".weightshare-folder")))[:2] == [
        "m.onnx",
        "m.portable.onnx",
    ]
    assert [p for p in out.iterdir() if p.name.startswith(TMP_PREFIX)] == [theirs]  # ours is gone


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare as root")
def test_two_prepack_runs_in_two_pid_namespaces_both_succeed(tmp_path):
    """The real thing: two PID namespaces (each converter is PID 2 or so), one OUTDIR, at the same time."""
    srcs = []
    for i in range(2):
        (tmp_path / f"in{i}").mkdir()
        srcs.append(mixed_onnx(tmp_path / f"in{i}" / f"m{i}.onnx", conv_layers=1, channels=16, mm_layers=2, dim=64))
    out = tmp_path / "out"
    out.mkdir()
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "weightshare", "convert"]
    procs = [
        subprocess.Popen([*cmd, str(s), "-o", str(out), "--prepack", "-q"], stderr=subprocess.PIPE, text=True)
        for s in srcs
    ]
    errors = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    for i in range(2):
        assert (out / f"m{i}.onnx").exists() and (out / f"m{i}.portable.onnx").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_prepack_staging_is_named_uniquely_and_held(tmp_path):
    from weightshare._atomic import locked_stage

    with locked_stage(tmp_path, "prepack") as a, locked_stage(tmp_path, "prepack") as b:
        assert a != b and str(os.getpid()) not in a.name and a.parent == tmp_path
        from weightshare._atomic import clean_stale_temporaries

        assert clean_stale_temporaries(tmp_path) == []  # both held: a concurrent run's cleanup leaves them
        (a / "f").write_bytes(b"1")
    assert list(tmp_path.iterdir()) == []


def _fold_model(path: Path, n: int) -> Path:
    """118 bytes whose constant folding (Expand of a constant) makes an ``n``-float initializer."""
    import numpy as np
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    g = h.make_graph(
        [h.make_node("Expand", ["c", "shape"], ["e"]), h.make_node("Add", ["x", "e"], ["y"])],
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, [1])],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        [nh.from_array(np.array([1.0], np.float32), "c"), nh.from_array(np.array([n], np.int64), "shape")],
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


@pytest.mark.slow
def test_constant_folding_beyond_the_default_bound_is_refused_in_one_line(tmp_path, cli):
    """Before: a 136-byte model became a 256 MiB blob. Now ORT's writes stop at max(16 MiB, 4x the model)."""
    src = _fold_model(tmp_path / "fold.onnx", 6_000_000)  # 24 MB folded
    res = cli("convert", src, "-o", tmp_path / "out", "--prepack", "-q")
    assert res.returncode == 2, res.stderr
    assert _one_line(res) and "--ort-max-growth" in res.stderr and "16 MiB" in res.stderr
    assert _nothing_left(tmp_path / "out")


@pytest.mark.slow
def test_constant_folding_beyond_the_given_bound_is_refused_and_the_users_say_so_allows_it(tmp_path):
    from weightshare.api import convert
    from weightshare.errors import Unsupported
    from weightshare.options import ConvertOptions

    src = _fold_model(tmp_path / "fold.onnx", 400_000)  # 1.6 MB folded from 118 bytes: over 1 MiB
    with pytest.raises(Unsupported, match="--ort-max-growth"):
        convert(src, tmp_path / "out", ConvertOptions(prepack=True, ort_max_growth=1000.0))
    assert _nothing_left(tmp_path / "out")
    convert(src, tmp_path / "ok", ConvertOptions(prepack=True, ort_max_growth=100_000.0))


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [("--ort-child-timeout", "0.05", "wall time limit"), ("--ort-child-memory", "64", "memory limit")],
)
@pytest.mark.parametrize("mode", ["--prepack", "--unpack=ort-cpu"])
def test_an_ort_child_over_its_limit_is_exit_2_naming_the_limit(tmp_path, cli, flag, value, named, mode):
    src = mixed_onnx(tmp_path / "m.onnx", conv_layers=1, channels=8, mm_layers=1, dim=16)
    if mode != "--prepack":
        _to_fp16(src)
    res = cli("convert", src, "-o", tmp_path / "out", mode, flag, value, "-q")
    assert res.returncode == 2, res.stderr
    assert _one_line(res) and named in res.stderr and flag in res.stderr, res.stderr
    assert _nothing_left(tmp_path / "out")


def _to_fp16(path: Path) -> None:
    """The model with fp16 weights fed straight to its ops: ORT's CPU provider casts them per session."""
    import warnings

    import onnx
    from onnxconverter_common import float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)
    onnx.save(model, path)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


@pytest.mark.parametrize("mode", [pytest.param("--prepack", marks=pytest.mark.slow), "--unpack=ort-cpu"])
def test_kill_9_during_the_ort_child_leaves_no_process_and_nothing_in_tmpdir(tmp_path, mode):
    """Before (--unpack ort-cpu): $TMPDIR/weightshare-ortcpu-* stayed forever and the orphaned child kept
    writing. Now the child dies with the converter, its staging is in OUTDIR under a lock that dies too,
    and the next run into OUTDIR removes it."""
    import signal
    import time

    src = mixed_onnx(tmp_path / "m.onnx", conv_layers=1, channels=8, mm_layers=1, dim=16)
    if mode != "--prepack":
        _to_fp16(src)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    out = tmp_path / "out"
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    cmd = [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), mode, "-q"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL)
    deadline, seen = time.monotonic() + 60, []
    while time.monotonic() < deadline and proc.poll() is None:
        seen = [
            p
            for p in _descendants(proc.pid)
            if b"-c" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            or b"weightshare.formats.onnx.ort.child" in Path(f"/proc/{p}/cmdline").read_bytes()
        ]
        if seen:
            break
        time.sleep(0.005)
    assert seen, "the ORT child never started"
    kids = _descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{k}").exists() and _alive(k) for k in kids):
        time.sleep(0.05)
    assert not [k for k in kids if Path(f"/proc/{k}").exists() and _alive(k)], "a child outlived the converter"
    assert list(tmpdir.iterdir()) == []
    # what the killed run staged in OUTDIR is unlocked now: the next run removes it and converts
    ok = subprocess.run([*cmd[:4], str(src), "-o", str(out), "-q"], env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert not [p for p in out.iterdir() if p.name.startswith(TMP_PREFIX)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
