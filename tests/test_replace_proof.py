"""A run replaces a file at one of its output paths only when OUTDIR's record proves weightshare wrote it there.

Before: every run renamed its outputs over whatever stood at their paths. A user's ``OUT/model.onnx``, a
``notes.txt`` where a folder's side file goes, a directory of the user's, a link (replaced, its target kept), an
output the user edited since: all replaced, exit 0. A model folder given alone with ``--shared-blob`` replaced a
user's ``onnx/decoder_model.onnx`` in a directory no run wrote. Now the commit checks, under the OUTDIR lock and
before any rename, that each output path holds nothing or a file the record names with its identity (device,
inode, size, ctime, the removal rule's proof); anything else stops the run in one line, exit 2, nothing written,
everything kept. A re-run over its own untouched outputs still replaces them, also when another run wrote them
(concurrent runs: ``tests/test_reliability.py::test_concurrent_runs_into_one_outdir_never_mix``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from test_commit import one_line_error

import weightshare
from weightshare._outputs_record import RECORD
from weightshare._samples import mlp_onnx

# (how the run is invoked, the output path the intruder stands on); {src}: the input folder
MODES = {
    "model": (["{src}/onnx/a.onnx"], "a.onnx"),
    "batch": (["{src}/onnx/a.onnx", "{src}/onnx/b.onnx"], "b.onnx"),
    "folder": (["{src}"], "notes.txt"),
    "zoo": (["{src}/onnx/a.onnx", "{src}/onnx/b.onnx", "--shared-blob", "z"], "b.onnx"),
    "family folder": (["{src}", "--shared-blob", "z"], "onnx/b.onnx"),
}


def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "onnx").mkdir(parents=True)
    mlp_onnx(src / "onnx" / "a.onnx", layers=2, dim=64, seed=1, batch=4)
    mlp_onnx(src / "onnx" / "b.onnx", layers=2, dim=64, seed=2, batch=4)
    (src / "notes.txt").write_text("the folder's side file")
    return src


def args(mode: str, src: Path, out: Path) -> list[str]:
    given, _ = MODES[mode]
    return ["convert", *(a.format(src=src) for a in given), "-o", str(out), "--blob-grace", "0"]


def convert(mode: str, src: Path, out: Path) -> None:
    """The run ``args`` names, through the library (no interpreter start per run; the CLI's one line is checked
    once per mode)."""
    given, _ = MODES[mode]
    inputs = [Path(a.format(src=src)) for a in given if not a.startswith("--") and a != "z"]
    if mode == "folder":
        weightshare.convert_folder(src, out, blob_grace=0)
    elif "--shared-blob" in given:
        weightshare.convert_zoo(inputs, out, "z", blob_grace=0)
    else:
        weightshare.convert(inputs if len(inputs) > 1 else inputs[0], out, blob_grace=0)


def refusal(cli, mode: str, src: Path, out: Path, by_cli: bool) -> str:
    """The refused run's error: as a user runs it (one line, exit 2) when ``by_cli``, else through the library."""
    if by_cli:
        return one_line_error(cli(*args(mode, src, out)))
    with pytest.raises(weightshare.UsageError) as refused:
        convert(mode, src, out)
    return str(refused.value)


