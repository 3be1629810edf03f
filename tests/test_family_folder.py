"""A model folder converted with ``--shared-blob``: its tree and side files kept, one blob for the family.

Before: an optimum-like seq2seq folder (config.json, generation_config.json, tokenizer.json at the root;
onnx/encoder_model.onnx, onnx/decoder_model.onnx, onnx/decoder_with_past_model.onnx, the decoders holding the same
weights, each model with its own external data file).
Under test: ``weightshare convert DIR -o OUT --shared-blob t5`` (CLI), with and without ``--prepack``.
After: OUT has the folder's tree, its side files byte-identical; onnx/ holds one blob every model references (ONNX
external data must lie in the model's directory or below, so the blob sits beside the models); every model loads
in onnxruntime and gives outputs np.array_equal to the original's at batch 1 and 4; a re-run after an input
changed leaves exactly what a fresh conversion writes (the removal rule).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import model_forms as mf
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from weightshare._outputs_record import RECORD

SIDE = {
    "config.json": '{"model_type": "t5", "is_encoder_decoder": true}',
    "generation_config.json": '{"decoder_start_token_id": 0}',
    "tokenizer.json": '{"version": "1.0", "model": {"type": "Unigram"}}',
}
MODELS = ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")


def optimum_folder(d: Path, seed: int = 0) -> Path:
    onnx_dir = d / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    for name, text in SIDE.items():
        (d / name).write_text(text)
    mf.fp32_mlp(onnx_dir / "encoder_model.onnx", mib=0.25, seed=seed + 1)
    mf.decoder_family(onnx_dir, mib=0.25, seed=seed)
    for p in onnx_dir.glob("decoder_model_merged*"):
        p.unlink()
    return d


def files(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and p.name != RECORD}


def locations(model: Path) -> set[str]:
    m = onnx.load(str(model), load_external_data=False)
    return {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}


def assert_same_outputs(src: Path, out: Path) -> None:
    for name in MODELS:
        a, b = ort.InferenceSession(str(src / "onnx" / name)), ort.InferenceSession(str(out / "onnx" / name))
        for batch in (1, 4):
            feeds = mf.feeds(src / "onnx" / name, batch=batch)
            assert np.array_equal(a.run(None, feeds)[0], b.run(None, feeds)[0]), (name, batch)


def convert(cli, src: Path, out: Path, *extra: str) -> dict:
    res = cli("convert", src, "-o", out, "--shared-blob", "t5", "--json", "-q", *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("prepack", [pytest.param(False), pytest.param(True, marks=pytest.mark.slow)])
def test_a_family_folder_keeps_its_tree_with_one_blob(tmp_path, cli, prepack):
    extra = ("--prepack",) if prepack else ()
    src, out = optimum_folder(tmp_path / "t5_onnx"), tmp_path / "out"
    doc = convert(cli, src, out, *extra)
    for name, text in SIDE.items():
        assert (out / name).read_text() == text
    (blob,) = (out / "onnx").glob("t5.*.safetensors")
    assert not list(out.glob("*.safetensors")) and doc["reports"][0]["zoo"]["blobs"] == [str(blob)]
    assert sorted(Path(p).name for p in doc["reports"][0]["folder"]["copied"]) == sorted(SIDE)
    for name in MODELS:
        assert locations(out / "onnx" / name) == {blob.name}
    twins = {f"onnx/{n.replace('.onnx', '.portable.onnx')}" for n in MODELS} if prepack else set()
    assert files(out) == {*SIDE, *(f"onnx/{n}" for n in MODELS), f"onnx/{blob.name}", *twins}
    assert_same_outputs(src, out)

    # re-runs: new encoder weights, a side file gone; at --blob-grace 0 OUT holds what a fresh conversion writes
    mf.fp32_mlp(src / "onnx" / "encoder_model.onnx", mib=0.25, seed=7)
    (src / "tokenizer.json").unlink()
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in src.rglob("*") if p.is_file()}
    convert(cli, src, out, "--blob-grace", "0", *extra)
    fresh = tmp_path / "fresh"
    convert(cli, src, fresh, *extra)
    assert files(out) == files(fresh) and len(list((out / "onnx").glob("t5.*.safetensors"))) == 1
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in before} == before  # the inputs untouched
    assert_same_outputs(src, out)


def test_each_directory_holding_models_gets_its_own_blob(tmp_path, cli):
    """ONNX Runtime refuses external data outside the model's directory: models in two directories cannot share one
    file, so each directory gets its family's blob."""
    src, out = optimum_folder(tmp_path / "repo"), tmp_path / "out"
    mf.fp32_mlp(src / "encoder_model.onnx", mib=0.25, seed=1)  # a model at the root too
    doc = convert(cli, src, out)
    root, sub = list(out.glob("t5.*.safetensors")), list((out / "onnx").glob("t5.*.safetensors"))
    assert (
        len(root) == 1 and len(sub) == 1 and sorted(doc["reports"][0]["zoo"]["blobs"]) == sorted(map(str, root + sub))
    )
    assert locations(out / "encoder_model.onnx") == {root[0].name}
    assert_same_outputs(src, out)
    a, b = ort.InferenceSession(str(src / "encoder_model.onnx")), ort.InferenceSession(str(out / "encoder_model.onnx"))
    feeds = mf.feeds(src / "encoder_model.onnx", batch=2)
    assert np.array_equal(a.run(None, feeds)[0], b.run(None, feeds)[0])


def test_a_model_that_keeps_its_weights_in_its_own_file_is_converted_on_its_own(tmp_path, cli):
    """An ExecuTorch program beside the family (its weights stay in its own segments, no blob to share): converted as
    a plain folder run converts it, and the ONNX family still gets its one blob."""
    from executorch_fixtures import xnnpack_program

    import weightshare

    src, out = optimum_folder(tmp_path / "repo"), tmp_path / "out"
    pte = xnnpack_program(src / "model.pte", dim=64, layers=2, seed=1)
    convert(cli, src, out)
    weightshare.convert(pte, tmp_path / "alone")
    assert (out / "model.pte").read_bytes() == (tmp_path / "alone" / "model.pte").read_bytes()
    assert len(list((out / "onnx").glob("t5.*.safetensors"))) == 1 and not list(out.glob("*.safetensors"))
    assert_same_outputs(src, out)


def test_convert_folder_says_where_shared_blob_applies(tmp_path):
    """convert_folder used to ignore shared_blob (one blob per model, silently)."""
    import weightshare
    from weightshare.errors import UsageError

    src = optimum_folder(tmp_path / "repo")
    with pytest.raises(UsageError, match="convert_zoo"):
        weightshare.convert_folder(src, tmp_path / "out", shared_blob="t5")
    assert not (tmp_path / "out").exists()
    report = weightshare.convert_zoo([src], tmp_path / "out", "t5")
    assert report.folder == str(src) and len(report.blobs) == 1
