"""What a folder conversion reads.

Before: a model folder whose side files are symlinks: inside the folder, to a file outside it, to
``/proc/self/environ`` (with a marker variable in the converter's environment), to a device; a subdirectory that
cannot be listed (a child under a non-root uid: root lists a mode-000 directory anyway).
Under test: ``weightshare convert DIR -o OUT`` (CLI).
After: a link inside the folder is copied as a regular file; any other link is refused in one line naming it,
exit 2, and OUT is not created; an unlistable directory is exit 2 naming it, never a silently smaller OUT.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import weightshare
from weightshare._samples import mlp_onnx

MARKER = "ws-i33-marker-7f3a91"


def make_folder(root: Path) -> Path:
    repo = root / "repo"
    (repo / "onnx").mkdir(parents=True)
    mlp_onnx(repo / "onnx" / "model.onnx", layers=1, dim=16, weights="float32", seed=4)
    (repo / "config.json").write_bytes(b'{"model_type": "mlp"}\n')
    return repo


def files_under(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()] if d.exists() else []


def test_a_link_inside_the_folder_is_copied_as_a_regular_file(tmp_path, cli):
    repo = make_folder(tmp_path)
    (repo / "shared").mkdir()
    (repo / "shared" / "vocab.txt").write_bytes(b"a\nb\n")
    os.symlink("../shared/vocab.txt", repo / "onnx" / "vocab.txt")
    out = tmp_path / "out"
    res = cli("convert", repo, "-o", out)
    assert res.returncode == 0, res.stderr
    assert (out / "onnx" / "vocab.txt").read_bytes() == b"a\nb\n"
    assert [p for p in out.rglob("*") if p.is_symlink()] == []


@pytest.mark.parametrize("target", ["outside", "environ", "device"])
def test_a_link_leaving_the_folder_is_refused_naming_it(tmp_path, cli, target):
    repo = make_folder(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text(f"token={MARKER}\n")
    dest = {"outside": str(secret), "environ": "/proc/self/environ", "device": "/dev/zero"}[target]
    name = {"outside": "notes.txt", "environ": "tokenizer_config.json", "device": "onnx/zeros.bin"}[target]
    os.symlink(dest, repo / name)
    out = tmp_path / "out"
    res = cli("convert", repo, "-o", out, env={"WS_TEST_TOKEN": MARKER})
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and name.split("/")[-1] in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert not out.exists()
    assert not any(MARKER.encode() in p.read_bytes() for p in files_under(out))


def test_an_unlistable_directory_is_exit_2_naming_it(cli):
    base = Path(tempfile.mkdtemp(prefix="ws-i33-unlistable-"))
    try:
        os.chmod(base, 0o755)
        repo = make_folder(base)
        (repo / "sub").mkdir()
        (repo / "sub" / "special_tokens_map.json").write_text("{}")
        (base / "cache").mkdir()
        # the child imports this package from a copy it can read, wherever the checkout lives (a clone under a
        # 0700 home is out of nobody's reach; the interpreter and its site-packages must be readable, as
        # they are wherever the suite runs as root)
        shutil.copytree(
            Path(weightshare.__file__).parent,
            base / "pkg" / "weightshare",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        nobody = 65534
        as_root = os.geteuid() == 0
        if as_root:  # root lists a mode-000 directory anyway: the child runs as nobody
            for p in (base, *base.rglob("*")):
                os.chown(p, nobody, nobody, follow_symlinks=False)
        os.chmod(repo / "sub", 0)
        # as root, the child runs as nobody (setpriv: util-linux, present wherever root runs the suite)
        drop = ["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups"] if as_root else []

        env = {**os.environ, "XDG_CACHE_HOME": str(base / "cache"), "HOME": str(base), "PYTHONPATH": str(base / "pkg")}
        env.pop("WEIGHTSHARE_DEBUG", None)
        out = base / "out"
        res = subprocess.run(
            [*drop, sys.executable, "-m", "weightshare", "convert", str(repo), "-o", str(out)],
            capture_output=True,
            text=True,
            env=env,
            cwd=base,
        )
        assert res.returncode == 2, res.stdout + res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and str(repo / "sub") in lines[0], res.stderr
        assert "cannot list" in lines[0]
        assert not out.exists()
    finally:
        os.chmod(repo / "sub", 0o755)
        shutil.rmtree(base, ignore_errors=True)
