"""The ONNX sharing claim, measured: sessions of a converted model map one copy of the weights.

Before: an fp16 MLP (4 x 1024x1024, each weight behind Cast(to=FLOAT)): every ONNX Runtime session folds the Casts
into a private fp32 copy (16 MiB per session).
Under test: 1 and 8 sessions in one fresh process, `session.disable_prepacking=1` (the README's setting).
After: 8 sessions of the converted model cost at most 1.1x the PSS of one; the original's cost grows with
each session (the measurement can tell the difference).
"""

from __future__ import annotations

import pytest

from weightshare._runtimes.ort import measure_sessions
from weightshare._samples import mlp_onnx
from weightshare.api import convert


@pytest.mark.slow
def test_eight_sessions_of_a_converted_model_cost_one(tmp_path):
    src = mlp_onnx(tmp_path / "mlp.onnx", layers=4, dim=1024)
    converted = convert(src, tmp_path / "out").outputs[0]
    orig = {r["sessions"]: r["pss_mib"] for r in measure_sessions(str(src), [1, 8], share=True)}
    conv = {r["sessions"]: r["pss_mib"] for r in measure_sessions(str(converted), [1, 8], share=True)}
    assert conv[8] <= 1.1 * conv[1], conv
    assert orig[8] - orig[1] >= 7 * 12, orig  # >= 12 MiB per extra session: the private fp32 copies
