"""Re-runs leave OUTDIR as if freshly converted (issue 33, item 3).

Before: OUT written by an earlier run of the same inputs: ``--prepack`` (a portable twin and its blob), an earlier
``--blob`` name, a folder that has since lost a model (in a subfolder) and a side file.
Under test: ``weightshare convert`` (CLI) run again on the same inputs, with ``--blob-grace 0`` and with the
default grace period (the folder's drop times moved back in its record to stand for the time passed).
After: OUT holds exactly what a fresh conversion into an empty directory holds; inside the grace period the
dropped outputs are still there (a reader that opened the old model finds them).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from weightshare._samples import mlp_onnx


def files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


def run(model: Path) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((1, 32)).astype(np.float32)
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def fresh(cli, args: list, tmp_path: Path) -> set[str]:
    out = tmp_path / f"fresh-{len(list(tmp_path.iterdir()))}"
    res = cli(*args, "-o", out)
    assert res.returncode == 0, res.stderr
    return files(out)


def test_a_plain_rerun_after_prepack_drops_the_portable_twin_and_its_blob(tmp_path, cli):
    src = mlp_onnx(tmp_path / "encoder.onnx", layers=2, dim=32, weights="float32", seed=5)
    out = tmp_path / "out"
    assert cli("convert", src, "-o", out, "--prepack").returncode == 0
    twin = out / "encoder.portable.onnx"
    assert twin.exists()
    assert cli("convert", src, "-o", out).returncode == 0  # default grace: a reader of the old pair still finds it
    assert twin.exists()
    assert np.array_equal(run(twin), run(out / "encoder.onnx"))
    res = cli("convert", src, "-o", out, "--blob-grace", "0")
    assert res.returncode == 0, res.stderr
    assert files(out) == fresh(cli, ["convert", src], tmp_path)
    assert not twin.exists()


def test_a_blob_of_an_earlier_blob_name_is_removed(tmp_path, cli):
    src = mlp_onnx(tmp_path / "head.onnx", layers=1, dim=32, weights="float32", seed=6)
    out = tmp_path / "out"
    assert cli("convert", src, "-o", out, "--blob", "first").returncode == 0
    assert any(n.startswith("first.") for n in files(out))
    assert cli("convert", src, "-o", out, "--blob", "second", "--blob-grace", "0").returncode == 0
    assert files(out) == fresh(cli, ["convert", src, "--blob", "second"], tmp_path)
    assert np.array_equal(run(src), run(out / "head.onnx"))


def test_a_folder_rerun_drops_what_the_folder_no_longer_has_after_the_grace_period(tmp_path, cli):
    repo = tmp_path / "repo"
    (repo / "onnx").mkdir(parents=True)
    mlp_onnx(repo / "model.onnx", layers=1, dim=32, weights="float32", seed=7)
    mlp_onnx(repo / "onnx" / "decoder_model.onnx", layers=1, dim=32, weights="float32", seed=8)
    (repo / "config.json").write_text("{}")
    (repo / "merges.txt").write_text("a b\n")
    out = tmp_path / "out"
    assert cli("convert", repo, "-o", out).returncode == 0
    assert {"onnx/decoder_model.onnx", "merges.txt"} <= files(out)

    shutil.rmtree(repo / "onnx")
    os.unlink(repo / "merges.txt")
    assert cli("convert", repo, "-o", out).returncode == 0  # default grace: still there
    assert {"onnx/decoder_model.onnx", "merges.txt"} <= files(out)

    record = out / ".weightshare-folder.json"  # stand for the grace period passing
    data = json.loads(record.read_text())
    for entry in data["runs"].values():
        entry["dropped"] = {k: time.time() - 601 for k in entry["dropped"]}
    record.write_text(json.dumps(data))
    assert cli("convert", repo, "-o", out).returncode == 0
    assert files(out) == fresh(cli, ["convert", repo], tmp_path)
    assert not (out / "onnx").exists()
    assert np.array_equal(run(repo / "model.onnx"), run(out / "model.onnx"))


def test_a_file_the_record_names_outside_outdir_is_never_removed(tmp_path, cli):
    repo = tmp_path / "repo"
    repo.mkdir()
    mlp_onnx(repo / "model.onnx", layers=1, dim=32, weights="float32", seed=9)
    out = tmp_path / "out"
    assert cli("convert", repo, "-o", out).returncode == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    record = out / ".weightshare-folder.json"
    data = json.loads(record.read_text())
    for entry in data["runs"].values():
        entry["dropped"] = {"../victim.txt": 0, str(victim): 0, "model.onnx": 0}
        entry["outputs"] = ["../victim.txt", str(victim)]
    record.write_text(json.dumps(data))
    assert cli("convert", repo, "-o", out, "--blob-grace", "0").returncode == 0
    assert victim.read_text() == "keep me"
    assert (out / "model.onnx").exists()  # written by this run: never dropped
