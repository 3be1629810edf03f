"""Open what was checked: every input of a run is checked against its plan on the opened descriptor.

Before: a folder (or files named on the command line) planned by the run: each file's identity (device, inode)
taken then, a link's by its resolved target (Hugging Face hub snapshots link every file into ``blobs/``). Under
test: a model swapped, between the plan and the conversion, for a link to a model outside the folder (a barrier
after planning does the swap, deterministically). After: the run is refused in one line (exit 2), nothing is
written, the outside file was never opened (an audit hook sees every open) and its bytes are unchanged; a model
being converted is opened once and every reader reads it through that descriptor.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from executorch_fixtures import xnnpack_program
from model_forms import _mlp, _save
from tflite_fixtures import sample_model

from weightshare import _convert_api, _folder, api
from weightshare.errors import UnsafePath

_OPENS: list[tuple[int, int]] | None = None  # (dev, ino) each open would reach, while a test records


def _audit(event: str, args: tuple[object, ...]) -> None:
    if _OPENS is None or event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
    try:
        st = os.lstat(args[0]) if flags & os.O_NOFOLLOW else os.stat(args[0])
    except OSError:
        return
    _OPENS.append((st.st_dev, st.st_ino))


sys.addaudithook(_audit)


def _ident(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _onnx(path: Path, seed: int) -> Path:
    return _save(_mlp(64, 2, seed), path, external=False)  # embedded: the outside model converts on its own


def _repo_and_outsider(tmp_path: Path) -> tuple[Path, Path]:
    repo = tmp_path / "repo"
    _onnx(repo / "model.onnx", 0)
    (repo / "config.json").write_text('{"a": 1}')
    outsider = _onnx(tmp_path / "elsewhere" / "model.onnx", 1)
    return repo, outsider


def _swap_for_link(victim: Path, target: Path) -> None:
    os.unlink(victim)
    os.symlink(target, victim)


def test_a_model_swapped_for_an_outside_link_after_planning_is_refused_never_read(tmp_path, monkeypatch):
    global _OPENS
    repo, outsider = _repo_and_outsider(tmp_path)
    before = _sha(outsider)
    real_plan = _folder.plan_folder

    def plan_then_swap(folder: Path) -> _folder.FolderPlan:
        plan = real_plan(folder)
        _swap_for_link(repo / "model.onnx", outsider)  # between the plan and the conversion's open
        return plan

    monkeypatch.setattr(_folder, "plan_folder", plan_then_swap)
    _OPENS = []
    try:
        with pytest.raises(UnsafePath) as e:
            api.convert_folder(repo, tmp_path / "out")
        opens = _OPENS
    finally:
        _OPENS = None
    assert "\n" not in e.value.line() and "model.onnx" in e.value.line(), e.value.line()
    assert _ident(outsider) not in opens  # never opened, so never read
    assert _sha(outsider) == before
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_the_cli_refuses_it_in_one_line_exit_2(tmp_path):
    repo, outsider = _repo_and_outsider(tmp_path)
    before = _sha(outsider)
    # the same barrier in a child process running the command as a user does
    code = (
        "import os, sys\n"
        "import weightshare._folder as f\n"
        "real = f.plan_folder\n"
        "def barrier(folder):\n"
        "    plan = real(folder)\n"
        f"    os.unlink({str(repo / 'model.onnx')!r}); os.symlink({str(outsider)!r}, {str(repo / 'model.onnx')!r})\n"
        "    return plan\n"
        "f.plan_folder = barrier\n"
        "from weightshare.cli import main\n"
        f"sys.argv = ['weightshare', 'convert', {str(repo)!r}, '-o', {str(tmp_path / 'out')!r}]\n"
        "main()\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert len(res.stderr.strip().splitlines()) == 1 and "model.onnx" in res.stderr, res.stderr
    assert _sha(outsider) == before
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_a_file_named_on_the_command_line_swapped_before_it_is_read_is_refused(tmp_path, monkeypatch):
    global _OPENS
    (tmp_path / "in").mkdir()
    victim = xnnpack_program(tmp_path / "in" / "m.pte", dim=32, layers=1, seed=0)
    outsider = xnnpack_program(tmp_path / "m_outside.pte", dim=32, layers=1, seed=1)
    before = _sha(outsider)
    real_detect = _convert_api.detect

    def swap_then_detect(path: Path):  # type: ignore[no-untyped-def]
        if not victim.is_symlink():
            _swap_for_link(victim, outsider)
        return real_detect(path)

    monkeypatch.setattr(_convert_api, "detect", swap_then_detect)
    _OPENS = []
    try:
        with pytest.raises(UnsafePath) as e:
            api.convert(victim, tmp_path / "out")
        opens = _OPENS
    finally:
        _OPENS = None
    assert "\n" not in e.value.line() and "m.pte" in e.value.line()
    assert _ident(outsider) not in opens and _sha(outsider) == before
    assert not (tmp_path / "out" / "m.pte").exists()


def _hub(tmp_path: Path) -> tuple[Path, Path]:
    """A hub snapshot: the model a relative link into the cache's blobs/."""
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    model = _onnx(blobs / "model.onnx", 0)
    os.replace(model, blobs / ("9f" * 32))
    os.symlink(f"../../blobs/{'9f' * 32}", snap / "model.onnx")
    (snap / "config.json").write_text("{}")
    return snap, blobs / ("9f" * 32)


