"""Re-runs leave OUTDIR as if freshly converted.

Before: OUT written by an earlier run of the same inputs: ``--prepack`` (a portable twin and its blob), an earlier
``--blob`` name, a folder that has since lost a model (in a subfolder) and a side file.
Under test: ``weightshare.convert`` / ``convert_folder`` (the CLI's code path, in-process to keep the test fast) run
again on the same inputs, with ``--blob-grace 0`` and with the
default grace period (the folder's drop times moved back in its record to stand for the time passed).
After: OUT holds exactly what a fresh conversion into an empty directory holds; inside the grace period the
dropped outputs are still there (a reader that opened the old model finds them).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import types
from pathlib import Path

import numpy as np
import onnxruntime as ort
from test_removal_proof import refused_then_cleared

import weightshare
from weightshare import _outputs_record as outputs_record
from weightshare._samples import mlp_onnx


def files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


def run(model: Path) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((1, 32)).astype(np.float32)
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def fresh(convert, src: Path, tmp_path: Path, **options) -> set[str]:
    out = tmp_path / f"fresh-{len(list(tmp_path.iterdir()))}"
    convert(src, out, **options)
    return files(out)


def test_a_plain_rerun_after_prepack_drops_the_portable_twin_and_its_blob(tmp_path):
    src = mlp_onnx(tmp_path / "encoder.onnx", layers=2, dim=32, weights="float32", seed=5)
    out = tmp_path / "out"
    weightshare.convert(src, out, prepack=True)
    twin = out / "encoder.portable.onnx"
    assert twin.exists()
    weightshare.convert(src, out)  # default grace: a reader of the old pair still finds it
    assert twin.exists()
    assert np.array_equal(run(twin), run(out / "encoder.onnx"))
    weightshare.convert(src, out, blob_grace=0)
    assert files(out) == fresh(weightshare.convert, src, tmp_path)
    assert not twin.exists()


def test_a_blob_of_an_earlier_blob_name_is_removed(tmp_path):
    src = mlp_onnx(tmp_path / "head.onnx", layers=1, dim=32, weights="float32", seed=6)
    out = tmp_path / "out"
    weightshare.convert(src, out, blob="first")
    assert any(n.startswith("first.") for n in files(out))
    weightshare.convert(src, out, blob="second", blob_grace=0)
    assert files(out) == fresh(weightshare.convert, src, tmp_path, blob="second")
    assert np.array_equal(run(src), run(out / "head.onnx"))


def test_a_folder_rerun_drops_what_the_folder_no_longer_has_after_the_grace_period(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "onnx").mkdir(parents=True)
    mlp_onnx(repo / "model.onnx", layers=1, dim=32, weights="float32", seed=7)
    mlp_onnx(repo / "onnx" / "decoder_model.onnx", layers=1, dim=32, weights="float32", seed=8)
    (repo / "config.json").write_text("{}")
    (repo / "merges.txt").write_text("a b\n")
    out = tmp_path / "out"
    weightshare.convert_folder(repo, out)
    assert {"onnx/decoder_model.onnx", "merges.txt"} <= files(out)

    shutil.rmtree(repo / "onnx")
    os.unlink(repo / "merges.txt")
    weightshare.convert_folder(repo, out)  # default grace: still there
    assert {"onnx/decoder_model.onnx", "merges.txt"} <= files(out)

    later = time.time() + 601  # stand for the grace period passing (the record is sealed: editing it removes nothing)
    monkeypatch.setattr(outputs_record, "time", types.SimpleNamespace(time=lambda: later))
    weightshare.convert_folder(repo, out)
    assert files(out) == fresh(weightshare.convert_folder, repo, tmp_path)
    assert not (out / "onnx").exists()
    assert np.array_equal(run(repo / "model.onnx"), run(out / "model.onnx"))


def test_a_file_the_record_names_outside_outdir_is_never_removed(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    mlp_onnx(repo / "model.onnx", layers=1, dim=32, weights="float32", seed=9)
    out = tmp_path / "out"
    weightshare.convert_folder(repo, out)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    record = out / ".weightshare-folder.json"
    data = json.loads(record.read_text())
    for entry in data["runs"].values():
        entry["dropped"] = {"../victim.txt": 0, str(victim): 0, "model.onnx": 0}
        entry["outputs"] = ["../victim.txt", str(victim)]
    record.write_text(json.dumps(data))
    refused_then_cleared(repo, out, "was edited or is damaged")  # the record vouches for none of OUT's files
    weightshare.convert_folder(repo, out, blob_grace=0)
    assert victim.read_text() == "keep me"
    assert (out / "model.onnx").exists()  # written by this run: never dropped
