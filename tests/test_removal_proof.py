"""weightshare removes a file only when it wrote it and it is still what it wrote: each case a user met, one test.

Before: OUT written by a folder or model run; then what a user or a second run does to OUT or the inputs (a
directory of OUT replaced by a link, a record edited or forged, a user's file named like an output, two runs at
once, a converted folder used as input).
Under test: ``weightshare.convert`` / ``convert_folder`` at ``--blob-grace 0`` (the CLI's code path, in-process).
After: the victim file's bytes (SHA-256) are unchanged, wherever it lies; what weightshare wrote and no model needs
any more is gone.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

import weightshare
from weightshare import _atomic
from weightshare import _outputs_record as outputs_record
from weightshare._outputs_record import RECORD
from weightshare._samples import mlp_onnx


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model(path: Path, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return mlp_onnx(path, layers=1, dim=32, weights="float32", seed=seed)


def files(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and p.name != RECORD}


def fresh(src: Path, tmp_path: Path) -> set[str]:
    out = tmp_path / f"fresh-{len(list(tmp_path.iterdir()))}"
    weightshare.convert_folder(src, out)
    return files(out)


def refused_then_cleared(repo: Path, out: Path, void: str) -> None:
    """A re-run into ``out`` whose record vouches for nothing (``void``: why) replaces none of the files there:
    refused in one error, nothing changed; then the earlier outputs (every file the record's runs listed, read
    from the tree) are moved away, as the error asks, so that the next run can show what the void record removes."""
    before = {p: digest(p) for p in out.rglob("*") if p.is_file() and not p.is_symlink() and p.name != RECORD}
    void_record = re.escape(f"exists, and {RECORD} {void}") + ".*, so nothing proves"
    with pytest.raises(weightshare.UsageError, match=void_record):
        weightshare.convert_folder(repo, out, blob_grace=0)
    assert {p: digest(p) for p in before} == before
    for p in before:
        if p.name != "mine.txt":
            p.unlink()


def sealed(runs: dict) -> str:
    """A record as this version writes it (the seal recomputed): what an adversary who read the code can forge."""
    return json.dumps({"format": outputs_record.FORMAT, "runs": runs, "seal": outputs_record._seal(runs)})


def test_case1_a_directory_of_out_replaced_by_a_link_is_never_entered(tmp_path):
    repo, out, elsewhere = tmp_path / "repo", tmp_path / "out", tmp_path / "elsewhere"
    model(repo / "model.onnx", 1)
    (repo / "sub").mkdir()
    (repo / "sub" / "a.txt").write_text("the user's bytes")
    weightshare.convert_folder(repo, out)
    elsewhere.mkdir()  # the user moves out/sub to another disk and links it back
    shutil.move(out / "sub" / "a.txt", elsewhere / "a.txt")
    (out / "sub").rmdir()
    (out / "sub").symlink_to(elsewhere)
    before = digest(elsewhere / "a.txt")
    shutil.rmtree(repo / "sub")  # the folder no longer has sub/a.txt: its output is dropped
    report = weightshare.convert_folder(repo, out, blob_grace=0)
    assert digest(elsewhere / "a.txt") == before
    assert any("kept sub/a.txt" in n for n in report.models[-1].notes)


def test_a_link_in_outdir_where_the_tree_writes_is_refused_and_its_target_untouched(tmp_path):
    """A run that writes into OUT/onnx, which the user made a link to another directory, wrote the outputs there
    (over a file of the same name, outside OUTDIR); now it refuses in one line and writes nothing."""
    from conftest import run_cli

    repo, out, elsewhere = tmp_path / "repo", tmp_path / "out", tmp_path / "elsewhere"
    model(repo / "onnx" / "model.onnx", 1)
    (repo / "config.json").write_text("{}")
    elsewhere.mkdir()
    (elsewhere / "model.onnx").write_text("the user's file")
    out.mkdir()
    (out / "onnx").symlink_to(elsewhere, target_is_directory=True)
    before = {p.name: digest(p) for p in elsewhere.iterdir()}
    res = run_cli("convert", repo, "-o", out)
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "is a link" in res.stderr, res.stderr
    assert {p.name: digest(p) for p in elsewhere.iterdir()} == before
    assert sorted(p.name for p in out.iterdir()) == ["onnx"]  # nothing else written in OUT either


def test_case1_an_edited_record_naming_a_file_through_a_link_removes_nothing(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "out"
    model(repo / "model.onnx", 1)
    (repo / "config.json").write_text('{"user": 1}')
    weightshare.convert_folder(repo, out)
    (out / "link").symlink_to(repo)
    before = digest(repo / "config.json")
    data = json.loads((out / RECORD).read_text())  # a hand-edited or shipped record: link/config.json dropped
    for entry in data["runs"].values():
        entry["dropped"] = {"link/config.json": 0}
    data["runs"][os.path.abspath(repo)] = {"outputs": ["link/config.json"], "dropped": {"link/config.json": 0}}
    (out / RECORD).write_text(json.dumps(data))
    refused_then_cleared(repo, out, "was edited or is damaged")
    report = weightshare.convert_folder(repo, out, blob_grace=0)
    assert digest(repo / "config.json") == before
    assert [n for n in report.models[-1].notes if n.startswith("warning:")] == [
        f"warning: {out / RECORD} was edited or is damaged (its seal does not match): nothing was removed; "
        "it is replaced by this run's record"
    ]


def test_case1_a_forged_sealed_record_cannot_reach_through_a_link_or_name_another_file(tmp_path):
    """The seal stops edits, not forgery: the directory walk and the identity still hold."""
    repo, out = tmp_path / "repo", tmp_path / "out"
    model(repo / "model.onnx", 1)
    (repo / "config.json").write_text('{"user": 1}')
    weightshare.convert_folder(repo, out)
    (out / "link").symlink_to(repo)
    (out / "mine.txt").write_text("the user's own file in OUT")
    st = os.stat(repo / "config.json")
    ident = [st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns, 0]
    stale = [*ident[:3], ident[3] - 1, 0]  # mine.txt's identity, one ns off: not the file weightshare wrote
    mine = os.stat(out / "mine.txt")
    runs = json.loads((out / RECORD).read_text())["runs"]
    for entry in runs.values():
        entry["dropped"] = {
            "link/config.json": ident,
            "mine.txt": [mine.st_dev, mine.st_ino, mine.st_size, mine.st_ctime_ns - 1, 0],
            "sub/../config.json": stale,
        }
    (out / RECORD).write_text(sealed(runs))
    before = {p: digest(p) for p in (repo / "config.json", out / "mine.txt")}
    refused_then_cleared(repo, out, "was edited or is damaged")  # sub/../ makes it malformed
    report = weightshare.convert_folder(repo, out, blob_grace=0)
    assert {p: digest(p) for p in before} == before
    notes = report.models[-1].notes
    assert any(n.startswith("warning:") and "edited" in n for n in notes)
    runs = json.loads((out / RECORD).read_text())["runs"]
    for entry in runs.values():
        entry["dropped"] = {
            "link/config.json": ident,
            "mine.txt": [mine.st_dev, mine.st_ino, mine.st_size, mine.st_ctime_ns - 1, 0],
        }
    (out / RECORD).write_text(sealed(runs))
    report = weightshare.convert_folder(repo, out, blob_grace=0)
    assert {p: digest(p) for p in before} == before
    notes = report.models[-1].notes
    assert (
        "kept link/config.json: its directory is a link or not a directory (nothing below OUTDIR is followed)" in notes
    )
    assert "kept mine.txt: changed or replaced since weightshare wrote it" in notes


def test_case2_a_users_portable_twin_or_unknown_blob_in_out_is_never_removed(tmp_path):
    src = model(tmp_path / "m" / "model.onnx", 2)
    out = tmp_path / "out"
    out.mkdir()
    twin, blob = out / "model.portable.onnx", out / "model.weights.0123456789ab.safetensors"
    twin.write_text("my own notes, not a model")
    blob.write_bytes(b"a blob of unknown origin")
    for p in (twin, blob):
        os.utime(p, (time.time() - 7200,) * 2)  # older than the default --blob-grace
    before = {p: digest(p) for p in (twin, blob)}
    report = weightshare.convert(src, out)
    weightshare.convert(src, out, blob_grace=0)
    assert {p: digest(p) for p in before} == before
    assert any(blob.name in n and "no record" in n for n in report.notes)


def test_case3_nothing_this_run_writes_is_a_removal_candidate(tmp_path):
    src = model(tmp_path / "m" / "model.onnx", 3)
    other = model(tmp_path / "m" / "model.portable.onnx", 4)
    out, alone = tmp_path / "out", tmp_path / "alone"
    weightshare.convert(other, alone)
    reports = weightshare.convert([src, other], out, blob_grace=0)
    assert [Path(r.outputs[0]).name for r in reports] == ["model.onnx", "model.portable.onnx"]
    for name in ("model.portable.onnx", *(Path(o).name for o in reports[1].outputs[1:])):
        assert digest(out / name) == digest(alone / name)  # the second model's outputs, as written alone


@pytest.mark.slow  # two --prepack runs (an ORT child each)
def test_case3_a_twin_dropped_by_a_later_run_goes_but_only_while_unchanged(tmp_path):
    src = model(tmp_path / "m" / "enc.onnx", 5)
    out = tmp_path / "out"
    weightshare.convert(src, out, prepack=True)
    assert (out / "enc.portable.onnx").exists()
    weightshare.convert(src, out, blob_grace=0)  # no longer written: the record proves it is weightshare's
    assert not (out / "enc.portable.onnx").exists()
    weightshare.convert(src, out, prepack=True)
    (out / "enc.portable.onnx").write_bytes(b"edited by the user")  # same inode, another ctime
    report = weightshare.convert(src, out, blob_grace=0)
    assert (out / "enc.portable.onnx").read_bytes() == b"edited by the user"
    assert "kept enc.portable.onnx: changed or replaced since weightshare wrote it" in report.notes


def _two_folders(tmp_path: Path) -> tuple[Path, Path, Path]:
    a, b = tmp_path / "A", tmp_path / "B"
    model(a / "ma.onnx", 6)
    model(b / "mb.onnx", 7)
    (a / "extra-a.txt").write_text("a")
    (b / "extra-b.txt").write_text("b")
    return a, b, tmp_path / "out"


def test_case4_two_folder_runs_into_one_out_keep_each_others_entries(tmp_path, monkeypatch):
    """Deterministic interleaving: B runs whole while A is between its plan (and, before this fix, its reading of
    the record) and its commit; A's commit then must not forget B's entry."""
    a, b, out = _two_folders(tmp_path)
    commit = _atomic.OutputTransaction.commit
    state = {"inside": False}

    def commit_after_b(self):
        if not state["inside"]:
            state["inside"] = True
            weightshare.convert_folder(b, out)  # the other run commits first, start to end
        commit(self)

    monkeypatch.setattr(_atomic.OutputTransaction, "commit", commit_after_b)
    weightshare.convert_folder(a, out)
    monkeypatch.setattr(_atomic.OutputTransaction, "commit", commit)
    assert len(json.loads((out / RECORD).read_text())["runs"]) == 2
    inputs = {p: digest(p) for d in (a, b) for p in d.rglob("*") if p.is_file()}
    os.unlink(a / "extra-a.txt")
    os.unlink(b / "extra-b.txt")
    weightshare.convert_folder(a, out, blob_grace=0)
    weightshare.convert_folder(b, out, blob_grace=0)
    assert files(out) == fresh(a, tmp_path) | fresh(b, tmp_path)  # both runs' dropped files went
    assert {p: digest(p) for p in inputs if p.exists()} == {p: d for p, d in inputs.items() if p.exists()}


def test_case4_the_record_is_read_and_written_under_the_commit_lock(tmp_path, monkeypatch):
    """Between reading the record and writing it back, another run cannot take OUT's lock."""
    a, _b, out = _two_folders(tmp_path)
    weightshare.convert_folder(a, out)
    seen = []

    def try_lock():
        fd = os.open(out, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append("free")
        except BlockingIOError:
            seen.append("held")
        finally:
            os.close(fd)

    monkeypatch.setattr(outputs_record, "before_record_write", try_lock)
    weightshare.convert_folder(a, out)
    assert seen == ["held"]


def test_case4_a_guard_removed_by_a_concurrent_cleanup_is_created_again(tmp_path, monkeypatch):
    """Another run's cleanup removed the guard between its creation and its lock: the run ended with exit 2
    `.guard: No such file or directory`. Now it takes a new one."""
    src = model(tmp_path / "m" / "model.onnx", 8)
    out = tmp_path / "out"
    out.mkdir()
    flock = fcntl.flock
    state = {"done": False}

    def flock_after_cleanup(fd, op):
        path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        if not state["done"] and path.endswith(".guard") and op == fcntl.LOCK_EX:
            state["done"] = True
            _atomic.clean_stale_temporaries(Path(path).parent)  # as a concurrent run's prepare_out_dir does
            assert not os.path.exists(path)
        return flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_cleanup)
    report = weightshare.convert(src, out)
    assert state["done"] and Path(report.outputs[0]).exists()
    assert not [p for p in out.iterdir() if p.name.startswith(_atomic.TMP_PREFIX)]


