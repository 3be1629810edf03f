"""`verify --decode-steps N` and decoder inputs read from the model.

Under test: the CLI (and ``weightshare.verify(..., decode_steps=N)``) on decoder exports built with onnx helpers
(``decoder_fixtures``): a prefill step and N steps feeding each present output back as its past input, both models
in lockstep, every step's outputs compared byte for byte; head counts / head size read from attention attributes,
genai_config.json and config.json; index inputs kept inside the tables they index (EmbedLayerNormalization's
segment ids, RotaryEmbedding's position ids). The attention in the fixtures adds (mask - 1) * 1e4 to the scores,
so a mask whose length is not past + new tokens makes the original fail: the lengths are checked by ORT itself.
"""

from __future__ import annotations

import json

import decoder_fixtures as fx
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import weightshare
from weightshare.formats.onnx.decode import pairs, read_facts


def _convert(src, out):
    weightshare.convert(src, out)
    return out / src.name


def _decodes(src, out, steps=4, **kw):
    report = weightshare.verify(src, out, decode_steps=steps, **kw)
    assert report.passed and report.decode_steps == steps, report.mismatches
    return report


def test_present_outputs_pair_with_past_inputs_by_name():
    got = pairs(
        [
            "input_ids",
            "past_key_values.0.key",
            "past_key_values.0.value",
            "past_key_values.1.decoder.key",
            "past_key_values.1.encoder.key",
            "past_0",
            "past_key",
        ],
        ["logits", "present.0.key", "present.0.value", "present.1.decoder.key", "present_0", "present_key"],
    )
    assert got == {
        "past_key_values.0.key": "present.0.key",
        "past_key_values.0.value": "present.0.value",
        "past_key_values.1.decoder.key": "present.1.decoder.key",
        "past_0": "present_0",
        "past_key": "present_key",
    }


def test_head_dims_read_from_attributes_and_configs(tmp_path):
    (tmp_path / "a").mkdir()
    llama = fx.llama_like(tmp_path / "a" / "model.onnx", genai_config=False)
    facts = read_facts(llama)  # GroupQueryAttention attributes; head size from Wq's width through RotaryEmbedding
    assert (facts.heads, facts.kv_heads, facts.head_size, facts.vocab) == (4, 2, 8, fx.VOCAB)
    assert facts.bounds["position_ids"] == 64  # rows of the rotary cos cache
    (tmp_path / "b").mkdir()
    plain = fx.decoder_with_past(tmp_path / "b" / "decoder_with_past_model.onnx", 2, 8, "num_heads", "head_size")
    assert read_facts(plain).head_size is None  # plain ops: nothing in the graph says
    (tmp_path / "b" / "config.json").write_text(json.dumps({"n_head": 2, "n_embd": 16}))
    facts = read_facts(plain)
    assert (facts.heads, facts.kv_heads, facts.head_size) == (2, 2, 8)


@pytest.mark.slow
def test_decoder_with_past_decode_steps_bit_identical(cli, tmp_path):
    src = fx.decoder_with_past(tmp_path / "decoder_with_past_model.onnx")
    out = _convert(src, tmp_path / "out")
    res = cli("verify", src, out, "--decode-steps", "4")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 runs, prefill + 4 decode steps" in res.stdout, res.stdout
    # the prefill and every step: the three outputs of each compared, after the three runs'
    assert _decodes(src, out).outputs_compared == 3 * 3 + 5 * 3


@pytest.mark.slow
def test_symbolic_head_dims_named_at_once_then_read_from_config_json(cli, tmp_path):
    src = fx.decoder_with_past(tmp_path / "decoder_with_past_model.onnx", 2, 8, "num_heads", "head_size")
    out = _convert(src, tmp_path / "out")
    res = cli("verify", src, out)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--dim num_heads=N --dim head_size=N" in lines[0], res.stderr
    _decodes(src, out, dims={"num_heads": 2, "head_size": 8})  # the example, filled in, runs
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 2, "head_dim": 8}))
    _decodes(src, out)


