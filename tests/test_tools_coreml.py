"""inspect, check and verify on Core ML packages, through the CLI as a CI job would run them.

Before: packages written by coremltools (its weight.bin puts each payload 64 bytes after its record, so a payload
of 1 MiB or more is not 64 KiB aligned), some damaged on purpose.
Under test: `weightshare inspect/check/verify` (child processes) and, for the finer cases, the same API in-process.
After: check exits 1 with the right finding codes before `convert` and 0 after; verify passes on a conversion and
fails on one flipped weight byte or a changed op; every --json output parses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import coreml_fixtures as F
import pytest

from weightshare import api
from weightshare._check import check
from weightshare._dispatch import inventory, verify
from weightshare.formats.coreml.milblob import WeightFile

WEIGHTS = "Data/com.apple.CoreML/weights/weight.bin"
MODEL = "Data/com.apple.CoreML/model.mlmodel"


@pytest.fixture(scope="module")
def pkgs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools_coreml")
    big = F.mlp(d / "big.mlpackage", "iOS16", hidden=1024)  # first weight: 1024 x 512 fp16 = 1 MiB
    lut = F.compressed(d / "lut.mlpackage", "lut2-16")
    return d, big, lut


@pytest.fixture(scope="module")
def converted(pkgs, tmp_path_factory):
    from conftest import run_cli

    _, big, _ = pkgs
    out = tmp_path_factory.mktemp("tools_coreml_out")
    res = run_cli("convert", big, "-o", out)
    assert res.returncode == 0, res.stderr
    return out / big.name


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_inspect_json(pkgs, cli):
    _, big, lut = pkgs
    res = cli("inspect", big, "--json")
    assert res.returncode == 0, res.stderr
    (inv,) = json.loads(res.stdout)["reports"]
    assert inv["format"] == "coreml" and inv["copied_per_session"] == 0 and inv["embedded_bytes"] == 0
    assert len(inv["payloads"]) == 4  # two linear weights, two biases
    for p in inv["payloads"]:
        assert p["location"] == "external" and p["file"] == WEIGHTS and p["encoding"] == "raw"
        assert p["dtype"] == "float16" and len(p["digest"]) == len("blake3:") + 64 and not p["problem"]
        assert p["offset"] % 64 == 0 and p["alignment"] >= 64
    first = max(inv["payloads"], key=lambda p: p["nbytes"])
    assert first["nbytes"] == 1 << 20 and first["shape"] == [1024, 512]
    assert first["alignment"] < 64 << 10 and first["would_move"]  # coremltools' layout: record + 64
    assert any("save_multifunction" in n for n in inv["notes"])

    res = cli("inspect", lut, "--json")
    encodings = {p["encoding"] for p in json.loads(res.stdout)["reports"][0]["payloads"]}
    assert encodings == {"raw", "palettized indices"}


@pytest.mark.slow
def test_check_fails_before_convert_and_passes_after(pkgs, converted, cli):
    _, big, _ = pkgs
    res = cli("check", big, "--json")
    assert res.returncode == 1, res.stderr
    report = json.loads(res.stdout)
    assert report["ok"] is False
    assert [(f["code"], f["model"]) for f in report["findings"]] == [("unaligned", str(big))]
    assert "linear_0_weight_0_to_fp16" in report["findings"][0]["message"]

    res = cli("check", converted, "--json")
    assert res.returncode == 0, res.stdout
    doc = json.loads(res.stdout)
    assert doc["ok"] is True and [m["model"] for m in doc["reports"]] == [str(converted)] and doc["findings"] == []
    inv = inventory(converted)
    assert all(not p.would_move for p in inv.payloads)
    assert min(p.alignment for p in inv.payloads if p.nbytes >= 1 << 20) >= 64 << 10


@pytest.mark.slow
def test_check_duplicate_payloads(tmp_path, cli):
    """Two records holding the same bytes: `check` flags them; `convert` stores them once and then passes."""
    src = F.nested(tmp_path / "dup.mlpackage")  # wa and wb: two 64 x 64 fp32 weights in two records
    wf = WeightFile(src / WEIGHTS)
    values = F.blob_values(F.load_spec(src))
    recs = [wf.record(v.offset) for v in values]
    a, b = [r for r in recs if r.nbytes == 64 * 64 * 4][:2]
    data = bytearray((src / WEIGHTS).read_bytes())
    data[b.data_offset : b.data_offset + b.nbytes] = data[a.data_offset : a.data_offset + a.nbytes]
    (src / WEIGHTS).write_bytes(bytes(data))

    res = cli("check", src, "--json")  # 16 KiB mapped twice: below the 1 MiB threshold, a warning
    assert res.returncode == 0
    assert [(f["code"], f["severity"]) for f in json.loads(res.stdout)["findings"]] == [
        ("duplicate-payloads", "warning")
    ]
    res = cli("check", src, "--json", "--threshold", "0")
    assert res.returncode == 1 and [f["code"] for f in json.loads(res.stdout)["findings"]] == ["duplicate-payloads"]
    dup = [p for p in inventory(src).payloads if p.duplicate_of and p.nbytes == b.nbytes]
    assert len(dup) == 1 and dup[0].would_move  # (coremltools itself stores the two 256-byte zero biases twice)

    api.convert(src, tmp_path / "out")
    out = tmp_path / "out" / src.name
    _, findings = check([out])
    assert findings == []
    assert verify(src, out).passed


@pytest.mark.slow
def test_verify_passes_then_fails_on_a_flipped_weight_byte(pkgs, converted, cli, tmp_path):
    _, big, _ = pkgs
    res = cli("verify", big, converted, "--json")
    (report,) = json.loads(res.stdout)["reports"]
    assert res.returncode == 0 and report["passed"], report
    assert report["runs"] == 0 and report["format"] == "coreml"
    assert any("Core ML cannot run on Linux" in n for n in report["notes"])
    assert any(n.startswith("4 Core ML weights decoded") for n in report["notes"])

    damaged = _copy(converted, tmp_path / "damaged.mlpackage")
    biggest = max(inventory(damaged).payloads, key=lambda p: p.nbytes)
    with open(damaged / WEIGHTS, "r+b") as f:
        f.seek(biggest.offset + 1000)
        byte = f.read(1)
        f.seek(biggest.offset + 1000)
        f.write(bytes([byte[0] ^ 0x01]))
    res = cli("verify", big, damaged, "--json")
    assert res.returncode == 1, res.stdout
    (report,) = json.loads(res.stdout)["reports"]
    assert report["passed"] is False
    assert len(report["mismatches"]) == 1 and biggest.name in report["mismatches"][0]
    assert "decoded values differ" in report["mismatches"][0]


@pytest.mark.covers("coreml", "verify")
def test_verify_reports_a_changed_op(pkgs, converted, tmp_path):
    _, big, _ = pkgs
    changed = _copy(converted, tmp_path / "changed.mlpackage")
    spec = F.load_spec(changed)
    block = spec.mlProgram.functions["main"].block_specializations["CoreML6"]
    relu = next(op for op in block.operations if op.type == "relu")
    relu.type = "sigmoid"
    (changed / MODEL).write_bytes(spec.SerializeToString())
    report = verify(big, changed)
    assert report.mismatches == ["function 'main' block 'CoreML6' op 5 (relu relu_0_cast_fp16): type differs"]


@pytest.mark.parametrize(
    "case, code",
    [
        ("outside", "blob-outside-model-dir"),
        ("absolute", "blob-outside-model-dir"),
        ("missing", "missing-external-file"),
        ("sentinel", "bad-external-data"),
        ("offset", "bad-external-data"),
    ],
)
def test_broken_references_are_findings(pkgs, tmp_path, case, code):
    """A broken blob reference is reported by inspect/check, not raised: the rest of the package is still listed."""
    _, big, _ = pkgs
    pkg = _copy(big, tmp_path / "broken.mlpackage")
    spec = F.load_spec(pkg)
    bfv = F.blob_values(spec)[0]
    if case == "outside":
        bfv.fileName = "@model_path/../../../secret.bin"
    elif case == "absolute":
        bfv.fileName = "/etc/passwd"
    elif case == "offset":
        bfv.offset = 1 << 40
    elif case == "missing":
        (pkg / WEIGHTS).unlink()
    else:
        with open(pkg / WEIGHTS, "r+b") as f:
            f.seek(bfv.offset)
            f.write(b"\0\0\0\0")
    (pkg / MODEL).write_bytes(spec.SerializeToString())
    inv = inventory(pkg)
    assert len(inv.payloads) == 4 and inv.payloads[0].problem
    if case in ("missing", "sentinel", "offset"):
        assert inv.payloads[0].file == WEIGHTS and inv.payloads[0].offset is None
    _, findings = check([pkg])
    assert [f.code for f in findings if f.code != "unaligned"] == [code]


def test_check_private_weight_file(converted, tmp_path):
    """weight.bin with mode 0600: other users' processes cannot map it (file names are relative to the package)."""
    pkg = _copy(converted, tmp_path / "private.mlpackage")
    (pkg / WEIGHTS).chmod(0o600)
    _, findings = check([pkg])
    assert [(f.code, f.message.split(" has mode")[0]) for f in findings] == [("blob-not-world-readable", WEIGHTS)]
