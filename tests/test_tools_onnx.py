"""inspect, check, verify and bench on ONNX models, through the CLI as a CI job would run them."""

from __future__ import annotations

import json
import os

import pytest

from weightshare._safetensors import read_safetensors_metadata
from weightshare._samples import mlp_onnx


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    # 4 MiB of fp16: the plain output's default-options copy (B pre-packed as fp32, 8 MiB per session) sits far
    # above both of check's lines (1 MiB; 4 sessions at 1.10x one, ~2.7 MiB), not on them, whatever else maps
    # onnxruntime's libraries (their PSS is in one session's figure)
    fp16 = mlp_onnx(d / "mlp.onnx", layers=2, dim=1024, weights="float16")
    return d, fp16


@pytest.mark.covers("onnx", "check")
def test_check_measures_the_copy_one_more_session_keeps(models, cli):
    """The fast tier's measured ONNX check (the test below goes on to convert and check the output, slowly): the
    fp16 weights' Cast output, measured by onnxruntime in its child, fails the gate under the sharing setting."""
    _, fp16 = models
    res = cli("check", fp16, "--json", "--target", "ort-disable-prepacking")
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    (summary,) = doc["reports"]
    assert summary["copies_source_by_setting"]["ort-disable-prepacking"] == "measured", summary
    measured = [f["message"] for f in doc["findings"] if f["code"] == "copied-per-session" and f["severity"] == "error"]
    assert any("under ort-disable-prepacking" in m and "(measured" in m for m in measured), doc["findings"]


@pytest.mark.slow
def test_check_fails_on_fp16_model_and_passes_after_convert(models, cli):
    d, fp16 = models
    res = cli("check", fp16, "--json", "--target", "ort-disable-prepacking")
    assert res.returncode == 1, res.stderr
    report = json.loads(res.stdout)
    errors = {f["code"] for f in report["findings"] if f["severity"] == "error"}
    assert errors == {"copied-per-session"}  # measured by onnxruntime, under the sharing setting
    measured = [f["message"] for f in report["findings"] if f["code"] == "copied-per-session"]
    assert any("under ort-disable-prepacking" in m for m in measured), measured
    # the static rules say where the bytes go, as info: the measured figure decides
    infos = {f["code"] for f in report["findings"] if f["severity"] == "info"}
    static = {"embedded-weights", "unpacked-per-session", "ort-prepack-copy-per-session"}
    # activations and the runtime's own per-session state are their own figures, never copies
    assert static <= infos <= static | {"activation-per-session", "ort-session-state"}
    res = cli(
        "check", fp16, "--json", "--no-measure", "--target", "ort-disable-prepacking"
    )  # the static estimate alone
    errors = {f["code"] for f in json.loads(res.stdout)["findings"] if f["severity"] == "error"}
    assert res.returncode == 1 and errors == {"embedded-weights", "unpacked-per-session"}
    assert cli("convert", fp16, "-o", d / "out").returncode == 0
    res = cli("check", d / "out" / "mlp.onnx", "--target", "ort-disable-prepacking")
    assert res.returncode == 0 and res.stdout.splitlines()[-1].startswith("ok:"), res.stdout
    # the default-options copy remains: a warning when sharing is targeted, an error at ORT's defaults (no options)
    assert cli("check", d / "out" / "mlp.onnx", "--strict", "--target", "ort-disable-prepacking").returncode == 1
    assert cli("check", d / "out" / "mlp.onnx").returncode == 1
    res = cli("check", d / "out", "--json", "--target", "ort-disable-prepacking")  # a directory works too
    assert res.returncode == 0 and json.loads(res.stdout)["ok"] is True


@pytest.mark.slow
def test_check_reads_the_recorded_alignment_and_fails_on_private_mode(models, cli, tmp_path):
    _, fp16 = models
    for align in ("64", "4096"):  # the blob records the policy it was written with: what --align asked for
        out = tmp_path / f"align{align}"
        assert cli("convert", fp16, "-o", out, "--align", align).returncode == 0
        res = cli("check", "--target", "ort-disable-prepacking", out / "mlp.onnx", "--json")
        assert res.returncode == 0 and "unaligned" not in _codes(res), res.stdout
    blob = next(out.glob("mlp.weights.*.safetensors"))
    os.chmod(blob, 0o600)
    res = cli("check", "--target", "ort-disable-prepacking", out / "mlp.onnx", "--json")
    codes = {f["code"] for f in json.loads(res.stdout)["findings"] if f["severity"] == "error"}
    assert res.returncode == 1 and codes == {"blob-not-world-readable"}


