"""check and verify on TFLite models through the CLI."""

from __future__ import annotations

import json

import pytest
from tflite_fixtures import sample_model

from weightshare._dispatch import inventory


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tt")
    return sample_model(d / "m.tflite", fc_out=256)


@pytest.mark.covers("tflite", "check")
def test_check_measures_the_dequantize_copy_one_more_interpreter_keeps(cli, tmp_path):
    """The fast tier's measured TFLite check (the test below goes on to convert and check the output, slowly): 4 MiB
    of fp32 DEQUANTIZE output per interpreter, measured by LiteRT in its child, fails the gate without delegate."""
    model = sample_model(tmp_path / "m.tflite", fc_out=1024)
    res = cli("check", model, "--json", "--target", "litert-builtin")
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    (summary,) = doc["reports"]
    assert summary["copies_source_by_setting"]["litert-builtin"] == "measured", summary
    assert summary["copied_per_session_by_setting"]["litert-builtin"] >= 3 << 20, summary  # of 4 MiB
    errors = [f["message"] for f in doc["findings"] if f["code"] == "copied-per-session" and f["severity"] == "error"]
    assert any("under litert-builtin" in m and "(measured" in m for m in errors), doc["findings"]


@pytest.mark.slow
def test_check_fails_on_fp16_tflite_and_passes_after_convert(cli, tmp_path):
    # 4 MiB of fp32 DEQUANTIZE output per interpreter: clear of the 1.10x sharing line (1 MiB of it is on it)
    (tmp_path / "src").mkdir()
    model = sample_model(tmp_path / "src" / "m.tflite", fc_out=1024)
    res = cli("check", model, "--json", "--target", "litert-builtin")  # without delegate DEQUANTIZE copies
    assert res.returncode == 1
    assert "unpacked-per-session" in {f["code"] for f in json.loads(res.stdout)["findings"]}
    assert cli("convert", model, "-o", tmp_path).returncode == 0
    res = cli("check", tmp_path / "m.tflite", "--target", "litert-builtin")
    assert res.returncode == 0, res.stdout
    # with no target: LiteRT's default Interpreter, whose XNNPACK packs 1 MiB of weights per interpreter
    (summary,) = json.loads(cli("check", tmp_path / "m.tflite", "--json").stdout)["reports"]
    assert summary["default_setting"] == "litert-xnnpack"
    assert summary["copied_per_session_by_setting"]["litert-xnnpack"] >= 1 << 20, summary


@pytest.mark.slow
def test_verify_every_signature_then_a_flipped_weight(model, cli, tmp_path):
    assert cli("convert", model, "-o", tmp_path).returncode == 0
    out = tmp_path / "m.tflite"
    res = cli("verify", model, out, "--json", "--runs", "2")
    (report,) = json.loads(res.stdout)["reports"]
    assert res.returncode == 0 and report["passed"], report
    assert report["outputs_compared"] >= 4  # two signatures, two runs
    biggest = max((p for p in inventory(out).payloads if p.location == "external"), key=lambda p: p.nbytes)
    data = bytearray(out.read_bytes())
    data[biggest.offset + 8] ^= 0x40
    out.write_bytes(bytes(data))
    res = cli("verify", model, out, "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["reports"][0]["mismatches"]


@pytest.mark.slow
def test_inspect_tflite(model, cli):
    res = cli("inspect", model, "--json")
    assert res.returncode == 0
    (inv,) = json.loads(res.stdout)["reports"]
    assert inv["format"] == "tflite" and inv["copied_per_session"] > 0
