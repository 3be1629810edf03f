"""Input files are opened once and read through the kept fd (TOCTOU on external data).

The swap happens at a deterministic point: right after the path check (``resolve_inside``) returns, the test
replaces the checked file (or a directory on its way) with a symlink to a file outside the model directory.
Whatever the outcome, the outside file's bytes must never reach an output.
"""

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import weightshare
from weightshare._tensors import FileRange, open_input
from weightshare.errors import InvalidModel, UnsafePath
from weightshare.formats.onnx import scan
from weightshare.formats.tflite import convert as tflite_convert

SECRET = np.full(4096, 1234.5, np.float32)  # 16 KiB outside the model directory


def _external_model(model_dir: Path, location: str, n: int = 4096) -> Path:
    """One fp32 initializer of ``n`` values (16 KiB) stored in ``location`` (relative to the model directory)."""
    w = np.arange(n, dtype=np.float32)
    (model_dir / location).parent.mkdir(parents=True, exist_ok=True)
    (model_dir / location).write_bytes(w.tobytes())
    t = nh.from_array(w, "w")
    t.ClearField("raw_data")
    t.data_location = T.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(w.nbytes))):
        e = t.external_data.add()
        e.key, e.value = k, v
    graph = h.make_graph(
        [h.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, [n])],
        [h.make_tensor_value_info("y", T.FLOAT, [n])],
        [t],
    )
    path = model_dir / "m.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))
    return path


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / "w.data").write_bytes(SECRET.tobytes())
    (outside / "secret.bin").write_bytes(SECRET.tobytes())
    return outside


def _swap_after_check(monkeypatch, module, swap):
    real = module.resolve_inside
    calls = []

    def checked_then_swapped(*args, **kwargs):
        target = real(*args, **kwargs)
        calls.append(target)
        swap(target)
        return target

    monkeypatch.setattr(module, "resolve_inside", checked_then_swapped)
    return calls


def _no_secret_written(out: Path) -> None:
    needle = SECRET.tobytes()[:64]
    for p in out.rglob("*") if out.exists() else []:
        if p.is_file():
            assert needle not in p.read_bytes(), p


