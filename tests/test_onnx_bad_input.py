"""Bad ONNX input: one line naming the file and the problem, exit code 2, nothing left in OUTDIR."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh
from onnx_fixtures import kitchen_sink

from weightshare.formats.onnx.wire import encode_len_field, encode_varint_field


def assert_clean_failure(res, model: Path, out: Path, *words: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr and "internal error" not in res.stderr
    assert str(model) in lines[0] or model.name in lines[0], lines[0]
    for w in words:
        assert w in lines[0], lines[0]
    assert not out.exists() or os.listdir(out) == [], os.listdir(out)


def small_model(directory: Path, tensor: onnx.TensorProto, name: str = "m.onnx") -> Path:
    graph = h.make_graph(
        [h.make_node("Add", ["x", tensor.name], ["y"])],
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, [256])],
        [h.make_tensor_value_info("y", T.FLOAT, [256])],
        [tensor],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    path = directory / name
    path.write_bytes(model.SerializeToString())
    return path


def external_tensor(location: str, length: int = 1024) -> onnx.TensorProto:
    t = onnx.TensorProto(name="w", data_type=T.FLOAT, dims=[256], data_location=T.EXTERNAL)
    for k, v in (("location", location), ("offset", "0"), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


@pytest.fixture(scope="module")
def sink_bytes(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    return kitchen_sink(d).read_bytes()


@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.3, 0.5, 0.77, 0.97])
def test_truncated_model(tmp_path, cli, sink_bytes, fraction):
    (tmp_path / "sink.data").write_bytes(b"\0" * (1 << 20))
    model = tmp_path / "sink.onnx"
    model.write_bytes(sink_bytes[: int(len(sink_bytes) * fraction)])
    out = tmp_path / "out"
    assert_clean_failure(cli("convert", model, "-o", out), model, out)


@pytest.mark.parametrize(
    "garbage",
    [b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x08\x07\x3a\x05\x0a\x03abc", b""],
)
def test_corrupt_protobuf(tmp_path, cli, garbage):
    model = tmp_path / "bad.onnx"
    model.write_bytes(garbage)
    out = tmp_path / "out"
    assert_clean_failure(cli("convert", model, "-o", out), model, out)


def test_raw_data_length_past_end_of_file(tmp_path, cli):
    # A tensor declaring 1 GB of raw_data in a 60-byte file: must fail before anything is allocated.
    tensor = (
        encode_varint_field(1, 250_000_000)
        + encode_varint_field(2, T.FLOAT)
        + encode_len_field(8, b"w")
        + b"\x4a"
        + bytes([0x80, 0x94, 0xEB, 0xDC, 0x03])
        + b"\0" * 16
    )
    graph = encode_len_field(5, tensor)
    model_bytes = encode_varint_field(1, 8) + encode_len_field(7, graph)
    model = tmp_path / "lying.onnx"
    model.write_bytes(model_bytes)
    out = tmp_path / "out"
    assert_clean_failure(cli("convert", model, "-o", out), model, out, "past the end")


def test_raw_data_length_disagrees_with_dims(tmp_path, cli):
    t = nh.from_array(np.zeros(256, np.float32), "w")
    t.raw_data = t.raw_data[:1000]
    model = small_model(tmp_path, t)
    out = tmp_path / "out"
    assert_clean_failure(cli("convert", model, "-o", out), model, out, "raw_data has 1000 bytes")


@pytest.mark.parametrize(
    "location,word",
    [
        ("/etc/passwd", "absolute"),
        ("../outside.data", ".."),
        ("sub/../../outside.data", ".."),
        ("C:\\weights.bin", "absolute"),
    ],
)
def test_external_location_outside_model_directory(tmp_path, cli, location, word):
    (tmp_path / "outside.data").write_bytes(b"\0" * 1024)
    d = tmp_path / "model"
    d.mkdir()
    model = small_model(d, external_tensor(location))
    out = tmp_path / "out"
    assert_clean_failure(cli("convert", model, "-o", out), model, out, word)


def test_external_location_through_symlink_outside(tmp_path, cli):
    (tmp_path / "outside.data").write_bytes(b"\0" * 1024)
    d = tmp_path / "model"
    d.mkdir()
    os.symlink(tmp_path / "outside.data", d / "w.data")
    model = small_model(d, external_tensor("w.data"))
    out = tmp_path / "out"
    assert_clean_failure(cli("convert", model, "-o", out), model, out, "symlink")


def test_missing_external_file(tmp_path, cli):
    model = small_model(tmp_path, external_tensor("gone.data"))
    out = tmp_path / "out"
    assert_clean_failure(cli("convert", model, "-o", out), model, out, "missing")


def test_external_range_past_end_of_data_file(tmp_path, cli):
    (tmp_path / "w.data").write_bytes(b"\0" * 100)
    model = small_model(tmp_path, external_tensor("w.data"))
    out = tmp_path / "out"
    assert_clean_failure(cli("convert", model, "-o", out), model, out, "past the end")


@pytest.mark.slow
def test_existing_outputs_survive_a_failed_conversion(tmp_path, cli):
    good = kitchen_sink(tmp_path)
    out = tmp_path / "out"
    assert cli("convert", good, "-o", out).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    good.write_bytes(good.read_bytes()[:5000])
    res = cli("convert", good, "-o", out)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_blob_name_outside_outdir_refused(tmp_path, cli):
    model = kitchen_sink(tmp_path)
    out = tmp_path / "out"
    res = cli("convert", model, "-o", out, "--blob", "../escape.safetensors")
    assert res.returncode == 2 and "must stay inside" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "escape.safetensors").exists()


def test_output_onto_input_refused(tmp_path, cli):
    model = kitchen_sink(tmp_path)
    before = model.read_bytes()
    res = cli("convert", model, "-o", tmp_path)
    assert res.returncode == 2 and "overwrite the input" in res.stderr
    assert model.read_bytes() == before


def test_not_a_model(tmp_path, cli):
    res = cli("convert", tmp_path / "nothing.onnx", "-o", tmp_path / "out")
    assert res.returncode == 2 and "no such file" in res.stderr


@pytest.mark.parametrize("content", [b"hello\n", b'{"format": "json"}\n', b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR"])
def test_a_file_of_another_kind_is_named_so(tmp_path, cli, content):
    """A text or image file named .onnx was "unsupported protobuf wire type 4 at offset 2": true, and no help."""
    model = tmp_path / "model.onnx"
    model.write_bytes(content)
    for args in (["convert", model, "-o", tmp_path / "out"], ["inspect", model]):
        res = cli(*args)
        assert_clean_failure(res, model, tmp_path / "out", "not an ONNX model")