@pytest.mark.slow
def test_unaligned_external_data_from_elsewhere_is_a_warning(models, cli, tmp_path):
    """An external data file weightshare did not write: held to 64 KiB / 64 B; ORT maps it anyway, so a warning."""
    import onnx

    _, fp16 = models
    out = tmp_path / "plain"
    assert cli("convert", fp16, "-o", out).returncode == 0
    model = onnx.load(str(out / "mlp.onnx"))  # loads the weights from the blob
    onnx.save(model, str(tmp_path / "ext.onnx"), save_as_external_data=True, location="ext.data")
    os.chmod(tmp_path / "ext.data", 0o644)  # onnx writes it 0600
    res = cli("check", "--target", "ort-disable-prepacking", tmp_path / "ext.onnx", "--json")
    found = {f["code"]: f["severity"] for f in json.loads(res.stdout)["findings"]}
    assert res.returncode == 0 and found.get("unaligned") == "warning", res.stdout
    assert cli("check", "--target", "ort-disable-prepacking", tmp_path / "ext.onnx", "--strict").returncode == 1


def _codes(res):
    return [f["code"] for f in json.loads(res.stdout)["findings"]]


@pytest.mark.slow
def test_check_reports_missing_external_file(models, cli, tmp_path):
    _, fp16 = models
    out = tmp_path / "gone"
    assert cli("convert", fp16, "-o", out).returncode == 0
    (next(out.glob("mlp.weights.*.safetensors"))).unlink()
    res = cli("check", "--target", "ort-disable-prepacking", out / "mlp.onnx", "--json")
    assert res.returncode == 1
    errors = [f for f in json.loads(res.stdout)["findings"] if f["severity"] == "error"]
    assert [f["code"] for f in errors] == ["missing-external-file"] and errors[0]["tensor"], errors


@pytest.mark.slow
def test_verify_passes_then_fails_on_a_flipped_weight_byte(models, cli, tmp_path):
    _, fp16 = models
    out = tmp_path / "v"
    assert cli("convert", fp16, "-o", out).returncode == 0
    res = cli("verify", fp16, out / "mlp.onnx", "--json", "--runs", "2")
    (report,) = json.loads(res.stdout)["reports"]
    assert res.returncode == 0 and report["passed"] and report["outputs_compared"] == 2
    assert report["payloads_hashed"] == 4
    blob = next(out.glob("mlp.weights.*.safetensors"))
    data_start, header, _ = read_safetensors_metadata(str(blob))
    w0 = data_start + header["w0_f"]["data_offsets"][0] + 1000
    with open(blob, "r+b") as f:
        f.seek(w0)
        byte = f.read(1)
        f.seek(w0)
        f.write(bytes([byte[0] ^ 0x40]))
    res = cli("verify", fp16, out / "mlp.onnx", "--json")
    (report,) = json.loads(res.stdout)["reports"]
    assert res.returncode == 1 and not report["passed"]
    assert report["checksum_mismatches"] and report["mismatches"]
    assert cli("check", "--target", "ort-disable-prepacking", out / "mlp.onnx").returncode == 1


@pytest.mark.slow
def test_inspect_json_describes_every_payload(models, cli):
    _, fp16 = models
    res = cli("inspect", fp16, "--json")
    assert res.returncode == 0
    (inv,) = json.loads(res.stdout)["reports"]
    assert len(inv["payloads"]) == 4
    w0 = next(p for p in inv["payloads"] if p["name"] == "w0")
    assert w0["dtype"] == "FLOAT16" and w0["location"] == "embedded" and w0["encoding"] == "raw_data"
    assert "Cast" in w0["unpacked_at_load"] and w0["would_move"]
    assert w0["copied_per_session"] == 1024 * 1024 * (2 + 4)
    assert inv["copied_per_session"] == sum(p["copied_per_session"] for p in inv["payloads"])
    assert cli("inspect", fp16).returncode == 0


@pytest.mark.slow
def test_bench_measures_original_and_converted(models, cli, tmp_path):
    _, fp16 = models
    res = cli("bench", fp16, "--sessions", "1,2", "--json")
    assert res.returncode == 0, res.stderr
    (result,) = json.loads(res.stdout)["reports"]
    seen = {(r["variant"], r["mode"], r["sessions"]) for r in result["rows"]}
    assert len(seen) == 10 and all(r["pss_mib"] > 0 for r in result["rows"])
    assert {("converted --prepack", "default", n) for n in (1, 2)} <= seen


def test_verify_dim_option_is_validated(models, cli):
    _, fp16 = models
    res = cli("verify", fp16, fp16, "--dim", "batch")
    assert res.returncode == 2 and "NAME=VALUE" in res.stderr