@pytest.mark.slow
def test_merged_decoder_decode_steps_bit_identical(cli, tmp_path):
    src = fx.decoder_with_past(tmp_path / "decoder_model_merged.onnx", merged=True)
    out = _convert(src, tmp_path / "out")
    res = cli("verify", src, out)
    assert res.returncode == 0, res.stdout + res.stderr
    _decodes(src, out)


@pytest.mark.slow
def test_a_weight_read_only_by_decode_steps_changed_fails_on_a_decode_step(cli, tmp_path):
    """The merged decoder's cache branch adds a 32-byte bias kept inline: run 0 (use_cache_branch false) never
    reads it, the payload comparison covers blob payloads only, so only a decode step can see it changed."""
    src = fx.decoder_with_past(tmp_path / "decoder_model_merged.onnx", merged=True)
    out = _convert(src, tmp_path / "out")
    model = onnx.load(str(out), load_external_data=False)
    bias = next(t for t in model.graph.initializer if t.name == "cache_bias")
    assert not bias.external_data  # inline: the premise of the test
    bias.CopyFrom(numpy_helper.from_array(np.full(8, 0.5, np.float32), "cache_bias"))
    onnx.save(model, str(out))
    assert weightshare.verify(src, out, runs=1).passed  # the plain run cannot tell
    res = cli("verify", src, out, "--runs", "1", "--decode-steps", "4")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "FAIL: decode step 1:" in res.stdout and "decode step 0" not in res.stdout, res.stdout


@pytest.mark.slow
def test_llama_like_gqa_rotary_symbolic_head_dims(cli, tmp_path):
    src = fx.llama_like(tmp_path / "model.onnx")
    out = _convert(src, tmp_path / "out")
    res = cli("verify", src, out)
    assert res.returncode == 0, res.stdout + res.stderr
    _decodes(src, out)
    (tmp_path / "genai_config.json").unlink()  # GroupQueryAttention's attributes are enough
    _decodes(src, out, runs=1)


@pytest.mark.slow
def test_t5_like_encoder_decoder_pair(cli, tmp_path):
    srcs = fx.t5_like(tmp_path / "t5")
    weightshare.convert_folder(tmp_path / "t5", tmp_path / "out")
    for src in srcs:
        res = cli("verify", src, tmp_path / "out" / src.name)
        assert res.returncode == 0, src.name + res.stdout + res.stderr
    for src in srcs[1:]:  # decoder_model: no cache, the sequence grows; decoder_with_past: the cross past stays
        _decodes(src, tmp_path / "out" / src.name)


@pytest.mark.slow
def test_embed_layer_normalization_inputs_generated_validly(tmp_path):
    """Random ids in [0, 3) were out of the 2-row segment table: ORT's "input index out of range"."""
    src = fx.bert_embed_layernorm(tmp_path / "model.onnx")
    out = _convert(src, tmp_path / "out")
    assert read_facts(src).bounds == {"input_ids": fx.VOCAB, "token_type_ids": 2}
    report = weightshare.verify(src, out, dims={"sequence_length": 16})
    assert report.passed and report.runs == 3, report.mismatches


@pytest.mark.slow
def test_seqlens_k_and_total_sequence_length_inputs_grow_with_the_mask(tmp_path):
    """Both are graph inputs here, and the graph fails unless they agree with the attention mask's length."""
    src = fx.llama_like(tmp_path / "model.onnx", lengths_as_inputs=True)
    weightshare.convert(src, tmp_path / "out")
    # batch 1: the graph's check (Reshape of seqlens_k [batch_size] to [1]) runs at no other batch size
    report = weightshare.verify(src, tmp_path / "out" / src.name, runs=2, decode_steps=4, dims={"batch_size": 1})
    assert report.passed and report.runs == 2 and report.decode_steps == 4, report.mismatches
    with pytest.raises(weightshare.OriginalFails):  # the check in the graph can fail
        weightshare.verify(src, tmp_path / "out" / src.name, runs=1, inputs={"seqlens_k": np.array([3], np.int32)})
