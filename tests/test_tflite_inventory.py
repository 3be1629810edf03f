"""`inspect` / `check` for TFLite: what each interpreter copies, where every buffer lives.

Before: the sample model, its converted form and its --external form (one with a damaged blob).
Under test: ``weightshare._dispatch.inventory`` over the TFLite inventory, and ``_check.findings_for``.
After: the original reports the fp16 DEQUANTIZE copies; the converted models are share-ready; damage is found.
"""

from __future__ import annotations

import pytest
from tflite_fixtures import sample_model

import weightshare._check as check_mod
import weightshare._dispatch as inventory_mod
from weightshare.api import convert
from weightshare.options import ConvertOptions


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("inv")
    src = sample_model(d / "m.tflite", fc_out=256)
    convert(src, d / "out")
    convert(src, d / "ext", ConvertOptions(external=True))
    return src, d / "out" / "m.tflite", d / "ext" / "m.tflite"


def _codes(path, targets: tuple[str, ...] = ("litert-builtin",)) -> set[str]:
    """Error codes under ``targets`` (default: no delegate, where a converted model maps every weight)."""
    gate = check_mod.Gate(targets)
    return {f.code.value for f in check_mod.findings_for(inventory_mod.inventory(path), gate) if f.severity == "error"}


def test_original_reports_per_interpreter_dequantize(models):
    src, _, _ = models
    inv = inventory_mod.inventory(src)
    by_name = {p.name: p for p in inv.payloads}
    fc = by_name["fc_w_fp16"]
    assert fc.unpacked_at_load.startswith("DEQUANTIZE") and fc.copied_per_session == 2 * fc.nbytes and fc.would_move
    assert by_name["conv_w_fp16"].would_move  # below the inline threshold, but folded all the same
    assert by_name["offset_a"].sha256 == by_name["offset_b"].sha256 and by_name["offset_b"].duplicate_of
    assert "unpacked-per-session" in _codes(src)


def test_converted_models_are_share_ready(models):
    _, out, ext = models
    assert _codes(out) == set() and _codes(ext) == set()
    # with no target: LiteRT's default Interpreter, whose XNNPACK packs the FULLY_CONNECTED weight per interpreter
    assert "xnnpack-pack-copy-per-interpreter" in _codes(out, ())
    inv = inventory_mod.inventory(ext)
    moved = [p for p in inv.payloads if p.location == "external"]
    assert moved and all(p.sha256 == p.recorded_sha256 for p in moved)
    (blob,) = ext.parent.glob("m.weights.*.safetensors")
    assert inv.external_files == [blob.name]


def test_damaged_blob_is_a_checksum_mismatch(models, tmp_path):
    _, _, ext = models
    for f in ext.parent.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    inv = inventory_mod.inventory(tmp_path / "m.tflite")
    target = max((p for p in inv.payloads if p.location == "external"), key=lambda p: p.nbytes)
    (blob,) = tmp_path.glob("m.weights.*.safetensors")
    data = bytearray(blob.read_bytes())
    data[target.offset] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert "checksum-mismatch" in _codes(tmp_path / "m.tflite")
    blob.unlink()
    problems = [p.problem for p in inventory_mod.inventory(tmp_path / "m.tflite").payloads if p.problem]
    assert problems and all("missing" in p for p in problems)
