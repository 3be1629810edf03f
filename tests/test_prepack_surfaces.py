"""Issue 22: collisions, staging, the bounded ORT child, zoo markers and re-conversion of --prepack outputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from weightshare.atomic import TMP_PREFIX, OutputTransaction
from weightshare.errors import UsageError
from weightshare.formats.onnx.prepack_samples import mixed_onnx


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


def test_reconverting_a_prepack_output_is_refused_in_one_line(tmp_path, cli):
    """Before: exit 0 with ORT's CPU-specific NCHWc graph written as a "portable" model."""
    src = mixed_onnx(tmp_path / "m.onnx", conv_layers=1, channels=8, mm_layers=1, dim=16)
    assert cli("convert", src, "-o", tmp_path / "one", "--prepack", "-q").returncode == 0
    for flags in ((), ("--prepack",)):
        res = cli("convert", tmp_path / "one" / "m.onnx", "-o", tmp_path / "two", "-q", *flags)
        assert res.returncode == 2, res.stderr
        assert _one_line(res) and "m.portable.onnx" in res.stderr
        assert _nothing_left(tmp_path / "two")
    # its portable model is an ordinary converted model: that converts
    res = cli("convert", tmp_path / "one" / "m.portable.onnx", "-o", tmp_path / "three", "-q", "--prepack")
    assert res.returncode == 0, res.stderr


def _zoo(tmp_path, cli, listed):
    src = mixed_onnx(tmp_path / "m.onnx", conv_layers=0, channels=8, mm_layers=1, dim=16)
    out = tmp_path / "zoo"
    assert cli("convert", src, "-o", out, "--shared-blob", "w", "-q").returncode == 0
    marker = out / ".weightshare-zoo.json"
    marker.write_text(json.dumps({"blob": "x", "models": listed}))
    return src, out, marker


def test_a_zoo_marker_listing_a_nul_name_is_no_internal_error(tmp_path, cli):
    src, out, _marker = _zoo(tmp_path, cli, ["a\x00b.onnx", "m.onnx"])
    res = cli("convert", src, "-o", out, "--shared-blob", "w", "-q")
    assert res.returncode == 0, res.stderr
    assert "internal error" not in res.stderr and (out / "m.onnx").exists()


def test_a_zoo_marker_listing_itself_keeps_the_new_marker(tmp_path, cli):
    src, out, marker = _zoo(tmp_path, cli, [".weightshare-zoo.json", "m.onnx"])
    res = cli("convert", src, "-o", out, "--shared-blob", "w", "-q")
    assert res.returncode == 0, res.stderr
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
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(TMP_PREFIX))[:2] == [
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
    from weightshare.atomic import locked_stage

    with locked_stage(tmp_path, "prepack") as a, locked_stage(tmp_path, "prepack") as b:
        assert a != b and str(os.getpid()) not in a.name and a.parent == tmp_path
        from weightshare.atomic import clean_stale_temporaries

        assert clean_stale_temporaries(tmp_path) == []  # both held: a concurrent run's cleanup leaves them
        (a / "f").write_bytes(b"1")
    assert list(tmp_path.iterdir()) == []
