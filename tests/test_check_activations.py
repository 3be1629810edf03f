"""`check` tells weight copies apart from activation memory, and holds a model to its runtime's defaults.

Before: `check` measured each session's whole PSS growth, so the activation arena of a YOLO-like detector (40 MiB
per session, 0.3 MiB of weights) and of a conv vision TFLite model were reported as copied weights (exit 1, "fix:
convert with --prepack" on a --prepack output), and ONNX models were held to ort-disable-prepacking, so plain
conversions that ORT pre-packs per session at its defaults passed. Under test: `check --json` with no options on
models with large activations and small weights (YOLO-like, ViT-like ONNX; conv TFLite), plain and --prepack int4
MatMulNBits and merged-decoder conversions, and the margin logic that re-measures figures near a decision line.
After: activations are an info figure of their own, outputs that share pass, models copied at the defaults fail,
and check's weight figure is within 1.25x of an independent measurement of the weights' cost per session.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from model_forms import build, vit_like
from prepack_samples import cnn_onnx

from weightshare._check import MARGIN, Gate, near_a_line
from weightshare._inventory import ModelInventory

ort = pytest.importorskip("onnxruntime")
MiB = 1 << 20


def _check(cli, model, *flags):
    res = cli("check", model, "--json", *flags)
    doc = json.loads(res.stdout)
    (summary,) = [m for m in doc["reports"] if m["model"] == str(model)]
    return res.returncode, summary, doc["findings"]


def _weights_per_session(path) -> float:
    """Bytes the weights cost per extra session, measured independently: the bench's probe (a fresh process,
    MALLOC_MMAP_THRESHOLD_=1048576, default options) with ORT's CPU arena off, so that activations are freed."""
    from weightshare._runtimes.ort import measure_sessions
    from weightshare.formats.onnx.measure import MALLOC_ENV

    rows = {r["sessions"]: r for r in measure_sessions(str(path), [1, 4], share=False, env=MALLOC_ENV, arena=False)}
    return (rows[4]["data_pss_mib"] - rows[1]["data_pss_mib"]) / 3 * MiB


@pytest.mark.slow
@pytest.mark.parametrize("prepack", [False, True], ids=["original", "prepack"])
def test_a_yolo_like_detector_s_activations_are_not_weight_copies(cli, tmp_path, prepack):
    model = cnn_onnx(tmp_path / "yolo.onnx", channels=32, blocks=6, spatial=256)  # 0.3 MiB of weights
    if prepack:
        assert cli("convert", model, "-o", tmp_path / "out", "-q", "--prepack").returncode == 0
        model = tmp_path / "out" / "yolo.onnx"
    code, summary, findings = _check(cli, model)
    assert code == 0, findings
    assert summary["default_setting"] == "ort-default"
    assert summary["copied_per_session_by_setting"]["ort-default"] < MiB, summary
    assert summary["activation_per_session_by_setting"]["ort-default"] >= 8 * MiB, summary
    (act,) = [f for f in findings if f["code"] == "activation-per-session"]
    assert act["severity"] == "info" and "not a weight copy" in act["message"]
    assert not [f for f in findings if f["code"] == "copied-per-session"], findings


@pytest.mark.slow
def test_a_vit_like_encoder_fails_at_ort_defaults_and_its_prepack_output_passes(cli, tmp_path):
    model = vit_like(tmp_path / "vit.onnx")
    code, summary, findings = _check(cli, model)
    assert code == 1, findings  # MLAS packs its 6 MiB of MatMul weights in every session at default options
    (copy,) = [f for f in findings if f["code"] == "copied-per-session" and f["severity"] == "error"]
    assert "under ort-default" in copy["message"] and "--prepack" in copy["fix"], copy
    figure = summary["copied_per_session_by_setting"]["ort-default"]
    measured = _weights_per_session(model)
    assert measured / 1.25 <= figure <= measured * 1.25, (figure, measured)
    assert summary["activation_per_session_by_setting"]["ort-default"] >= 4 * MiB, summary
    assert cli("convert", model, "-o", tmp_path / "out", "-q", "--prepack").returncode == 0
    code, summary, findings = _check(cli, tmp_path / "out" / "vit.onnx")
    assert code == 0, findings
    assert summary["activation_per_session_by_setting"]["ort-default"] >= 4 * MiB, summary


@pytest.mark.slow
@pytest.mark.parametrize("form", ["matmulnbits4", "merged_decoder"])
def test_plain_conversions_copied_at_ort_defaults_fail_with_no_options_and_prepack_ones_pass(cli, tmp_path, form):
    src = build(form, tmp_path / "m.onnx", mib=8)
    assert cli("convert", src, "-o", tmp_path / "plain", "-q").returncode == 0
    code, summary, findings = _check(cli, tmp_path / "plain" / "m.onnx")
    assert code == 1 and summary["default_setting"] == "ort-default", findings
    assert any(f["code"] == "copied-per-session" and f["severity"] == "error" for f in findings), findings
    assert cli("convert", src, "-o", tmp_path / "pre", "-q", "--prepack").returncode == 0
    code, _, findings = _check(cli, tmp_path / "pre" / "m.onnx")
    assert code == 0, findings
    # the portable twin is what weightshare.ort.session opens where the packed copies cannot run, at the caller's
    # options: check states what each of its sessions pre-packs (a warning: the fallback's cost), and passes
    code, summary, findings = _check(cli, tmp_path / "pre" / "m.portable.onnx")
    assert code == 0 and summary["default_setting"] == "ort-default", findings
    assert any("fallback model of m.onnx" in f["message"] and f["severity"] == "warning" for f in findings), findings