def test_a_hub_snapshot_converts_and_a_link_re_pointed_after_planning_is_refused(tmp_path, monkeypatch):
    snap, blob = _hub(tmp_path)
    report = api.convert_folder(snap, tmp_path / "out")  # links into blobs/: planned by their target
    assert [Path(m.model).name for m in report.models] == ["model.onnx"]
    assert (tmp_path / "out" / "model.onnx").is_file() and not (tmp_path / "out" / "model.onnx").is_symlink()
    outsider = _onnx(tmp_path / "elsewhere" / "model.onnx", 1)
    before, blob_before = _sha(outsider), _sha(blob)
    real_plan = _folder.plan_folder

    def plan_then_repoint(folder: Path) -> _folder.FolderPlan:
        plan = real_plan(folder)
        _swap_for_link(snap / "model.onnx", outsider)
        return plan

    monkeypatch.setattr(_folder, "plan_folder", plan_then_repoint)
    with pytest.raises(UnsafePath) as e:
        api.convert_folder(snap, tmp_path / "out2")
    assert "\n" not in e.value.line()
    assert _sha(outsider) == before and _sha(blob) == blob_before
    assert not (tmp_path / "out2" / "model.onnx").exists()


def test_every_model_is_opened_once_and_read_through_that_descriptor(tmp_path, monkeypatch):
    global _OPENS
    repo = tmp_path / "repo"
    models = [
        _onnx(repo / "a.onnx", 0),
        sample_model(repo / "b.tflite", seed=0, fc_out=64),
        xnnpack_program(repo / "c.pte", dim=32, layers=1),
    ]
    (repo / "config.json").write_text("{}")
    idents = {m.name: _ident(m) for m in models}
    seen: list[tuple[int, int]] = []

    real_plan = _folder.plan_folder

    def plan_then_record(folder: Path) -> _folder.FolderPlan:
        global _OPENS
        plan = real_plan(folder)
        _OPENS = seen  # every open from here on: the conversion's
        return plan

    monkeypatch.setattr(_folder, "plan_folder", plan_then_record)
    try:
        report = api.convert_folder(repo, tmp_path / "out")
    finally:
        _OPENS = None
    assert sorted(Path(m.model).name for m in report.models) == sorted(idents)
    assert {name: seen.count(i) for name, i in idents.items()} == dict.fromkeys(idents, 1), seen
    for m in models:  # converted from those bytes
        assert (tmp_path / "out" / m.name).stat().st_size >= 1
    assert np.array_equal(np.frombuffer((repo / "config.json").read_bytes(), np.uint8), np.frombuffer(b"{}", np.uint8))


@pytest.mark.slow
def test_a_core_ml_package_swapped_for_an_outside_link_after_planning_is_refused(tmp_path, monkeypatch):
    global _OPENS
    from coreml_fixtures import mlp

    repo = tmp_path / "repo"
    repo.mkdir()
    mlp(repo / "m.mlpackage", hidden=64, seed=0)
    outsider = mlp(tmp_path / "elsewhere" / "m.mlpackage", hidden=64, seed=1)
    files = sorted(p for p in outsider.rglob("*") if p.is_file())
    before = {p: _sha(p) for p in files}
    real_plan = _folder.plan_folder

    def plan_then_swap(folder: Path) -> _folder.FolderPlan:
        import shutil

        plan = real_plan(folder)
        shutil.rmtree(repo / "m.mlpackage")
        os.symlink(outsider, repo / "m.mlpackage")
        return plan

    monkeypatch.setattr(_folder, "plan_folder", plan_then_swap)
    _OPENS = []
    try:
        with pytest.raises(UnsafePath) as e:
            api.convert_folder(repo, tmp_path / "out")
        opens = _OPENS
    finally:
        _OPENS = None
    assert "\n" not in e.value.line() and "m.mlpackage" in e.value.line()
    assert not {_ident(p) for p in files} & set(opens)
    assert {p: _sha(p) for p in files} == before
    assert not (tmp_path / "out" / "m.mlpackage").exists()


def test_a_zoo_model_swapped_before_it_is_read_is_refused(tmp_path, monkeypatch):
    from weightshare import _zoo_api

    a, b = _onnx(tmp_path / "in" / "a.onnx", 0), _onnx(tmp_path / "in" / "b.onnx", 2)
    outsider = _onnx(tmp_path / "elsewhere" / "model.onnx", 1)
    before = _sha(outsider)
    real_detect = _zoo_api.detect

    def swap_then_detect(path: Path):  # type: ignore[no-untyped-def]
        if not b.is_symlink():
            _swap_for_link(b, outsider)
        return real_detect(path)

    monkeypatch.setattr(_zoo_api, "detect", swap_then_detect)
    with pytest.raises(UnsafePath) as e:
        api.convert_zoo([a, b], tmp_path / "zoo", "shared")
    assert "\n" not in e.value.line() and "b.onnx" in e.value.line()
    assert _sha(outsider) == before and not (tmp_path / "zoo" / "b.onnx").exists()
