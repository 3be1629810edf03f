"""The edges of what a conversion run may remove or replace: names, links and directories a user put where
weightshare writes, and the temporaries it cleans."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import weightshare
from weightshare._atomic import TMP_PREFIX, clean_stale_temporaries
from weightshare._outputs_record import RECORD
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


@pytest.mark.parametrize("way", ["model", "folder"])
@pytest.mark.parametrize("kind", ["link", "directory"])
def test_a_users_link_or_directory_at_the_records_name_stays(tmp_path, cli, way, kind):
    """Before: a user's link there was replaced by the record (exit 0); a directory there made the run commit
    its outputs with no record (exit 0, a warning), outputs the next run then refused as nobody's."""
    src = tmp_path / "in"
    src.mkdir()
    mlp_onnx(src / "m.onnx", layers=1, dim=16)
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "mine.json"
    target.write_text('{"mine": 1}')
    if kind == "link":
        (out / RECORD).symlink_to(target)
    else:
        (out / RECORD).mkdir()
        (out / RECORD / "f").write_text("mine")
    res = cli("convert", src / "m.onnx" if way == "model" else src, "-o", out)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert RECORD in res.stderr and "Traceback" not in res.stderr
    assert sorted(p.name for p in out.iterdir()) == [RECORD]  # nothing written
    assert target.read_text() == '{"mine": 1}'
    if kind == "link":
        assert os.readlink(out / RECORD) == str(target)
    else:
        assert (out / RECORD / "f").read_text() == "mine"


@pytest.mark.parametrize("change", ["added", "edited", "removed"])
def test_a_file_changed_deep_inside_a_recorded_core_ml_package_stops_its_replacement(tmp_path, cli, change):
    """A package's directory keeps its ctime when a file two levels down is added, edited or removed: before,
    the re-run swapped the package and removed the old tree, the user's file in it included (exit 0)."""
    from coreml_fixtures import mlp

    pkg = mlp(tmp_path / "m" / "net.mlpackage", hidden=64)
    out = tmp_path / "out"
    weightshare.convert(pkg, out)
    weightshare.convert(pkg, out)  # untouched: its own output, replaced
    inner = out / "net.mlpackage" / "Data" / "com.apple.CoreML"
    if change == "added":
        (inner / "mine.txt").write_text("the user's")
    elif change == "edited":
        with open(inner / "model.mlmodel", "ab") as f:
            f.write(b"the user's")
    else:
        (inner / "weights" / "weight.bin").unlink()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    res = cli("convert", pkg, "-o", out)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "net.mlpackage: was changed or replaced since weightshare wrote it" in res.stderr, res.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("theirs", ["directory", "file", "link"])
def test_merge_replaces_only_a_package_it_wrote(tmp_path, cli, theirs):
    """Before: ``merge -o X.mlpackage`` swapped out a user's X.mlpackage and removed the whole tree, their files
    in it included (exit 0); a file or link there failed naming a temporary. Now ``merge`` records its package
    like any output: a re-merge replaces it; anything else at its name stays, in one line, exit 2."""
    from coreml_fixtures import mlp

    a, b = mlp(tmp_path / "a.mlpackage", hidden=64), mlp(tmp_path / "b.mlpackage", hidden=64, seed=1)
    out = tmp_path / "out"
    out.mkdir()
    target = out / "X.mlpackage"
    if theirs == "directory":
        (target / "sub").mkdir(parents=True)
        (target / "sub" / "notes.txt").write_text("the user's")
    elif theirs == "file":
        target.write_text("the user's")
    else:
        (tmp_path / "elsewhere").mkdir()
        target.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    res = cli("merge", a, b, "-o", target)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert f"{target}: " in res.stderr and ".weightshare-tmp-" not in res.stderr, res.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in out.iterdir()) == ["X.mlpackage"]
    assert theirs != "link" or not list((tmp_path / "elsewhere").iterdir())
    weightshare.merge([a, b], out / "Y.mlpackage")
    weightshare.merge([b, a], out / "Y.mlpackage")  # its own package: replaced


