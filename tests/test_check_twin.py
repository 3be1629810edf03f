"""check does not pack a `--prepack` output's portable twin again at default options: its figure there is what the
packed model's blob holds of this runtime's packings of it, and PSS measured in the runtime agrees.

A twin at default options pre-packs every MatMul/Gemm weight per session; its packed model was made by the same
onnxruntime, on the same CPU kind, from the same graph, and stores those packings. check measured them again (two
sessions of a 456 MiB MatMul+Conv twin held 2 GiB in the measuring child; a third of a cold check's CPU); now the
record is the figure, said as such. Outside that envelope (the record made by another onnxruntime) the twin is
measured as before.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest

import weightshare

sys.path.insert(0, str(Path(__file__).parent))
import model_forms as mf  # noqa: E402

pytest.importorskip("onnxruntime")

MiB = 1 << 20


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("twin")
    src = mf.build("fp32", tmp / "src" / "mlp.onnx", 6)
    weightshare.convert(src, tmp / "out", prepack=True)
    return tmp / "out"


def _trace(monkeypatch, tmp_path) -> Path:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("WEIGHTSHARE_MEASURE_TRACE", str(trace))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return trace


def _default_pss_growth(model: Path) -> int:
    """What one more session of ``model`` at default options keeps (data PSS, 2 sessions, arena off), measured in a
    child by the runtime itself."""
    from weightshare._runtimes.memory import in_child
    from weightshare.formats.onnx.measure import MALLOC_ENV

    res = in_child("weightshare.formats.onnx.measure", "probe", [str(model), False, 2, False, False], MALLOC_ENV)
    return int(res["data_pss"][-1] - res["data_pss"][0])


@pytest.mark.slow
def test_the_twins_default_figure_is_its_packed_models_record_and_pss_agrees(packed, tmp_path, monkeypatch):
    trace = _trace(monkeypatch, tmp_path)
    twin = packed / "mlp.portable.onnx"
    report = weightshare.check([twin])
    (inv,) = report.models
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [line["share"] for line in lines] == [True], lines  # f3774c5: [True, False]: packed again, twice
    recorded = inv.measured["ort-default"]
    measured = _default_pss_growth(twin)
    # the record is the packings; the runtime's own per-session state (graph, kernels) comes on top of it
    assert recorded <= measured <= recorded + max(MiB, recorded // 10), (recorded, measured)
    copied = [f for f in report.findings if f.code == "copied-per-session"]
    assert copied and "not measured again" in copied[0].message and "(measured;" not in copied[0].message
    assert report.exit_code == 0  # a fallback's copy: a warning, as when it was measured


@pytest.mark.slow
def test_a_twin_packed_by_another_onnxruntime_is_measured(packed, tmp_path, monkeypatch):
    trace = _trace(monkeypatch, tmp_path)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda n: "1.22.1" if n == "onnxruntime" else real(n))
    report = weightshare.check([packed / "mlp.portable.onnx"])
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [line["share"] for line in lines][:2] == [True, False], lines
    (inv,) = report.models
    assert not any("not measured again" in n for n in inv.measure_notes), inv.measure_notes
