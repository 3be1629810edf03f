"""A format is one folder plus one registration: a toy format (tests/toyformat) goes through the same
convert / zoo / inspect / check paths as the built-in ones, and detection never guesses from the name alone."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import toyformat  # tests/toyformat, on sys.path through conftest.py
from safetensors import safe_open

import weightshare.api as api
from weightshare import formats
from weightshare._check import check
from weightshare._dispatch import inventory
from weightshare._samples import mlp_onnx
from weightshare.errors import InvalidModel, Unsupported, UsageError


@pytest.fixture
def toy():
    formats.register(toyformat.FORMAT)
    yield toyformat.FORMAT
    formats.unregister("toy")


def _toy_model(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    doc = {
        "toymodel": 1,
        "tensors": {
            n: {"dtype": a.dtype.name, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}
            for n, a in arrays.items()
        },
    }
    path.write_text(json.dumps(doc))
    return path


def test_builtin_formats_are_registered_in_detection_order():
    assert [f.name for f in formats.registered()] == ["tflite", "executorch", "coreml", "mediapipe", "onnx"]
    assert formats.model_suffixes() == (".tflite", ".pte", ".ptd", ".mlpackage", ".task", ".onnx")


def test_unknown_files_are_refused_not_guessed(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\x01\x02\x03\x04nope")
    with pytest.raises(Unsupported, match="unknown model format"):
        formats.detect(tmp_path / "x.bin")
    (tmp_path / "y.tflite").write_bytes(b"\x08\x01\x02\x03XXXX")
    with pytest.raises(InvalidModel, match="TFL3"):
        formats.detect(tmp_path / "y.tflite")


def test_toy_format_converts_inspects_and_checks_through_the_interface(toy, tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32)  # 8 KiB: moves
    b = rng.standard_normal(8).astype(np.float32)  # 32 B: stays inline
    src = _toy_model(tmp_path / "m.toymodel", {"w": w, "b": b})
    assert formats.detect(src) is toy

    before = inventory(src)
    assert [(p.name, p.location) for p in before.payloads] == [("w", "embedded"), ("b", "embedded")]
    assert before.copied_per_session == w.nbytes + b.nbytes
    _, findings = check([src])
    assert {f.code for f in findings} == {"embedded-weights"}

    report = api.convert(src, tmp_path / "out")
    assert report.format == "toy" and report.tensors_moved == 1 and report.inline_kept == 1
    out = tmp_path / "out" / "m.toymodel"
    entry = json.loads(out.read_text())["tensors"]["w"]
    blob = out.parent / entry["location"]
    raw = blob.read_bytes()[entry["offset"] : entry["offset"] + entry["length"]]
    assert raw == w.tobytes()
    with safe_open(str(blob), "np") as st:  # the shared blob is valid safetensors
        assert np.array_equal(st.get_tensor("w"), w)

    after = inventory(out)
    assert sorted((p.name, p.location) for p in after.payloads) == [("b", "embedded"), ("w", "external")]
    _, findings = check([out])
    assert findings == []


def test_toy_models_join_a_shared_blob_in_zoo_mode(toy, tmp_path):
    w = np.arange(1024, dtype=np.float32)
    a = _toy_model(tmp_path / "a.toymodel", {"w": w})
    b = _toy_model(tmp_path / "b.toymodel", {"w": w, "v": w + 1})
    zoo = api.convert_zoo([a, b], tmp_path / "zoo", "zoo.safetensors")
    assert [m.tensors_moved for m in zoo.models] == [1, 2]
    assert sum(m.deduplicated for m in zoo.models) == 1  # b's "w" is a's "w"


def test_the_toy_format_declares_an_unpack_value_of_its_own(toy, tmp_path):
    """Format.options: the toy format's `--unpack toy-f32` is accepted because it declares it; nothing else changed."""
    h = np.linspace(-2, 2, 1024, dtype=np.float16)  # 2 KiB fp16: moves, as float32
    src = _toy_model(tmp_path / "m.toymodel", {"h": h})
    report = api.convert(src, tmp_path / "out", unpack=("toy-f32",))
    assert report.unpacked == 1
    out = tmp_path / "out" / "m.toymodel"
    entry = json.loads(out.read_text())["tensors"]["h"]
    assert entry["dtype"] == "float32" and entry["length"] == 4 * h.size
    with safe_open(str(out.parent / entry["location"]), "np") as st:
        assert np.array_equal(st.get_tensor("h"), h.astype(np.float32))
    plain = api.convert(src, tmp_path / "plain")
    assert (
        plain.unpacked == 0
        and json.loads((tmp_path / "plain" / "m.toymodel").read_text())["tensors"]["h"]["dtype"] == "float16"
    )
    # another format's model is told the value is not its own, as for a built-in format's value (ONNX: a note)
    onnx_report = api.convert(mlp_onnx(tmp_path / "m.onnx", layers=1, dim=64), tmp_path / "o", unpack=("toy-f32",))
    assert any("--unpack toy-f32 is not implemented for ONNX" in n for n in onnx_report.notes)


def test_an_unpack_value_no_format_declares_is_refused_naming_those_that_do(toy, tmp_path):
    src = _toy_model(tmp_path / "m.toymodel", {"h": np.zeros(1024, np.float16)})
    with pytest.raises(UsageError) as e:
        api.convert(src, tmp_path / "out", unpack=("nope",))
    assert e.value.message == (
        "unknown --unpack value nope: no registered format declares it "
        "(tflite: 'sparse', 'dequantize'; onnx: 'ort-cpu'; toy: 'toy-f32')"
    )
    assert not (tmp_path / "out").exists()


def test_a_value_declared_by_an_unregistered_format_is_refused(tmp_path):
    src = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=64)
    with pytest.raises(UsageError, match="unknown --unpack value toy-f32: no registered format declares it"):
        api.convert(src, tmp_path / "out", unpack=("toy-f32",))
