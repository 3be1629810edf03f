"""Re-runs of a folder conversion.

Before: a model folder with side files in subdirectories that hold no model (``tokenizer/``, ``assets/``); a
converter killed with SIGKILL while it stages those copies; a folder with 1,100 side files.
Under test: ``weightshare convert DIR -o OUT`` (CLI), a harness child that kills itself with SIGKILL after a few
copies (production code reads no test switch), a child under ``ulimit -n 1024`` (RLIMIT_NOFILE in a preexec).
After: one more run leaves no temporary anywhere under OUT, whatever subdirectory the killed run staged in; 1,100
side files convert with at most 1,024 open files and every copy is byte-identical.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from weightshare._atomic import TMP_PREFIX
from weightshare._samples import mlp_onnx

KILL_AFTER_COPIES = """
import os, signal, sys
import weightshare._folder as folder
from weightshare.cli import main

copy_file, done, after = folder.copy_file, [0], int(sys.argv[1])

def killing(*args, **kwargs):
    n = copy_file(*args, **kwargs)
    done[0] += 1
    if done[0] == after:
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9: no cleanup of any kind runs
    return n

folder.copy_file = killing
sys.argv = ["weightshare", *sys.argv[2:]]
main()
"""


def make_folder(root: Path, side_files: int, per_dir: int = 400) -> Path:
    repo = root / "repo"
    repo.mkdir()
    mlp_onnx(repo / "model.onnx", layers=1, dim=32, weights="float32", seed=3)
    for i in range(side_files):
        d = repo / ("tokenizer" if i < 6 else f"assets/part{i // per_dir}")
        d.mkdir(parents=True, exist_ok=True)
        (d / f"file{i:05d}.txt").write_bytes(f"side file {i}\n".encode() * 50)
    return repo


def temporaries(d: Path) -> list[str]:
    return [str(p.relative_to(d)) for p in d.rglob("*") if p.name.startswith(TMP_PREFIX)]


def test_temporaries_of_a_killed_run_are_swept_from_every_subdirectory(tmp_path, cli):
    repo = make_folder(tmp_path, side_files=12)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSHARE_DEBUG"}
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_COPIES, "8", "convert", str(repo), "-o", str(out), "-q"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert killed.returncode == -9, killed.stderr
    left = temporaries(out)
    assert any(p.startswith("assets/") or p.startswith("tokenizer/") for p in left), left  # staged side files
    res = cli("convert", repo, "-o", out)
    assert res.returncode == 0, res.stderr
    assert temporaries(out) == []
    assert (out / "tokenizer" / "file00000.txt").read_bytes() == (repo / "tokenizer" / "file00000.txt").read_bytes()


@pytest.mark.slow
def test_1100_side_files_convert_under_ulimit_n_1024(tmp_path):
    repo = make_folder(tmp_path, side_files=1100)
    out = tmp_path / "out"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSHARE_DEBUG"}
    res = subprocess.run(
        [sys.executable, "-m", "weightshare", "convert", str(repo), "-o", str(out), "-q"],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=limit,
    )
    assert res.returncode == 0, res.stderr
    copied = [p for p in repo.rglob("*.txt")]
    assert len(copied) == 1100
    for p in copied:
        assert (out / p.relative_to(repo)).read_bytes() == p.read_bytes()
    assert temporaries(out) == []