def test_onnx_external_file_swapped_for_a_symlink_is_refused(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    model = _external_model(tmp_path / "model", "w.data")
    secret = _outside(tmp_path) / "secret.bin"

    def swap(target):
        target.unlink()
        target.symlink_to(secret)

    calls = _swap_after_check(monkeypatch, scan, swap)
    with pytest.raises(UnsafePath, match="symlink"):
        weightshare.convert(model, tmp_path / "out")
    assert calls  # the swap really happened between check and open
    _no_secret_written(tmp_path / "out")


def test_onnx_external_directory_swapped_for_a_symlink_is_refused(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    model = _external_model(tmp_path / "model", "sub/w.data")
    outside = _outside(tmp_path)

    def swap(target):
        target.parent.rename(target.parent.with_name("sub.moved"))
        target.parent.symlink_to(outside, target_is_directory=True)

    calls = _swap_after_check(monkeypatch, scan, swap)
    with pytest.raises(UnsafePath, match="outside the model directory"):
        weightshare.convert(model, tmp_path / "out")
    assert calls
    _no_secret_written(tmp_path / "out")


def test_onnx_external_file_replaced_after_open_is_read_through_the_kept_fd(tmp_path, monkeypatch):
    # Once opened, the file that passed the checks is the one copied, whatever the name points at later.
    (tmp_path / "model").mkdir()
    model = _external_model(tmp_path / "model", "w.data")
    secret = _outside(tmp_path) / "secret.bin"
    real_open = scan.open_input

    def open_then_replace(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        if Path(path).name == "w.data":  # not the model file itself
            os.unlink(path)
            os.symlink(secret, path)
        return f

    monkeypatch.setattr(scan, "open_input", open_then_replace)
    report = weightshare.convert(model, tmp_path / "out")
    blob = next(Path(p) for p in report.outputs if not p.endswith(".onnx"))
    assert np.arange(4096, dtype=np.float32).tobytes() in blob.read_bytes()
    _no_secret_written(tmp_path / "out")


def test_tflite_external_group_swapped_for_a_symlink_is_refused(tmp_path, monkeypatch):
    from test_tflite_bad_input import _external_model as tflite_external_model

    (tmp_path / "model").mkdir()
    model = tflite_external_model(tmp_path / "model", "w.bin")
    secret = _outside(tmp_path) / "secret.bin"

    def swap(target):
        target.unlink()
        target.symlink_to(secret)

    calls = _swap_after_check(monkeypatch, tflite_convert, swap)
    with pytest.raises(UnsafePath, match="symlink"):
        weightshare.convert(model, tmp_path / "out")
    assert calls
    _no_secret_written(tmp_path / "out")


def test_fifo_as_external_data_is_refused_without_blocking(tmp_path, cli):
    (tmp_path / "model").mkdir()
    model = _external_model(tmp_path / "model", "w.data")
    (tmp_path / "model" / "w.data").unlink()
    os.mkfifo(tmp_path / "model" / "w.data")
    r = cli("convert", model, "-o", tmp_path / "out")  # a blocking open would hang here, not fail
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a regular file" in lines[0] and "m.onnx" in lines[0], r.stderr


def test_open_input_refuses_what_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "real").write_bytes(b"x" * 10)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for name in ("fifo", "dir"):
        with pytest.raises(InvalidModel, match="not a regular file"):
            open_input(tmp_path / name)
    with pytest.raises(UnsafePath, match="symlink"):
        open_input(tmp_path / "link", tmp_path)
    assert open_input(tmp_path / "link").size == 10  # a path the user named may be a symlink
    sub = tmp_path / "sub"
    sub.mkdir()
    with pytest.raises(UnsafePath, match="outside"):
        open_input(tmp_path / "real", sub)


def test_file_range_reads_through_the_kept_fd_after_the_name_is_gone(tmp_path):
    (tmp_path / "f").write_bytes(bytes(range(256)) * 100)
    f = open_input(tmp_path / "f", tmp_path)
    (tmp_path / "f").unlink()
    got = b"".join(bytes(c) for c in FileRange(str(tmp_path / "f"), 10, 20000, f).chunks(4096))
    assert got == (bytes(range(256)) * 100)[10:20010]
    f.close()


@pytest.mark.parametrize("n", [4096, 400_000])  # small: one pread; >= 1 MiB: copy_file_range + hashing thread
def test_external_file_truncated_after_the_check_fails_cleanly(tmp_path, monkeypatch, n):
    (tmp_path / "model").mkdir()
    model = _external_model(tmp_path / "model", "w.data", n)
    real_open = scan.open_input

    def open_then_truncate(path, *args, **kwargs):
        f = real_open(path, *args, **kwargs)
        if Path(path).name == "w.data":
            os.truncate(path, 1000)
        return f

    monkeypatch.setattr(scan, "open_input", open_then_truncate)
    with pytest.raises(InvalidModel, match="ended early"):
        weightshare.convert(model, tmp_path / "out")
    out = tmp_path / "out"  # created by this run, so removed again on failure
    assert not out.exists() or not any(p.suffix in (".onnx", ".safetensors") for p in out.iterdir())


# Builds a small Core ML package with coremltools: about 1.5 s.
def test_coreml_weight_file_swapped_for_a_symlink_is_refused(tmp_path, monkeypatch):
    import shutil

    import coreml_fixtures

    from weightshare.formats.coreml import convert as coreml_convert

    pkg = coreml_fixtures.mlp(tmp_path / "m.mlpackage", "iOS16", hidden=256)
    outside = tmp_path / "outside.bin"
    shutil.copy(pkg / "Data/com.apple.CoreML/weights/weight.bin", outside)

    def swap(target):
        if not target.is_symlink():
            target.unlink()
            target.symlink_to(outside)

    real = coreml_convert.resolve_blob_file
    calls = []

    def checked_then_swapped(*args, **kwargs):
        target = real(*args, **kwargs)
        calls.append(target)
        swap(target)
        return target

    monkeypatch.setattr(coreml_convert, "resolve_blob_file", checked_then_swapped)
    with pytest.raises(UnsafePath, match="symlink"):
        weightshare.convert(pkg, tmp_path / "out")
    assert calls
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