def test_case6_a_converted_folder_converts_again_and_out_holds_no_local_path(tmp_path):
    repo, out, out2 = tmp_path / "repo", tmp_path / "out", tmp_path / "out2"
    model(repo / "model.onnx", 9)
    (repo / "config.json").write_text("{}")
    weightshare.convert_folder(repo, out)
    before = {p: digest(p) for p in out.rglob("*") if p.is_file()}
    weightshare.convert_folder(out, out2, blob_grace=0)
    assert {p: digest(p) for p in before} == before  # the input (a converted folder) untouched
    assert files(out2) == files(out)
    for d in (out, out2):
        text = (d / RECORD).read_text()
        assert str(tmp_path) not in text and '"/' not in text
    assert (
        json.loads((out2 / RECORD).read_text())["runs"]
        .keys()
        .isdisjoint(json.loads((out / RECORD).read_text())["runs"].keys())
    )  # out2's record speaks of out2's run, not a copy of out's


def test_outputs_of_an_earlier_version_are_kept_and_named(tmp_path):
    repo, out = tmp_path / "repo", tmp_path / "out"
    model(repo / "model.onnx", 10)
    out.mkdir()
    (out / "gone.txt").write_text("written by weightshare 0.x, or so its record says")
    old = {"format": "weightshare-outputs/1", "runs": {os.path.abspath(repo): {"outputs": ["gone.txt"], "at": 0}}}
    (out / RECORD).write_text(json.dumps(old))
    before = digest(out / "gone.txt")
    report = weightshare.convert_folder(repo, out, blob_grace=0)
    assert digest(out / "gone.txt") == before
    assert any("earlier weightshare version" in n and "gone.txt" in n for n in report.models[-1].notes)


