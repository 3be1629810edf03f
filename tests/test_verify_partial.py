"""verify on exporters' real input paths: ids inside every table a graph indexes (however they reach it), a past
as long as a sliding window, and a verdict that says when planned runs did not run.

Before: an ORT-optimizer BERT (its ids cast to int32 before EmbedLayerNormalization) got random token type ids
beyond its 2-row table at batch 8 and 64, both runs were skipped and the verdict was "ok: 1 runs"; a genai decoder
(GroupQueryAttention refuses batch > 1 with a sequence and a past) said "ok: 2 runs"; a Gemma2-like decoder
(window-sized KV cache) exited 2 blaming the original.
After: every planned run of the BERT and of the indirect tables runs; the genai decoder's batch-8 run is made one
token per row; a run that cannot be made makes the verdict "ok (partial: 1 of 3 runs; ... not run: why)", a
warning in --format github, exit 1 with --strict.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

import weightshare
from weightshare._contract import schema_path

sys.path.insert(0, str(Path(__file__).parent))
import decoder_fixtures as fx  # noqa: E402
import genai_model as gm  # noqa: E402
import model_forms as mf  # noqa: E402


def _converted(src: Path, out: Path) -> Path:
    weightshare.convert(src, out)
    return out / src.name


@pytest.mark.slow
@pytest.mark.parametrize("fp16", [False, True])
def test_ort_optimizer_bert_ids_stay_inside_its_tables(tmp_path, fp16):
    src = mf.ort_optimizer_bert(tmp_path / "bert.onnx", fp16=fp16)
    report = weightshare.verify(src, _converted(src, tmp_path / "out"))
    assert report.passed and report.runs == 3, (report.notes, report.mismatches)
    assert not report.skipped


def test_an_index_reaching_its_table_indirectly_is_bounded_by_the_table(tmp_path):
    """Cast into a DequantizeLinear table, Unsqueeze/Squeeze/Reshape into a 2-row table, an offset added before
    GatherBlockQuantized (which does not check its indices: out of range it reads past the table), a Concat
    into GatherElements: each input is bounded by the axis it reaches, in verify and in check's child alike."""
    from weightshare.formats.onnx.decode import read_facts
    from weightshare.formats.onnx.indices import model_index_bounds

    src = mf.indirect_tables(tmp_path / "tables.onnx")
    expected = {"input_ids": 40, "token_type_ids": 2, "bucket_ids": 8 - 3}
    assert read_facts(src).bounds == expected
    assert model_index_bounds(str(src)) == expected
    report = weightshare.verify(src, _converted(src, tmp_path / "out"))
    assert report.passed and report.runs == 3, (report.notes, report.mismatches)
    assert not report.skipped


@pytest.mark.slow
def test_sliding_window_attention_gets_a_past_of_its_window(cli, tmp_path):
    """genai's Gemma2 form: a window-sized KV cache refuses a past shorter than local_window_size."""
    folder = gm.genai_folder(tmp_path / "g", mib=0.5, int4=False, window=16)
    converted = _converted(folder / "model.onnx", tmp_path / "out")
    res = cli("verify", folder / "model.onnx", converted, "--decode-steps", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "at 16: GroupQueryAttention's local_window_size" in res.stdout + res.stderr
    assert "prefill + 2 decode steps" in res.stdout + res.stderr


def test_a_gqa_decoder_runs_batch_8_at_the_sequence_the_runtime_takes(tmp_path):
    """GroupQueryAttention refuses batch > 1 with a sequence and a past: the batch-8 run is made with one new token
    per row instead of being skipped, and the report says so."""
    folder = gm.genai_folder(tmp_path / "g", mib=0.5, int4=False)
    src = folder / "model.onnx"
    report = weightshare.verify(src, _converted(src, tmp_path / "out"))
    assert report.passed and report.runs == 3, (report.notes, report.mismatches)
    assert not report.skipped
    note = next(n for n in report.notes if n.startswith("run 1 at"))
    expected = (
        "run 1 at batch_size=8, sequence_length=1 instead (at batch_size=8, sequence_length=8: the original fails in "
        "GroupQueryAttention 'layers.0.attn.gqa': batch_size must be 1"
    )
    assert note.startswith(expected), note


@pytest.mark.slow
def test_a_skipped_run_makes_the_verdict_partial(cli, tmp_path):
    """A decoder whose graph runs at batch 1 only (seqlens_k reshaped to [1]): the batch-8 and batch-64 runs
    cannot be made at any sequence length."""
    src = fx.llama_like(tmp_path / "model.onnx", lengths_as_inputs=True)
    converted = _converted(src, tmp_path / "out")
    res = cli("verify", src, converted)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "ok (partial: 1 of 3 runs; run 1 at batch_size=8, sequence_length=8 not run: the original fails in " \
        "Reshape" in out and "run 2 at batch_size=64, sequence_length=1 not run: " in out  # fmt: skip
    assert "\nok:" not in "\n" + out
    strict = cli("verify", src, converted, "--strict")
    assert strict.returncode == 1 and "FAILED (--strict; partial: 1 of 3 runs" in strict.stdout + strict.stderr
    gh = cli("verify", src, converted, "--format", "github")
    assert gh.returncode == 0
    assert any(line.startswith("::warning ") and "ok (partial: 1 of 3 runs" in line for line in gh.stdout.splitlines())
    schema = json.loads(schema_path("verify").read_text())
    for args, code in (((), 0), (("--strict",), 1)):
        res = cli("verify", src, converted, "--json", *args)
        doc = json.loads(res.stdout)
        jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
        assert res.returncode == doc["exit_code"] == code
        (rec,) = doc["reports"]
        assert rec["partial"] and rec["passed"] and rec["runs"] == 1 and rec["planned_runs"] == 3
        assert len(rec["skipped"]) == 2 and "batch_size=8" in rec["skipped"][0]
