"""The edges of what a conversion run may remove or replace: names, links and directories a user put where
weightshare writes, and the temporaries it cleans."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import weightshare
from weightshare._atomic import TMP_PREFIX, clean_stale_temporaries
from weightshare._samples import mlp_onnx

DEAD = f"{TMP_PREFIX}4000000-0123456789ab"  # a transaction of a PID above pid_max: killed, its lock gone


def _users_and_dead_run(out: Path) -> tuple[dict[Path, bytes], list[Path]]:
    """A user's files and directories named with the temporaries' prefix, and a killed run's temporaries."""
    (out / "sub").mkdir(parents=True)
    mine = {
        out / f"{TMP_PREFIX}notes.txt": b"notes",
        out / f"{TMP_PREFIX}123-abc-x": b"mine",
        out / "sub" / f"{TMP_PREFIX}mine": b"mine too",
        out / f"{TMP_PREFIX}mydir" / "f": b"in my directory",
        out / f"{TMP_PREFIX}4000001-0123456789ab-89abcdef-m.onnx": b"shaped like one, but no guard proves it",
        out / f"{TMP_PREFIX}0123456789abcdef-prepack" / "f": b"a staging name, but a user's directory (0o755)",
    }
    for path, data in mine.items():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
    (out / f"{TMP_PREFIX}0123456789abcdef-prepack").chmod(0o755)
    dead = [
        out / f"{DEAD}.guard",
        out / f"{DEAD}-89abcdef-m.onnx",
        out / "sub" / f"{DEAD}-89abcdef-c.json",
        out / f"{DEAD}-fedcba98-m.mlpackage",
        out / f"{TMP_PREFIX}fedcba9876543210-prepack",
    ]
    dead[0].touch()
    dead[1].write_bytes(b"half")
    dead[2].write_bytes(b"half")
    dead[3].mkdir()
    (dead[3] / "Manifest.json").write_bytes(b"half")
    dead[4].mkdir(mode=0o700)
    return mine, dead


@pytest.mark.parametrize("way", ["model", "folder"])
def test_a_users_file_named_like_a_temporary_is_kept_a_dead_runs_goes(tmp_path, way):
    """Before: every unlocked ``.weightshare-tmp-*`` entry of OUTDIR (a user's notes, a directory of theirs with
    all it held) was removed by the stale-temporary cleanup. Now only what a dead run's guard (or a staging
    directory's exact name and mode) proves is weightshare's."""
    src = tmp_path / "in"
    src.mkdir()
    mlp_onnx(src / "m.onnx", layers=1, dim=16)
    (src / "sub").mkdir()
    (src / "sub" / "c.json").write_text("{}")
    out = tmp_path / "out"
    mine, dead = _users_and_dead_run(out)
    if way == "model":
        dead[2].unlink()  # a model's run cleans OUTDIR (and its blob's directory), not the tree below
        weightshare.convert(src / "m.onnx", out)
    else:
        weightshare.convert_folder(src, out)
    assert {p: p.read_bytes() for p in mine} == mine
    assert [p for p in dead if os.path.lexists(p)] == []
    assert (out / "m.onnx").is_file()


def test_a_dead_guard_stays_while_a_temporary_below_it_is_left(tmp_path):
    """The guard is a dead run's temporaries' only proof: removed last, once nothing of its run is left below."""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / f"{DEAD}.guard").touch()
    below = out / "sub" / f"{DEAD}-89abcdef-c.json"
    below.write_bytes(b"half")
    assert clean_stale_temporaries(out) == []  # OUTDIR alone: the temporary below still needs the guard
    assert clean_stale_temporaries(out / "sub") == [below]
    assert clean_stale_temporaries(out) == [out / f"{DEAD}.guard"]
