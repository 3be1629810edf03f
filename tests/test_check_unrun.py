"""check on what it measures: the weights its figures name, and a model its generated inputs cannot run.

Before: a tied-head decoder (genai's Gemma2 fp32 form: a Transpose of the lm_head weight ORT folds per session)
had its 16 MiB unexplained figure's "largest" weights named as ``onnx::Reshape_288`` and
``/model/constants/INT64/[-1]``; a voice-activity model whose generated inputs fail (reflect padding of a
one-sample audio axis inside an ``If``) was measured as sessions without a run, its figure called weights and its
verdict left to the noise of unrun sessions (exit 1, 1, 0 on three runs of the real model).
After: figures name real weights only; an unrun model is judged by the static rules, says so and suggests
--input / --dim, with the same verdict and findings on every run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import weightshare

sys.path.insert(0, str(Path(__file__).parent))
import model_forms as mf  # noqa: E402


def _check(cli, model: Path, *args: str) -> tuple[int, dict]:
    res = cli("check", model, "--json", *args)
    assert res.returncode in (0, 1), res.stdout + res.stderr
    return res.returncode, json.loads(res.stdout)


@pytest.mark.slow
def test_figures_never_name_shape_constants_as_weights(cli, tmp_path):
    src = mf.tied_head(tmp_path / "model.onnx")
    _, doc = _check(cli, src)
    measured = [f for f in doc["findings"] if f["code"] == "copied-per-session"]
    assert measured, doc["findings"]  # the per-session fold of the Transpose: measured, no rule explains it
    for f in doc["findings"]:
        assert "Reshape_288" not in f["message"] and "/model/constants" not in f["message"], f["message"]
    default = next(f for f in measured if "ort-default" in f["message"])
    assert "largest: lm_head.MatMul.weight, proj.weight)" in default["message"], default["message"]


@pytest.mark.slow
def test_a_model_its_inputs_cannot_run_is_judged_by_static_rules_the_same_every_run(cli, tmp_path):
    src = mf.voice_activity(tmp_path / "vad.onnx")
    weightshare.convert(src, tmp_path / "out", prepack=True)
    runs = [_check(cli, tmp_path / "out" / "vad.onnx") for _ in range(3)]
    codes = {code for code, _ in runs}
    findings = {json.dumps([(f["code"], f["severity"], f["message"]) for f in doc["findings"]]) for _, doc in runs}
    assert len(codes) == 1 and len(findings) == 1, (codes, findings)
    (model,) = runs[0][1]["reports"]
    assert model["copies_source"] == "static", model
    note = next(n for n in model["measure_notes"] if "not measured" in n)
    assert "check's generated inputs do not run the model" in note and "Pad reflect" in note, note
    assert "--input NAME=FILE.npy" in note and "--dim NAME=VALUE" in note, note
    assert not any(f["code"] == "copied-per-session" for f in runs[0][1]["findings"])
    # given inputs that run it, it is measured
    audio = tmp_path / "audio.npy"
    import numpy as np

    np.save(audio, np.random.default_rng(0).standard_normal((1, 512)).astype(np.float32))
    np.save(tmp_path / "sr.npy", np.array(16000, np.int64))
    _, doc = _check(
        cli, tmp_path / "out" / "vad.onnx", "--input", f"input={audio}", "--input", f"sr={tmp_path / 'sr.npy'}"
    )
    assert doc["reports"][0]["copies_source"] == "measured", doc["reports"][0]["measure_notes"]
