"""Crashes mid-write, full disks, Ctrl-C and concurrent runs never leave a half-written output."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from weightshare.atomic import TMP_PREFIX
from weightshare.samples import mlp_onnx


def start(args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "weightshare", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())} if d.exists() else {}


def outputs(model: Path, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((1, 1024)).astype(np.float32)
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    # 24 layers of 1024x1024 fp16: 48 MiB in, 96 MiB of fp32 out: long enough to be killed mid-write.
    return mlp_onnx(d / "m.onnx", layers=24, dim=1024, weights="float16", seed=1)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    return mlp_onnx(d / "m.onnx", layers=2, dim=1024, weights="float16", seed=2)


@pytest.mark.parametrize("delay", [0.4, 0.8, 1.2, 1.6, 2.2])
def test_kill_9_leaves_previous_outdir_intact(tmp_path, big, small, cli, delay):
    out = tmp_path / "out"
    assert cli("convert", small, "-o", out).returncode == 0
    before = snapshot(out)
    proc = start(["convert", big, "-o", out, "-q"])
    time.sleep(delay)
    proc.kill()
    proc.wait()
    after = {k: v for k, v in snapshot(out).items() if not k.startswith(TMP_PREFIX)}
    if after != before:  # the run finished before the kill: then it must be complete and correct
        assert np.array_equal(outputs(big), outputs(out / "m.onnx"))
    # the next run removes the dead process's temporaries and succeeds
    assert cli("convert", big, "-o", out).returncode == 0
    assert not [p for p in out.iterdir() if p.name.startswith(TMP_PREFIX)]
    assert np.array_equal(outputs(big), outputs(out / "m.onnx"))


def test_ctrl_c_leaves_nothing(tmp_path, big):
    out = tmp_path / "out"
    out.mkdir()
    proc = start(["convert", big, "-o", out, "-q"])
    deadline = time.monotonic() + 60
    while not os.listdir(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)  # interrupt once the conversion is writing, not while Python is still starting
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("conversion finished before the interrupt")
    assert proc.returncode == 130 and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    assert os.listdir(out) == []


def test_full_disk_gives_a_clean_error_and_no_output(tmp_path, big):
    out = tmp_path / "out"
    out.mkdir()

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))

    proc = start(["convert", big, "-o", out], preexec_fn=limit)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1
    assert "too large" in stderr.lower() or "no space" in stderr.lower(), stderr
    assert os.listdir(out) == []


def test_concurrent_runs_into_one_outdir_never_mix(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    ma = mlp_onnx(a / "m.onnx", layers=6, dim=1024, weights="float16", seed=3)
    mb = mlp_onnx(b / "m.onnx", layers=6, dim=1024, weights="float16", seed=4)
    want = {outputs(ma).tobytes(), outputs(mb).tobytes()}
    out = tmp_path / "out"
    for _ in range(3):
        procs = [start(["convert", m, "-o", out, "-q"]) for m in (ma, mb)]
        codes = [p.wait(timeout=120) for p in procs]
        assert codes == [0, 0], [p.stderr.read() for p in procs]
        assert outputs(out / "m.onnx").tobytes() in want  # one run's model with the same run's blob
        assert sorted(os.listdir(out)) == ["m.onnx", "m.weights.safetensors"]


def test_output_directory_is_the_input_directory(tmp_path, cli):
    model = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=256, weights="float16")
    before = model.read_bytes()
    res = cli("convert", model, "-o", tmp_path, "--blob", "m.onnx")
    assert res.returncode == 2
    assert model.read_bytes() == before
