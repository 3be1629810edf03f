"""`weightshare.check` and `weightshare check` are one implementation (``_gate.run_gate``): same verdict, same
exit code, same findings on the same inputs.

Before: the API failed info-only findings with ``strict=True`` where the CLI exits 0, accepted a bogus target the
CLI refuses, and raised on the first unreadable model where the CLI reports it and checks the others. Under test:
both on a plain conversion whose only finding is a sub-threshold copy (info), a bogus target, and a batch with a
truncated model. After: the same verdict and codes from both.
"""

from __future__ import annotations

import json

import pytest
from model_forms import build

import weightshare
from weightshare.errors import UsageError

pytest.importorskip("onnxruntime")


def _same(cli, models, *flags, **api):
    res = cli("check", *models, "--json", "--no-measure", *flags)
    doc = json.loads(res.stdout)
    report = weightshare.check(models, measure=False, **api)
    assert report.exit_code == res.returncode == doc["exit_code"], (report.exit_code, res.returncode)
    assert report.ok == doc["ok"]
    assert [(f.code.value, f.severity.value, f.file) for f in report.findings] == [
        (f["code"], f["severity"], f["file"]) for f in doc["findings"]
    ]
    return report


def test_strict_fails_on_the_same_findings_in_the_api_and_the_cli(cli, tmp_path):
    src = build("fp32", tmp_path / "m.onnx", mib=0.25)  # MLAS packs 0.25 MiB per session: below the gate, info
    assert cli("convert", src, "-o", tmp_path / "out", "-q").returncode == 0
    model = str(tmp_path / "out" / "m.onnx")
    report = _same(cli, [model], "--strict", strict=True)
    assert report.findings and {f.severity.value for f in report.findings} == {"info"}, report.findings
    assert report.ok and report.exit_code == 0


def test_a_bogus_target_is_refused_by_both(cli, tmp_path):
    src = build("fp32", tmp_path / "m.onnx", mib=0.25)
    res = cli("check", src, "--target", "ort-bogus", "--no-measure")
    assert res.returncode == 2 and "ort-bogus" in res.stderr
    with pytest.raises(UsageError, match="ort-bogus"):
        weightshare.check([src], target=["ort-bogus"], measure=False)


def test_an_unreadable_model_is_one_finding_and_the_others_are_checked_by_both(cli, tmp_path):
    src = build("fp32", tmp_path / "a" / "m.onnx", mib=0.25)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(src.read_bytes()[: len(src.read_bytes()) // 2])
    report = _same(cli, [str(bad), str(src)])
    assert report.exit_code == 2 and not report.ok
    assert [f.code.value for f in report.findings if f.file == str(bad)] == ["unreadable-model"]
    assert [i.model for i in report.models] == [str(src)]


def test_an_unreadable_input_file_is_refused_by_both(cli, tmp_path):
    """check --input NAME=FILE / weightshare.check(inputs=): one parser and one reader (``_verify.load_input``),
    checked before any model is measured."""
    src = build("fp32", tmp_path / "m.onnx", mib=0.25)
    missing = tmp_path / "x.npy"
    res = cli("check", src, "--input", f"x={missing}", "--no-measure")
    assert res.returncode == 2 and "--input x: cannot read" in res.stderr, res.stderr
    with pytest.raises(UsageError, match="--input x: cannot read"):
        weightshare.check([src], inputs={"x": missing}, measure=False)