@pytest.mark.parametrize("garbage", [b"\xff\xfe", b"[]", b'{"format": "weightshare-outputs/2", "runs": 3}'])
def test_a_malformed_record_removes_nothing_with_one_warning(tmp_path, garbage):
    repo, out = tmp_path / "repo", tmp_path / "out"
    model(repo / "model.onnx", 11)
    (repo / "side.txt").write_text("side")
    weightshare.convert_folder(repo, out)
    os.unlink(repo / "side.txt")
    (out / RECORD).write_bytes(garbage)
    void = "is not JSON" if garbage == b"\xff\xfe" else "is not a record of this weightshare version"
    void = "was edited or is damaged" if b"runs" in garbage else void
    before = digest(out / "side.txt")
    refused_then_cleared(repo, out, void)
    (out / "side.txt").write_text("side")  # a file no longer written: what a sound record would drop
    before = digest(out / "side.txt")
    report = weightshare.convert_folder(repo, out, blob_grace=0)
    assert digest(out / "side.txt") == before
    assert len([n for n in report.models[-1].notes if n.startswith("warning:")]) == 1


def test_cleanup_still_works_and_out_does_not_grow(tmp_path):
    """After N re-runs at --blob-grace 0, every file weightshare wrote that no model in OUT needs is gone."""
    repo, out = tmp_path / "repo", tmp_path / "out"
    model(repo / "model.onnx", 20)
    (repo / "config.json").write_text("{}")
    sizes = []
    for n in range(5):
        model(repo / "onnx" / "decoder.onnx", 21 + n)  # new weights: a new blob each run
        (repo / f"note-{n}.txt").write_text(str(n))
        if n:
            os.unlink(repo / f"note-{n - 1}.txt")
        if n == 3:
            shutil.rmtree(repo / "onnx")
        weightshare.convert_folder(repo, out, blob_grace=0)
        assert files(out) == fresh(repo, tmp_path)
        sizes.append(sum(p.stat().st_size for p in out.rglob("*") if p.is_file()))
    assert max(sizes[1:]) <= sizes[0] + 1024  # the record's few lines at most


