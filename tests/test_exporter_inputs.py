"""verify and check take their inputs from what exporters write: image and audio sizes from the ``config.json``
beside the model (capped, and the cap said), a merged encoder-decoder's decode chain from the real encoder's
outputs, and ``check --dim / --input`` as ``verify`` has them (one parser, one feed maker).

Before: a ViT export needed ``--dim height=.. --dim width=..`` that its config.json states; optimum's merged Whisper
decoder with ``--decode-steps 4`` fed the cache branch's dummy ``present.N.encoder.*`` back and stopped with "the
original model fails in onnxruntime"; check measured both unrun ("inputs could not be generated") and had no
``--dim`` / ``--input``. The models are tiny (a few hundred KiB); one check child pair per model.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from model_forms import vit_export, whisper_family

import weightshare
from weightshare._inventory import MeasureInputs
from weightshare.errors import UsageError
from weightshare.formats.onnx.measure import _measure

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """optimum's Whisper export in miniature and its conversion (the folder, config.json carried along)."""
    src = tmp_path_factory.mktemp("whisper")
    whisper_family(src)
    out = src.parent / "whisper-out"
    weightshare.convert_folder(src, out)
    return src, out


@pytest.mark.slow
def test_a_merged_whisper_decoder_verifies_four_decode_steps_from_the_real_encoder(cli, whisper):
    src, out = whisper
    res = cli(
        "verify", src / "decoder_model_merged.onnx", out / "decoder_model_merged.onnx", "--decode-steps", "4", "--json"
    )
    assert res.returncode == 0, res.stdout + res.stderr
    (doc,) = json.loads(res.stdout)["reports"]
    assert doc["decode_steps"] == 4
    assert any("encoder_hidden_states from encoder_model.onnx" in n for n in doc["notes"]), doc["notes"]
    # the encoder itself: mel bins and frames from config.json, no --dim
    res = cli("verify", src / "encoder_model.onnx", out / "encoder_model.onnx", "--runs", "1")
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_a_vit_export_verifies_and_is_measured_run_with_no_hand_dims(cli, tmp_path):
    src = vit_export(tmp_path / "vit" / "model.onnx")
    out = tmp_path / "out"
    weightshare.convert_folder(src.parent, out)
    res = cli("verify", src, out / "model.onnx", "--runs", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    res = cli("check", out / "model.onnx", "-v")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "without a run" not in res.stderr, res.stderr


@pytest.mark.slow
def test_check_takes_dim_and_input_as_verify_does(cli, tmp_path):
    src = vit_export(tmp_path / "model.onnx", config=False)  # nothing says the image size
    pixels = tmp_path / "pixels.npy"
    np.save(pixels, np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32))
    # the measuring child check runs (one setting here, to keep the test cheap): unrun without them, run with them
    given = MeasureInputs(input_files=(("pixel_values", str(pixels)),))
    res, why = _measure(src, share=True, arena=False, feeds=given)
    assert not why and res["ran"], (why, res)
    res, why = _measure(src, share=True, arena=False, feeds=MeasureInputs(dims=(("height", 32), ("width", 32))))
    assert not why and not res["ran"] and "--dim num_channels=N" in res["no_run"], res
    # a dim no input has is a usage error (exit 2), as in verify; so are an unreadable file and an unknown input
    res = cli("check", src, "--dim", "heigth=32")
    assert res.returncode == 2 and "--dim heigth: no input of model.onnx" in res.stderr, res.stderr
    res = cli("check", src, "--input", f"pixel_values={tmp_path / 'missing.npy'}")
    assert res.returncode == 2 and "missing.npy" in res.stderr, res.stderr
    with pytest.raises(UsageError, match="--input nope"):
        weightshare.check([src], inputs={"nope": pixels})


def test_config_sizes_above_their_cap_are_ignored_and_said(cli, tmp_path):
    src = vit_export(tmp_path / "model.onnx")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "image_size": 50_000_000}))
    res = cli("verify", src, src, "--runs", "1")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "image_size=50000000 ignored (above the cap of 8192)" in res.stderr, res.stderr
    assert "--dim height=N" in res.stderr, res.stderr
