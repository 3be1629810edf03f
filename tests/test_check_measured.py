"""`check`'s per-session figures are ONNX Runtime's own, on every model form.

Before: model forms the static rules got wrong (MatMulNBits int4/int8, QDQ, DynamicQuantizeMatMul, Attention, fp16
ops and fp16 weights behind Cast, a merged decoder's MatMuls inside `If`, a Conv net, fp32 MatMuls), converted
plain and with --prepack. Under test: `check --target ort-default --json` (child
processes). After: its exit code agrees with sharing measured independently (4 sessions within 1.10x of one ->
0, else 1), and its bytes per session are within 2x of that measurement's per-session PSS cost.
"""

from __future__ import annotations

import json

import pytest
from model_forms import build

ort = pytest.importorskip("onnxruntime")

MiB = 1 << 20


def _independent(path) -> tuple[float, float]:
    """(PSS of 4 sessions / PSS of 1, bytes per extra session), in a fresh process started with
    MALLOC_MMAP_THRESHOLD_=1048576: the bench's own probe, with ORT's CPU arena off, so that what a session keeps
    is its weights and their copies (check's figure; activations are its own figure). The growth is that of PSS
    without program code (shared libraries' PSS moves with every other process on the machine); the ratio puts it
    on one session's whole PSS."""
    from weightshare._runtimes.ort import measure_sessions
    from weightshare.formats.onnx.measure import MALLOC_ENV

    rows = {r["sessions"]: r for r in measure_sessions(str(path), [1, 4], share=False, env=MALLOC_ENV, arena=False)}
    growth = rows[4]["data_pss_mib"] - rows[1]["data_pss_mib"]
    return (rows[1]["pss_mib"] + growth) / rows[1]["pss_mib"], growth / 3 * MiB


def _state(findings: list[dict], setting: str) -> float:
    """Bytes of ORT's own state one more session under ``setting`` keeps, as check's ``ort-session-state`` says."""
    import re

    for f in findings:
        m = re.search(r"under (\S+) keeps .*?: ([0-9.]+) MiB of it is ONNX Runtime's own state", f["message"])
        if f["code"] == "ort-session-state" and m and m.group(1) == setting:
            return float(m.group(2)) * MiB
    return 0.0


# fp32, int4 MatMulNBits, a merged decoder and a Conv net; then int8 MatMulNBits, QDQ, DynamicQuantizeMatMul,
# com.microsoft Attention, an fp16 BERT-like encoder, fp16 weights behind Cast and a llama-like decoder as
# exporters leave it (unfused RMSNorm, rotary, SiLU MLP): plain and --prepack;
# the fp16 llama-like decoder plain and with --prepack --unpack ort-cpu.
PREPACK = ("--prepack",)
FORMS = (
    [("fp32", ()), ("fp32", PREPACK), ("matmulnbits4", ()), ("merged_decoder", ()), ("conv", ())]
    + [
        (form, flags)
        for form in ("matmulnbits8", "qdq", "dynamic", "attention", "fp16", "fp16_cast", "llama")
        for flags in ((), PREPACK)
    ]
    + [("llama_fp16", ()), ("llama_fp16", (*PREPACK, "--unpack", "ort-cpu"))]
)


@pytest.mark.slow
@pytest.mark.parametrize("form, flags", FORMS, ids=[f"{f}{''.join(x)}" for f, x in FORMS])
def test_check_agrees_with_measured_sharing_at_ort_defaults(cli, tmp_path, form, flags):
    # A --prepack output's remaining per-session cost is the runtime's own state (arena, per-thread heaps: 0.3 to
    # 1.6 MiB between runs of a 4 MiB Attention model on a shared machine), which at 4 MiB sits on the 1.10x line;
    # at 12 MiB of weights it is well below it, as at serving sizes. Attention's state is the largest (1.4-1.8 MiB
    # per session measured at 12 MiB, a ratio of 1.10 in one CI run; 0.3 MiB at 100 MiB): 32 MiB for it.
    prepack = "--prepack" in flags
    # The fp16 llama-like decoder's sessions keep ~3 MiB of ORT's own state each (its graph, not weights: a
    # twin with 3.6x the weights keeps the same): at 12 MiB that put 4 sessions at 1.13x one, at 48 MiB well below.
    big = {"attention": 32, "llama_fp16": 48}
    src = build(form, tmp_path / "m.onnx", mib=big.get(form, 12) if prepack else 4)
    out = tmp_path / "out"
    assert cli("convert", src, "-o", out, "-q", *flags).returncode == 0
    model = out / "m.onnx"
    res = cli("check", model, "--target", "ort-default", "--json")
    doc = json.loads(res.stdout)
    (summary,) = [m for m in doc["reports"] if m["model"] == str(model)]
    assert summary["copies_source"] == "measured", res.stdout
    figure = summary["copied_per_session_by_setting"]["ort-default"]
    ratio, per_session = _independent(model)
    # ORT's own per-session state (graph, kernels: ``ort-session-state``) is not counted as weights by check: taken
    # off the independent figure too, and off its ratio
    state = _state(doc["findings"], "ort-default")
    ratio, per_session = ratio - (ratio - 1) * min(1.0, state / max(per_session, 1)), max(0.0, per_session - state)
    # check takes off what a one-node session keeps (~1 MiB of ORT state) and this probe does not, so within a
    # few percent of the line the two verdicts may differ by construction (a --prepack fp16 llama-like at 12 MiB:
    # 1.123x here, check 2.4 MiB per session and exit 0, the probe 2.6 MiB): there only the figures are compared
    if abs(ratio - 1.10) > 0.03:
        expected = 0 if ratio <= 1.10 else 1
        assert res.returncode == expected, (form, prepack, ratio, figure, per_session, doc["findings"])
    if per_session >= MiB or figure >= MiB:  # below that both are the runtime's per-session state, not weights
        # check takes off what a one-node model's session keeps (that state, up to ~1 MiB); the independent probe
        # does not: within 2x of each other, give or take that state (a --prepack llama measured 0.64 vs 1.34 MiB)
        assert per_session / 2 - MiB <= figure <= 2 * per_session + MiB, (form, prepack, figure, per_session)


@pytest.mark.slow
def test_without_measuring_check_falls_back_to_the_static_estimate_and_says_so(cli, tmp_path):
    src = build("fp32", tmp_path / "m.onnx", mib=1)
    res = cli("check", src, "--json", env={"WEIGHTSHARE_NO_MEASURE": "1"})
    (summary,) = json.loads(res.stdout)["reports"]
    assert summary["copies_source"] == "static" and summary["copied_per_session_by_setting"]["ort-default"] > 0
    assert any("per-session copies are the static estimate" in n for n in summary["measure_notes"]), summary
    text = cli("check", src, env={"WEIGHTSHARE_NO_MEASURE": "1"})
    assert "per-session copies are the static estimate" in text.stderr, text.stderr
