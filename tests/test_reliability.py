"""Crashes mid-write, full disks, Ctrl-C and concurrent runs never leave a half-written output."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from weightshare._atomic import TMP_PREFIX
from weightshare._samples import mlp_onnx


def start(args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "weightshare", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())} if d.exists() else {}


def outputs(model: Path, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((1, 1024)).astype(np.float32)
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("big")
    # 8 layers of 1024x1024 fp16: 16 MiB in, 32 MiB of fp32 out, written in chunks a signal can land between.
    return mlp_onnx(d / "m.onnx", layers=8, dim=1024, weights="float16", seed=1)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    return mlp_onnx(d / "m.onnx", layers=2, dim=1024, weights="float16", seed=2)


def signalled(args, name: str, after_bytes: int, **kwargs) -> subprocess.Popen:
    """Start the CLI so that it sends itself signal ``name`` once ``after_bytes`` payload bytes are written."""
    env = {**os.environ}
    env.pop("WEIGHTSHARE_DEBUG", None)
    child = [sys.executable, str(Path(__file__).with_name("signal_child.py")), f"{name}:{after_bytes}"]
    return subprocess.Popen(
        [*child, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kwargs
    )


def temporaries(d: Path) -> list[str]:
    return [p for p in os.listdir(d) if p.startswith(TMP_PREFIX)] if d.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("after_mib", [0, 8, 31])
def test_kill_9_mid_write_leaves_previous_outdir_intact(tmp_path, big, small, cli, after_mib):
    out = tmp_path / "out"
    assert cli("convert", small, "-o", out).returncode == 0
    before = snapshot(out)
    proc = signalled(["convert", big, "-o", out, "-q"], "SIGSTOP", max(1, after_mib << 20))
    _, status = os.waitpid(proc.pid, os.WUNTRACED)  # stopped by itself, mid-write
    assert os.WIFSTOPPED(status), status
    assert temporaries(out), "the kill must land while a temporary is being written"
    proc.kill()
    proc.wait()
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(TMP_PREFIX)} == before
    assert np.array_equal(outputs(small), outputs(out / "m.onnx"))
    # the next run removes the dead process's temporaries (their lock died with it) and succeeds
    assert cli("convert", big, "-o", out).returncode == 0
    assert not temporaries(out)
    assert np.array_equal(outputs(big), outputs(out / "m.onnx"))


@pytest.mark.parametrize("name, code, word", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
@pytest.mark.parametrize("existing", [True, False])
def test_ctrl_c_and_sigterm_mid_write_leave_nothing(tmp_path, small, name, code, word, existing):
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    proc = signalled(["convert", small, "-o", out, "-q"], name, 1 << 20)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1 and word in stderr
    assert (os.listdir(out) == []) if existing else not out.exists()


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
    assert str(out / "m.weights.") in stderr  # the message names the file being written
    assert os.listdir(out) == []


@pytest.mark.slow
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
        names = sorted(set(os.listdir(out)) - {".weightshare-folder.json"})  # the outputs record: bookkeeping
        assert names[0] == "m.onnx" and 2 <= len(names) <= 3, names  # m.onnx and one or both versions' blobs
        assert all(n.startswith("m.weights.") and n.endswith(".safetensors") for n in names[1:]), names


def test_output_directory_is_the_input_directory(tmp_path, cli):
    """Also with --blob naming the model: the input is refused as an output before the blob name matters."""
    model = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=256, weights="float16")
    before = model.read_bytes()
    res = cli("convert", model, "-o", tmp_path, "--blob", "m.onnx")
    assert res.returncode == 2
    assert model.read_bytes() == before