def snapshot(*roots: Path) -> dict[str, str]:
    """Every entry below ``roots``, links not followed: a file's content hash, a link's target, a directory."""
    seen = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_symlink():
                seen[str(p)] = "-> " + os.readlink(p)
            elif p.is_dir():
                seen[str(p)] = "dir"
            else:
                seen[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return seen


def intrude(kind: str, path: Path, elsewhere: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "file":
        path.write_text("the user's own file")
    elif kind == "link":
        (elsewhere / "target.txt").write_text("a file outside OUT the link points at")
        path.symlink_to(elsewhere / "target.txt")
    else:
        path.mkdir()
        (path / "inside.txt").write_text("the user's directory")


@pytest.mark.parametrize("kind", ["file", "link", "dir"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_users_entry_at_an_output_path_stops_the_run_and_is_kept(tmp_path, cli, mode, kind):
    src, out, elsewhere = source(tmp_path), tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = out / MODES[mode][1]
    intrude(kind, target, elsewhere)
    (out / "mine.txt").write_text("another file of the user's")
    before = snapshot(out, elsewhere, src)
    line = refusal(cli, mode, src, out, by_cli=kind == "file")
    assert snapshot(out, elsewhere, src) == before  # nothing replaced, nothing written (no record, no blob)
    if mode != "zoo":  # a zoo refuses a directory no zoo wrote before it looks at names
        assert f"{target}: " in line and "nothing was written" in line, line


@pytest.mark.parametrize("change", ["edited", "replaced", "chmod", "link"])
@pytest.mark.parametrize("mode", list(MODES))
def test_an_output_changed_since_weightshare_wrote_it_is_kept(tmp_path, cli, mode, change):
    src, out = source(tmp_path), tmp_path / "out"
    convert(mode, src, out)
    convert(mode, src, out)  # its own untouched outputs: replaced
    target = out / MODES[mode][1]
    if change == "edited":
        with open(target, "r+b") as f:  # same inode, same size: another ctime
            f.write(b"\0")
    elif change == "replaced":
        (out / "copy").write_bytes(target.read_bytes())
        os.replace(out / "copy", target)  # the same bytes, another file
    elif change == "chmod":
        target.chmod(0o600)
    else:
        os.replace(target, tmp_path / "moved")
        target.symlink_to(tmp_path / "moved")
    before = snapshot(out, src) | snapshot(tmp_path / "moved") if change == "link" else snapshot(out, src)
    line = refusal(cli, mode, src, out, by_cli=change == "edited")
    why = "is a link weightshare did not write" if change == "link" else "was changed or replaced since"
    assert f"{target}: {why}" in line, line
    assert (snapshot(out, src) | snapshot(tmp_path / "moved") if change == "link" else snapshot(out, src)) == before
    target.unlink()  # moved away, as the error asks: the run goes on
    convert(mode, src, out)
    if target.suffix == ".onnx":
        feeds = {"x": np.random.default_rng(0).standard_normal((4, 64), dtype=np.float32)}
        original = ort.InferenceSession(str(src / "onnx" / target.name)).run(None, feeds)[0]
        assert np.array_equal(ort.InferenceSession(str(target)).run(None, feeds)[0], original)


def test_a_family_folder_into_a_directory_no_run_wrote_keeps_a_users_model_file(tmp_path, cli):
    """The case found at the end of round 5 session 4: exit 0, the user's onnx/decoder_model.onnx replaced."""
    from test_family_folder import optimum_folder

    src, out, elsewhere = optimum_folder(tmp_path / "src"), tmp_path / "out", tmp_path / "elsewhere"
    (out / "onnx").mkdir(parents=True)
    (out / "onnx" / "decoder_model.onnx").write_text("user data")
    (out / "notes.txt").write_text("notes")
    elsewhere.mkdir()
    (elsewhere / "e.txt").write_text("outside")
    (out / "sub").symlink_to("../elsewhere")
    before = snapshot(out, elsewhere)
    line = one_line_error(cli("convert", src, "-o", out, "--shared-blob", "t5"))
    assert "onnx/decoder_model.onnx: exists, and no weightshare record says it wrote it" in line, line
    assert snapshot(out, elsewhere) == before
    (out / "onnx" / "decoder_model.onnx").unlink()  # moved away: the folder converts beside the user's files
    assert cli("convert", src, "-o", out, "--shared-blob", "t5").returncode == 0
    (out / "user.txt").write_text("added after the run")
    (out / "link2").symlink_to("../elsewhere/e.txt")
    kept = snapshot(elsewhere) | {p: d for p, d in snapshot(out).items() if Path(p).name in ("user.txt", "link2")}
    res = cli("convert", src, "-o", out, "--shared-blob", "t5", "--blob-grace", "0")
    assert res.returncode == 0, res.stderr  # its own outputs again: replaced, the user's files kept
    assert {p: d for p, d in (snapshot(elsewhere) | snapshot(out)).items() if p in kept} == kept
    assert (out / "notes.txt").read_text() == "notes" and (out / RECORD).exists()


@pytest.mark.slow  # an ORT child
def test_a_users_portable_twin_stops_a_prepack_run(tmp_path, cli):
    (tmp_path / "m").mkdir()
    src = mlp_onnx(tmp_path / "m" / "a.onnx", layers=2, dim=64, seed=3)
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.portable.onnx").write_text("the user's notes, not a model")
    before = snapshot(out)
    line = one_line_error(cli("convert", src, "-o", out, "--prepack"))
    assert f"{out / 'a.portable.onnx'}: exists, and no weightshare record" in line, line
    assert snapshot(out) == before


def test_a_users_directory_at_a_core_ml_packages_path_is_kept(tmp_path, cli):
    from coreml_fixtures import mlp

    pkg = mlp(tmp_path / "m" / "net.mlpackage", hidden=64)
    out = tmp_path / "out"
    (out / "net.mlpackage").mkdir(parents=True)
    (out / "net.mlpackage" / "mine.txt").write_text("the user's")
    before = snapshot(out)
    line = one_line_error(cli("convert", pkg, "-o", out))
    assert "net.mlpackage: exists, and no weightshare record" in line, line
    assert snapshot(out) == before
    (out / "net.mlpackage" / "mine.txt").unlink()
    (out / "net.mlpackage").rmdir()
    assert cli("convert", pkg, "-o", out).returncode == 0
    res = cli("convert", pkg, "-o", out)  # the package it wrote: replaced
    assert res.returncode == 0, res.stderr
