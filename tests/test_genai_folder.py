"""onnxruntime-genai folders: `convert DIR -o OUT` (plain and --prepack) gives a folder `onnxruntime_genai.Model`
opens, generating the original's tokens with bit-identical logits at every step.

The folder is what genai's model builder writes for `-e cpu` (genai_config.json, model.onnx + model.onnx.data;
GroupQueryAttention with in-graph rotary, SkipSimplifiedLayerNormalization, MatMulNBits int4 or fp32 MatMul), built
in code with seeded weights. On packed data that does not match the CPU, genai (which opens model.onnx itself)
fails in og.Model; weightshare.genai.model opens the portable twin instead.
"""

from __future__ import annotations

import json
import logging
import struct

import numpy as np
import pytest

og = pytest.importorskip("onnxruntime_genai")

import genai_model as gm  # noqa: E402

import weightshare.genai as wgenai  # noqa: E402
import weightshare.ort as wort  # noqa: E402
from weightshare.formats.onnx.ort.prepack import portable_name  # noqa: E402

PROMPTS = ([1, 5, 7, 9, 11], [3, 200, 17])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from conftest import run_cli

    d = tmp_path_factory.mktemp("genai")
    out = {}
    for kind, int4 in (("int4", True), ("fp32", False)):
        src = gm.genai_folder(d / kind / "src", mib=1, seed=3, int4=int4)
        out[kind, "src"] = src
        for variant, flags in (("plain", []), ("prepack", ["--prepack"])):
            dst = d / kind / variant
            res = run_cli("convert", src, "-o", dst, "-q", *flags)
            assert res.returncode == 0, res.stderr
            out[kind, variant] = dst
    return out


def _same(a, b) -> None:
    tokens_a, logits_a = a
    tokens_b, logits_b = b
    assert tokens_a == tokens_b
    assert len(logits_a) == len(logits_b) > 1
    assert all(np.array_equal(x, y) for x, y in zip(logits_a, logits_b, strict=True))


@pytest.mark.slow  # four conversions, two with an ORT child
@pytest.mark.parametrize("kind", ["int4", "fp32"])
@pytest.mark.parametrize("variant", ["plain", "prepack"])
def test_converted_folder_generates_the_original_tokens(folders, kind, variant):
    src, out = folders[kind, "src"], folders[kind, variant]
    # the side file is there unchanged, the weights are in the blob, not in a copied model.onnx.data
    assert (out / "genai_config.json").read_bytes() == (src / "genai_config.json").read_bytes()
    assert not (out / "model.onnx.data").exists()
    for prompt in PROMPTS:
        _same(gm.generate(src, prompt, 12), gm.generate(out, prompt, 12))
        _same(gm.generate(src, prompt, 12), gm.generate(wgenai.model(out), prompt, 12))


@pytest.mark.slow
def test_prepack_output_has_packed_copies_genai_uses(folders):
    out = folders["int4", "prepack"]
    info, _blob = wort.prepack_info(out / "model.onnx")
    assert info["portable_model"] == portable_name("model.onnx")
    assert (out / portable_name("model.onnx")).exists()


def _flip_one_packed_byte(folder) -> str:
    blob = next(folder.glob("*.safetensors"))
    data = bytearray(blob.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k.startswith("ort.prepacked/") and "q_proj" in k)
    start, end = header[name]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    return name


@pytest.mark.slow
def test_mismatched_packed_data_fails_in_genai_and_the_helper_opens_the_portable_twin(folders, tmp_path, caplog):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folders["int4", "prepack"], bad)
    name = _flip_one_packed_byte(bad)
    # genai opens model.onnx itself: ORT re-packs the weight, compares, and refuses the model
    with pytest.raises(RuntimeError, match="ValidatePrePackedWeights"):
        og.Model(str(bad))
    with caplog.at_level(logging.WARNING, logger="weightshare.genai"):
        model = wgenai.model(bad)
    said = caplog.records[0].getMessage()
    assert name in said and portable_name("model.onnx") in said
    _same(gm.generate(folders["int4", "src"], PROMPTS[0], 12), gm.generate(model, PROMPTS[0], 12))


@pytest.mark.slow
def test_helper_opens_the_portable_twin_on_another_machine(folders, monkeypatch, caplog):
    monkeypatch.setattr(wort, "_machine", {**wort.this_machine(), "cpu_features": ["not", "this", "cpu"]})
    with caplog.at_level(logging.WARNING, logger="weightshare.genai"):
        model = wgenai.model(folders["int4", "prepack"])
    assert "cpu_features" in caplog.records[0].getMessage()
    _same(gm.generate(folders["int4", "src"], PROMPTS[1], 12), gm.generate(model, PROMPTS[1], 12))


def test_helper_refuses_a_folder_without_a_decoder(tmp_path):
    from weightshare.errors import InvalidModel

    (tmp_path / "genai_config.json").write_text('{"model": {"decoder": {"filename": "../x.onnx"}}}')
    with pytest.raises(InvalidModel, match="not a file inside the folder"):
        wgenai.model(tmp_path)
    (tmp_path / "genai_config.json").write_text("{}")
    with pytest.raises(InvalidModel, match="names no decoder filename"):
        wgenai.model(tmp_path)