def test_cleanup_of_a_model_run_drops_the_twin_and_old_blobs(tmp_path):
    src = model(tmp_path / "m" / "head.onnx", 30)
    out = tmp_path / "out"
    weightshare.convert(src, out, blob="first", prepack=True)
    for seed in (31, 32, 33):
        model(src, seed)
        weightshare.convert(src, out, blob_grace=0)
    alone = tmp_path / "alone"
    weightshare.convert(src, alone)
    assert {p.name for p in out.iterdir()} == {p.name for p in alone.iterdir()}


def test_out_named_through_a_link_is_followed_once(tmp_path):
    """``-o out`` with ``out -> /mnt/big/out``: cleanup works there; a link below it is still never entered."""
    repo, real, out = tmp_path / "repo", tmp_path / "big" / "out", tmp_path / "out"
    model(repo / "model.onnx", 40)
    (repo / "side.txt").write_text("side")
    (repo / "sub").mkdir()
    (repo / "sub" / "a.txt").write_text("a")
    real.mkdir(parents=True)
    out.symlink_to(real)
    weightshare.convert_folder(repo, out)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(real / "sub", elsewhere)
    (real / "sub").symlink_to(elsewhere)
    os.unlink(repo / "side.txt")
    shutil.rmtree(repo / "sub")
    before = digest(elsewhere / "a.txt")
    weightshare.convert_folder(repo, out, blob_grace=0)
    assert not (real / "side.txt").exists()  # written by weightshare, unchanged, dropped: gone
    assert digest(elsewhere / "a.txt") == before


def test_a_run_never_forgets_its_own_entries(tmp_path, monkeypatch):
    """The record remembers a bounded number of input sets; a batch with more models than that keeps all of its own
    (a forgotten entry's files could never be removed again)."""
    monkeypatch.setattr(outputs_record, "MAX_RUNS", 1)
    srcs = [model(tmp_path / "m" / f"m{i}.onnx", 50 + i) for i in range(3)]
    out = tmp_path / "out"
    weightshare.convert(srcs, out)
    assert len(json.loads((out / RECORD).read_text())["runs"]) == 3
    model(srcs[0], 60)
    weightshare.convert(srcs[0], out, blob_grace=0)
    assert len(json.loads((out / RECORD).read_text())["runs"]) == 1
    assert len(list(out.glob("m0.weights.*"))) == 1  # its old blob went, by its own entry
