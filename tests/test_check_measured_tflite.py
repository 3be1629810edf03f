"""`check`'s per-interpreter figures for TFLite are LiteRT's own (XNNPACK packing per interpreter,
int8 weight-only and fp16 DEQUANTIZE included).

Before: three FULLY_CONNECTED models built with the TFLite schema (an fp32 weight, an fp16 weight behind
DEQUANTIZE, an int8 weight-only one behind DEQUANTIZE), as given and converted. Under test: `check --target
SETTING --json` for litert-builtin and litert-xnnpack (child processes running ai-edge-litert). After: the figure
is measured, within 2x of an independent measurement (1 vs 4 interpreters in a fresh process started with
MALLOC_MMAP_THRESHOLD_=1048576), and the exit code agrees with it (4 interpreters within 1.10x of one -> 0, else 1).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tflite_fixtures import OP, ModelBuilder, s

pytest.importorskip("ai_edge_litert")

MiB = 1 << 20
N, K = 2048, 1024


def fc(path, kind: str, n: int = N, k: int = K):
    """x [1, k] -> FULLY_CONNECTED(W [n, k]) -> y: W fp32, fp16 behind DEQUANTIZE, or int8 (per-channel scales)
    behind DEQUANTIZE (also scripts/bench_check.py --tflite)."""
    N, K = n, k  # noqa: N806 -- the shapes' names
    rng = np.random.default_rng(3)
    mb = ModelBuilder()
    g = mb.subgraph("main")
    x = g.input("x", [1, K])
    w32 = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
    if kind == "fp32":
        w = g.const("w", w32)
    else:
        if kind == "fp16":
            q = g.const("w_q", w32.astype(np.float16))
        else:
            scales = list((np.abs(w32).max(axis=1) / 127 + 1e-6).astype(np.float32))
            ints = np.clip(np.round(w32 / np.array(scales)[:, None]), -127, 127).astype(np.int8)
            q = g.const("w_q", ints, quant=(scales, [0] * N))
            g.tensors[q].quantization.quantizedDimension = 0
        w = g.tensor("w", [N, K], "float32")
        g.op(OP.DEQUANTIZE, [q], [w])
    y = g.tensor("y", [1, N], "float32")
    g.op(OP.FULLY_CONNECTED, [x, w, -1], [y], s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    g.outputs = [y]
    mb.signature("serving_default", g)
    return mb.save(path)


def _independent(path, share: bool) -> tuple[float, float]:
    """(PSS of 4 interpreters / PSS of 1, bytes per extra interpreter): the bench probe, in a fresh process; the
    growth is PSS without program code, put on one interpreter's whole PSS for the ratio."""
    from weightshare.formats.onnx.measure import MALLOC_ENV
    from weightshare.formats.tflite.measure import measure_interpreters

    rows = {r["sessions"]: r for r in measure_interpreters(str(path), [1, 4], share=share, env=MALLOC_ENV)}
    growth = rows[4]["data_pss_mib"] - rows[1]["data_pss_mib"]
    return (rows[1]["pss_mib"] + growth) / rows[1]["pss_mib"], growth / 3 * MiB


@pytest.mark.slow
@pytest.mark.parametrize("converted", [False, True], ids=["as-given", "converted"])
@pytest.mark.parametrize("kind", ["fp32", "fp16", "int8"])
def test_check_agrees_with_measured_litert_interpreters(cli, tmp_path, kind, converted):
    model = fc(tmp_path / "fc.tflite", kind)
    if converted:
        assert cli("convert", model, "-o", tmp_path / "out", "-q").returncode == 0
        model = tmp_path / "out" / "fc.tflite"
    seen = {}
    for setting, share in (("litert-builtin", True), ("litert-xnnpack", False)):
        res = cli("check", model, "--target", setting, "--json")
        doc = json.loads(res.stdout)
        (summary,) = doc["reports"]
        assert summary["copies_source"] == "measured", res.stdout
        figure = summary["copied_per_session_by_setting"][setting]
        ratio, per = _independent(model, share)
        seen[setting] = figure
        measured = [f for f in doc["findings"] if f["code"] == "copied-per-session" and setting in f["message"]]
        expected = 0 if ratio <= 1.10 else 1
        assert res.returncode == expected, (kind, converted, setting, ratio, figure, per, doc["findings"])
        assert bool(measured) == (expected == 1), doc["findings"]  # the measured finding is what fails it
        if per >= MiB or figure >= MiB:
            assert per / 2 <= figure <= 2 * per, (kind, converted, setting, figure, per)
    # XNNPACK packs the fp32 weight (N x K x 4 bytes) in every interpreter, whatever the stored type
    assert seen["litert-xnnpack"] >= N * K * 2, seen


def test_without_measuring_tflite_figures_are_the_static_estimate(cli, tmp_path):
    model = fc(tmp_path / "fc.tflite", "fp32")
    res = cli("check", model, "--json", "--target", "litert-xnnpack", env={"WEIGHTSHARE_NO_MEASURE": "1"})
    (summary,) = json.loads(res.stdout)["reports"]
    assert summary["copies_source"] == "static"
    assert summary["copied_per_session_by_setting"]["litert-xnnpack"] == N * K * 4
    assert res.returncode == 1  # the static XNNPACK rule still gates a targeted setting