@pytest.mark.slow
def test_a_conv_vision_tflite_model_s_arena_is_activation_memory(cli, tmp_path):
    pytest.importorskip("ai_edge_litert")
    sys.path.insert(0, str(Path(__file__).parent))
    from tflite_fixtures import OP, ModelBuilder, _conv_options

    rng = np.random.default_rng(0)
    mb = ModelBuilder()
    g = mb.subgraph("main")
    x, cin = g.input("x", [1, 160, 160, 3]), 3
    for i in range(4):  # 0.1 MiB of weights, 3 MiB per activation
        w = g.const(f"w{i}", (rng.standard_normal((32, 3, 3, cin)) * 0.1).astype(np.float32))
        b = g.const(f"b{i}", np.zeros(32, np.float32))
        y = g.tensor(f"c{i}", [1, 160, 160, 32], "float32")
        g.op(OP.CONV_2D, [x, w, b], [y], *_conv_options())
        x, cin = y, 32
    g.outputs = [x]
    mb.signature("serving_default", g)
    model = mb.save(tmp_path / "conv.tflite")
    code, summary, findings = _check(cli, model)
    assert code == 0, findings
    assert summary["default_setting"] == "litert-xnnpack"
    assert summary["copied_per_session_by_setting"]["litert-xnnpack"] < MiB, summary
    assert summary["activation_per_session_by_setting"]["litert-xnnpack"] >= 4 * MiB, summary
    assert summary["activation_per_session_by_setting"]["litert-builtin"] >= 4 * MiB, summary


def _inv(measured: int, one: int = 200 * MiB) -> ModelInventory:
    inv = ModelInventory("m.onnx", "onnx", 0, settings=["ort-disable-prepacking", "ort-default"])
    inv.measured = {"ort-default": measured, "ort-disable-prepacking": 0}
    inv.measured_one_session = {"ort-default": one, "ort-disable-prepacking": one}
    inv.default_setting = "ort-default"
    return inv


def test_a_figure_near_a_decision_line_is_measured_again_and_one_off_it_is_not():
    gate = Gate()
    assert near_a_line(_inv(MiB), gate) == ["ort-default"]  # on the threshold
    assert near_a_line(_inv(int(MiB * (1 + MARGIN * 0.9))), gate) == ["ort-default"]
    assert near_a_line(_inv(int(MiB * (1 - MARGIN * 0.9))), gate) == ["ort-default"]
    assert near_a_line(_inv(int(MiB * (1 + MARGIN * 1.2))), gate) == []
    assert near_a_line(_inv(0), gate) == []  # a shared model's 0 is far from every line
    assert near_a_line(_inv(40 * MiB), gate) == []
    # the sharing ratio's line: 4 sessions within 1.10x of one session of 30 MiB is a growth of 1 MiB
    assert near_a_line(_inv(int(1.0 * MiB), one=30 * MiB), Gate(threshold=1 << 30)) == ["ort-default"]
    assert near_a_line(_inv(4 * MiB), Gate(threshold=4 * MiB)) == ["ort-default"]  # follows --threshold


def test_a_genai_folder_s_model_is_held_to_the_session_options_its_config_gives(tmp_path):
    import genai_model as gm

    from weightshare._dispatch import inventory

    src = gm.genai_folder(tmp_path / "g", mib=0.5)
    inv = inventory(src / "model.onnx", hash_payloads=False)
    assert inv.default_setting == "ort-default" and "og.Model" in inv.default_how
    config = json.loads((src / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["config_entries"] = {"session.disable_prepacking": "1"}
    (src / "genai_config.json").write_text(json.dumps(config))
    inv = inventory(src / "model.onnx", hash_payloads=False)
    assert inv.default_setting == "ort-disable-prepacking" and "genai_config.json" in inv.default_how


@pytest.mark.slow
def test_an_original_genai_folder_fails_and_its_prepack_conversion_passes(cli, tmp_path):
    import genai_model as gm

    src = gm.genai_folder(tmp_path / "src", mib=8, int4=True)
    code, summary, findings = _check(cli, src / "model.onnx")
    assert code == 1 and summary["default_setting"] == "ort-default", findings  # og.Model packs int4 per model
    assert cli("convert", src, "-o", tmp_path / "out", "-q", "--prepack").returncode == 0
    code, _, findings = _check(cli, tmp_path / "out" / "model.onnx")
    assert code == 0, findings