def test_demo_clean_keeps_a_users_own_conversion_in_converted(tmp_path, cli):
    """Before: ``demo --clean --dir X`` removed every file the record of X/converted named, so a user's own
    ``convert u.onnx -o X/converted`` went (and X with it). Now only the demo's runs' files go."""
    from weightshare import api
    from weightshare._atomic import OutputTransaction
    from weightshare._outputs_record import run_key
    from weightshare._replacement import attach

    demo = tmp_path / "demo"
    demo.mkdir()
    with OutputTransaction() as tx:  # as run_demo writes its model (the sessions' part needs no files)
        record = attach(tx, demo, 0, [])
        mlp_onnx(tx.new_file(demo / "mlp_fp16.onnx"), layers=1, dim=16)
        record.add(run_key("demo", [demo / "mlp_fp16.onnx"]), tx.finals(), [])
    api.convert(demo / "mlp_fp16.onnx", demo / "converted")
    api.convert(demo / "mlp_fp16.onnx", demo / "prepacked")
    mlp_onnx(tmp_path / "u.onnx", layers=1, dim=16, seed=3)
    assert cli("convert", tmp_path / "u.onnx", "-o", demo / "converted").returncode == 0
    mine = {p: p.read_bytes() for p in (demo / "converted").glob("u*")}
    assert len(mine) == 2
    res = cli("demo", "--clean", "--dir", demo)
    assert res.returncode == 0, res.stderr
    assert {p: p.read_bytes() for p in mine} == mine
    assert sorted(p.relative_to(demo).as_posix() for p in demo.rglob("*") if p.name != RECORD) == [
        "converted",
        *sorted(p.relative_to(demo).as_posix() for p in mine),
    ]
    res = cli("convert", tmp_path / "u.onnx", "-o", demo / "converted")  # still provably weightshare's
    assert res.returncode == 0, res.stderr


def test_a_side_file_named_like_a_temporary_is_named_not_silently_left_out(tmp_path):
    """A model folder's own ``.weightshare-tmp-notes.txt`` (or directory) is not copied, like the temporaries the
    prefix marks; before, it was left out of OUTDIR without a word. A real temporary there is skipped quietly."""
    src = tmp_path / "in"
    src.mkdir()
    mlp_onnx(src / "m.onnx", layers=1, dim=16)
    (src / f"{TMP_PREFIX}notes.txt").write_text("mine")
    (src / f"{TMP_PREFIX}4000000-0123456789ab-89abcdef-c.json").write_text("a dead run's")
    report = weightshare.convert_folder(src, tmp_path / "out")
    said = [n for n in report.notes if TMP_PREFIX in n]
    assert len(said) == 1 and said[0].startswith(f"{TMP_PREFIX}notes.txt: not copied"), report.notes


def _waiting_on(pid: int, directory: Path) -> bool:
    """``pid`` waits for an flock of ``directory`` (a blocked entry in /proc/locks)."""
    ino = os.stat(directory).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        f = line.split()
        if "->" in f and f[f.index("->") + 4] == str(pid) and f[f.index("->") + 5].endswith(f":{ino}"):
            return True
    return False


def test_a_run_of_other_inputs_waiting_on_a_commit_replaces_only_its_outputs(tmp_path, monkeypatch):
    """Another folder's run into OUTDIR starts while this run's commit holds the lock (between its renames and
    its record's write): it waits, then replaces the shared name as the recorded output it is; a user's file
    stays; the first run's blob, named by no model now, goes (grace 0)."""
    import subprocess
    import sys
    import time

    from weightshare import _outputs_record

    for i in (1, 2):
        (tmp_path / f"in{i}").mkdir()
        mlp_onnx(tmp_path / f"in{i}" / "a.onnx", layers=1, dim=16, seed=i)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    other: list[subprocess.Popen[str]] = []

    def start_the_other_run() -> None:
        if other:
            return
        cmd = [sys.executable, "-m", "weightshare", "convert", tmp_path / "in2", "-o", out, "--blob-grace", "0"]
        other.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + 60
        while not _waiting_on(other[0].pid, out):  # it reached its commit and waits for ours
            assert other[0].poll() is None and time.monotonic() < deadline, other[0].communicate()
            time.sleep(0.01)

    monkeypatch.setattr(_outputs_record, "before_record_write", start_the_other_run)
    weightshare.convert_folder(tmp_path / "in1", out, blob_grace=0)
    _, err = other[0].communicate(timeout=120)
    assert other[0].returncode == 0, err
    names = sorted(p.name for p in out.iterdir() if p.name != RECORD)
    assert names[0] == "a.onnx" and names[2] == "mine.txt" and len(names) == 3, names
    assert (out / "mine.txt").read_text() == "mine"
    ref = weightshare.convert_folder(tmp_path / "in2", tmp_path / "ref")  # the second run's outputs, alone
    assert (out / "a.onnx").read_bytes() == (tmp_path / "ref" / "a.onnx").read_bytes()
    assert names[1] == Path(ref.models[0].outputs[1]).name


