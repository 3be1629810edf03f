"""Paths as the runtime resolves them.

Before: a Hugging Face hub snapshot (``snapshots/REV/model.onnx -> ../../blobs/SHA``, its ``model.onnx_data``
likewise), built in a temp dir; a symlinked model whose target directory holds other weights under the same
data file name; a converted model opened through a symlink in a directory without its blob.
Under test: ``weightshare convert`` / ``check`` / ``inspect`` / ``verify`` (CLI) on the link path.
After: the hub snapshot converts bit-exact with onnxruntime on the link path (batch 1 and 8) and OUT holds no
symlink; external data is read beside the path given (as onnxruntime opens it), never beside the link's target;
what onnxruntime refuses to load through a link, ``check`` does not pass.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from weightshare._samples import mlp_onnx

DIM = 48


def external_model(path: Path, seed: int, layers: int = 3) -> Path:
    """An MLP whose weights live in ``<name>_data`` beside it (the layout optimum writes over 2 GB)."""
    src = mlp_onnx(path.parent / f".src-{seed}.onnx", layers=layers, dim=DIM, weights="float32", seed=seed)
    model = onnx.load(str(src))
    os.unlink(src)
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "batch"  # batch 1 and 8 through one model
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + "_data", size_threshold=0)
    return path


def hub_snapshot(cache: Path, seed: int, rev: str = "0123abcd") -> Path:
    """``models--org--name`` as huggingface_hub lays it out: files in blobs/ named by digest, a snapshot of
    relative symlinks into them. Returns the link path of the model."""
    repo = cache / "models--org--tiny-mlp"
    blobs, snap = repo / "blobs", repo / "snapshots" / rev
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    staging = cache / "staging"
    staging.mkdir()
    model = external_model(staging / "model.onnx", seed)
    for name, digest in (("model.onnx", "9f" * 32), ("model.onnx_data", "4e" * 32)):
        os.replace(staging / name, blobs / digest)
        os.symlink(f"../../blobs/{digest}", snap / name)
    shutil.rmtree(staging)
    assert not model.exists()
    return snap / "model.onnx"


def run(model: Path, batch: int) -> list[np.ndarray]:
    x = np.random.default_rng(batch).standard_normal((batch, DIM)).astype(np.float32)
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def links_in(d: Path) -> list[str]:
    return [str(p) for p in d.rglob("*") if p.is_symlink()]


@pytest.mark.slow
def test_hub_snapshot_converts_bit_exact_on_the_link_path(tmp_path, cli):
    link = hub_snapshot(tmp_path / "hub", seed=7)
    out = tmp_path / "out"
    res = cli("convert", link, "-o", out)
    assert res.returncode == 0, res.stderr
    assert links_in(out) == []
    for batch in (1, 8):
        for a, b in zip(run(link, batch), run(out / "model.onnx", batch)):
            assert np.array_equal(a, b)
    assert cli("check", out / "model.onnx").returncode == 0
    res = cli("verify", link, out / "model.onnx")
    assert res.returncode == 0, res.stdout + res.stderr


def test_hub_snapshot_folder_converts_and_copies_its_side_files(tmp_path, cli):
    link = hub_snapshot(tmp_path / "hub", seed=3)
    blobs = link.parent.parent.parent / "blobs"
    (blobs / ("c1" * 32)).write_bytes(b'{"model_type": "mlp"}\n')
    os.symlink(f"../../blobs/{'c1' * 32}", link.parent / "config.json")
    out = tmp_path / "out"
    res = cli("convert", link.parent, "-o", out)
    assert res.returncode == 0, res.stderr
    assert links_in(out) == []
    assert (out / "config.json").read_bytes() == b'{"model_type": "mlp"}\n'
    assert not (out / "model.onnx_data").exists()
    for a, b in zip(run(link, 4), run(out / "model.onnx", 4)):
        assert np.array_equal(a, b)


@pytest.mark.slow
def test_external_data_is_read_beside_the_path_given_not_the_links_target(tmp_path, cli):
    # real/model.onnx with its own data; view/model.onnx -> ../real/model.onnx with OTHER weights of the same
    # layout beside the link: onnxruntime on view/model.onnx computes with view's weights
    real, view = tmp_path / "real", tmp_path / "view"
    real.mkdir()
    view.mkdir()
    external_model(real / "model.onnx", seed=1)
    other = tmp_path / "other"
    other.mkdir()
    external_model(other / "model.onnx", seed=2)
    shutil.copyfile(other / "model.onnx_data", view / "model.onnx_data")
    os.symlink("../real/model.onnx", view / "model.onnx")
    assert not np.array_equal(run(real / "model.onnx", 1)[0], run(view / "model.onnx", 1)[0])

    out = tmp_path / "out"
    res = cli("convert", view / "model.onnx", "-o", out)
    assert res.returncode == 0, res.stderr
    for batch in (1, 8):
        for a, b in zip(run(view / "model.onnx", batch), run(out / "model.onnx", batch)):
            assert np.array_equal(a, b)
    res = cli("inspect", view / "model.onnx", "--json")
    assert res.returncode == 0, res.stderr
    files = {p.get("file") for p in json.loads(res.stdout)["reports"][0]["payloads"] if p.get("file")}
    assert files == {"model.onnx_data"}


@pytest.mark.slow
def test_a_converted_model_through_a_link_onnxruntime_refuses_does_not_pass_check(tmp_path, cli):
    src = external_model(tmp_path / "src" / "model.onnx", seed=5) if (tmp_path / "src").mkdir() is None else None
    out = tmp_path / "out"
    assert cli("convert", src, "-o", out).returncode == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(out / "model.onnx", elsewhere / "model.onnx")  # the blob is not beside the link
    with pytest.raises(Exception, match="model.weights"):
        run(elsewhere / "model.onnx", 1)  # onnxruntime looks for the blob beside the link
    res = cli("check", elsewhere / "model.onnx")
    assert res.returncode != 0, res.stdout
    res = cli("verify", src, elsewhere / "model.onnx")
    assert res.returncode != 0, res.stdout
