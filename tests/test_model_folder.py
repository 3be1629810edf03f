"""Model folders: `convert DIR -o OUT` reproduces DIR's tree (Hugging Face / optimum / onnxruntime-genai layouts).

Before: a folder with config.json, tokenizer.json, genai_config.json, a README, an executable script, a private
file, model.onnx + model.onnx_data (external data) and onnx/decoder_model.onnx (embedded weights).
Under test: `weightshare convert DIR -o OUT` (CLI) and ``weightshare.convert_folder``.
After: OUT has the same tree; every side file is byte-identical with its mode; both models are converted in place
(outputs bit-identical in onnxruntime, share-ready for `check`); model.onnx_data is replaced by the blob; a broken
model anywhere leaves no OUT at all; --shared-blob refuses a folder with models in subfolders among other inputs.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import weightshare
from weightshare import UsageError
from weightshare._samples import mlp_onnx

SIDE = {
    "config.json": (b'{"model_type": "phi3"}\n', 0o644),
    "tokenizer.json": (b'{"version": "1.0"}\n', 0o644),
    "genai_config.json": (b'{"model": {"decoder": {"filename": "model.onnx"}}}\n', 0o644),
    "README.md": (b"# a model\n", 0o600),
    "scripts/run.sh": (b"#!/bin/sh\necho hi\n", 0o755),
}


def make_repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir()
    for rel, (data, mode) in SIDE.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes(data)
        os.chmod(repo / rel, mode)
    main = onnx.load(str(mlp_onnx(root / "main.onnx", layers=2, dim=64, weights="float32", seed=1)))
    onnx.save_model(
        main, str(repo / "model.onnx"), save_as_external_data=True, location="model.onnx_data", size_threshold=0
    )
    (repo / "onnx").mkdir()
    mlp_onnx(repo / "onnx" / "decoder_model.onnx", layers=1, dim=64, weights="float16", seed=2)
    return repo


def run(model: Path) -> list[np.ndarray]:
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def tree(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_cli_convert_folder_reproduces_the_tree(tmp_path, cli):
    repo = make_repo(tmp_path)
    out = tmp_path / "out"
    res = cli("convert", repo, "-o", out, "--json")
    assert res.returncode == 0, res.stderr
    reports = json.loads(res.stdout)["reports"]
    assert sorted(Path(m["model"]).name for m in reports) == ["decoder_model.onnx", "model.onnx"]
    assert all(r["folder"]["folder"] == str(repo) and r["zoo"] is None for r in reports)

    blobs = {p for p in tree(out) if p.endswith(".safetensors")}
    assert {Path(b).parent.as_posix() for b in blobs} == {".", "onnx"}  # each model's blob beside it
    # plus the record of what this run wrote (a re-run removes what the folder no longer has)
    assert tree(out) - blobs == tree(repo) - {"model.onnx_data"} | {".weightshare-folder.json"}
    assert not (out / "model.onnx_data").exists()  # converted into the blob, not copied
    for rel, (data, mode) in SIDE.items():
        assert (out / rel).read_bytes() == data
        assert stat.S_IMODE((out / rel).stat().st_mode) == mode, rel
    for rel in ("model.onnx", "onnx/decoder_model.onnx"):
        for a, b in zip(run(repo / rel), run(out / rel)):
            assert np.array_equal(a, b), rel
    assert weightshare.check([out]).ok


def test_a_broken_model_anywhere_leaves_nothing(tmp_path):
    repo = make_repo(tmp_path)
    (repo / "onnx" / "decoder_model_merged.onnx").write_bytes(b"\x08\x07" + b"\xff" * 64)  # ir_version, then junk
    out = tmp_path / "out"
    with pytest.raises(weightshare.WeightshareError):
        weightshare.convert_folder(repo, out)
    assert not out.exists()


def test_folder_refusals(tmp_path):
    repo = make_repo(tmp_path)
    with pytest.raises(UsageError, match="overlaps"):
        weightshare.convert_folder(repo, repo / "converted")
    with pytest.raises(UsageError, match="subfolder"):  # given alone, its tree would be kept
        weightshare.convert_zoo([repo, tmp_path / "other.onnx"], tmp_path / "zoo", "shared")
    os.mkfifo(repo / "onnx" / "pipe")  # reading it would block forever
    with pytest.raises(UsageError, match="not a regular file"):
        weightshare.convert_folder(repo, tmp_path / "fifo")
    os.unlink(repo / "onnx" / "pipe")
    with pytest.raises(UsageError, match="convert_folder"):
        weightshare.convert(repo, tmp_path / "one")
    with pytest.raises(UsageError, match="no models"):
        (tmp_path / "empty").mkdir()
        weightshare.convert_folder(tmp_path / "empty", tmp_path / "o")
    assert not (repo / "converted").exists() and not (tmp_path / "zoo").exists() and not (tmp_path / "one").exists()
    assert not (tmp_path / "fifo").exists()