def test_demo_refuses_a_link_below_its_dir(tmp_path, cli):
    """Before: with converted/ a link, the demo wrote its conversion into the link's target, where --clean never
    looks (exit 0)."""
    demo, elsewhere = tmp_path / "demo", tmp_path / "elsewhere"
    demo.mkdir()
    elsewhere.mkdir()
    (demo / "converted").symlink_to(elsewhere)
    res = cli("demo", "--dir", demo, "--layers", "1", "--sessions", "1")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "converted: is a link" in res.stderr, res.stderr
    assert sorted(p.name for p in demo.iterdir()) == ["converted"] and not list(elsewhere.iterdir())


def test_demo_clean_through_a_linked_dir(tmp_path, cli):
    """Before: with --dir a link (followed once by the demo's run, as OUTDIR is), --clean removed nothing and said
    the demo wrote nothing there."""
    from weightshare import api
    from weightshare._atomic import OutputTransaction
    from weightshare._outputs_record import run_key
    from weightshare._replacement import attach

    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    (real / "notes.txt").write_text("mine")
    with OutputTransaction() as tx:  # as run_demo writes its model, through the link as named
        record = attach(tx, link, 0, [])
        mlp_onnx(tx.new_file(link / "mlp_fp16.onnx"), layers=1, dim=16)
        record.add(run_key("demo", [link / "mlp_fp16.onnx"]), tx.finals(), [])
    api.convert(link / "mlp_fp16.onnx", link / "converted")
    res = cli("demo", "--clean", "--dir", link)
    assert res.returncode == 0 and "removed the demo's files" in res.stdout, res.stdout
    assert sorted(p.name for p in real.iterdir()) == ["notes.txt"] and link.is_symlink()


def test_a_temporary_its_run_could_not_remove_keeps_its_guard_and_goes_with_the_next_run(tmp_path):
    """Before: a failed run's guard was removed even when one of its temporaries could not be (here a directory
    put where its file was), so no later run could prove that leftover a dead run's: it stayed for good."""
    from weightshare._atomic import OutputTransaction, clean_stale_temporaries

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError), OutputTransaction() as tx:
        tmp = tx.new_file(out / "model.onnx")
        tmp.unlink()
        tmp.mkdir()  # unlink() of it fails at abort: EISDIR
        (tmp / "inside").write_bytes(b"half-written")
        raise RuntimeError("the run fails")
    left = {p.name for p in out.iterdir()}
    assert tmp.name in left and len(left) == 2  # the guard stays beside it, unlocked
    (guard_name,) = left - {tmp.name}
    assert guard_name.endswith(".guard")
    assert [p.name for p in clean_stale_temporaries(out)] == [tmp.name, guard_name]  # the guard last
    assert list(out.iterdir()) == []


def test_a_package_recorded_by_the_earlier_rule_is_named_as_such(tmp_path):
    """A record written before a directory's identity covered its tree names the package by its own size: it
    cannot vouch for the files inside, so the package is kept, and the error says why (not "changed")."""
    from coreml_fixtures import mlp

    from weightshare._outputs_record import FORMAT, _seal

    pkg = mlp(tmp_path / "m" / "net.mlpackage", hidden=64)
    out = tmp_path / "out"
    weightshare.convert(pkg, out)
    data = json.loads((out / RECORD).read_text())
    st = os.lstat(out / "net.mlpackage")
    for entry in data["runs"].values():
        entry["outputs"]["net.mlpackage"] = [st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns]
    (out / RECORD).write_text(json.dumps({"format": FORMAT, "runs": data["runs"], "seal": _seal(data["runs"])}))
    with pytest.raises(weightshare.UsageError, match="recorded by an earlier weightshare version"):
        weightshare.convert(pkg, out)
