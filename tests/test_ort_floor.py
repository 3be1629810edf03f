"""The supported onnxruntime range, from its floor: .ci/run runs this file again (``-m floor``) in a second venv with
the oldest onnxruntime pyproject allows, so the floor is one that is tested. Loader, check, verify and convert on a
plain and a ``--prepack`` output, exact against the original under the runtime that runs them."""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import run_cli
from prepack_samples import mixed_onnx, sample_input

import weightshare.ort as wort
from weightshare.formats.onnx.ort.opened import ORT_FLOOR

pytestmark = pytest.mark.floor
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return mixed_onnx(tmp_path_factory.mktemp("floor") / "mixed.onnx", conv_layers=1, channels=16, mm_layers=2, dim=128)


def _convert(src: Path, out: Path, *extra: str) -> dict:
    res = run_cli("convert", src, "-o", out, "--json", "-q", *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["reports"][0]


def _original(src: Path, level: str = "ORT_ENABLE_ALL", **config: str) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    for k, v in config.items():
        so.add_session_config_entry(k, v)
    return ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])


def _equal(a: ort.InferenceSession, b: ort.InferenceSession, src: Path) -> bool:
    return all(
        all(np.array_equal(x, y) for x, y in zip(a.run(None, f), b.run(None, f)))
        for f in (sample_input(src, 1), sample_input(src, 4))
    )


def test_pyproject_declares_the_floor_the_loader_holds():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    floor = ".".join(map(str, ORT_FLOOR))
    assert f"onnxruntime>={floor}" in meta["runtimes"] and f"onnxruntime>={floor}" in meta["test"]
    here = tuple(int(p) for p in ort.__version__.split(".")[:2])
    assert here >= ORT_FLOOR, f"onnxruntime {ort.__version__} is below the declared floor {floor}"


@pytest.mark.slow
def test_a_plain_conversion_loads_checks_and_verifies(src, tmp_path):
    out = Path(_convert(src, tmp_path / "plain")["outputs"][0])
    sess = wort.session(out)  # the loader gives ORT the model's bytes: what 1.17-1.20 failed on
    # the settings the loader picks for a plain conversion with a Conv: no NCHWc copy, nothing pre-packed
    assert _equal(sess, _original(src, "ORT_ENABLE_EXTENDED", **{"session.disable_prepacking": "1"}), src)
    res = run_cli("check", out, "--no-measure")
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_cli("verify", src, out)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_a_prepack_conversion_packs_loads_checks_and_verifies(src, tmp_path, caplog, monkeypatch):
    report = _convert(src, tmp_path / "pp", "--prepack")
    assert report["prepack"]["packed_buffers"] > 0  # 1.17-1.20 "converted" and packed nothing
    out = Path(report["outputs"][0])
    monkeypatch.setattr(wort, "_warned", set())
    with caplog.at_level(logging.INFO, logger="weightshare.ort"):
        sess = wort.session(out)
    assert "prepacked graph" in caplog.records[0].getMessage()
    assert _equal(sess, _original(src), src)
    res = run_cli("check", out, "--no-measure", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["reports"][0]["judged_for"].startswith(f"judged for onnxruntime {ort.__version__}")
    res = run_cli("verify", src, out)
    assert res.returncode == 0, res.stdout + res.stderr
