"""One package per model format. Each exposes ``convert_file(src, out_dir, options, tx) -> ConversionReport``."""

from __future__ import annotations

from pathlib import Path

from ..errors import InvalidModel, Unsupported


def detect_format(path: Path) -> str:
    """Tell the format from the file itself, falling back to the suffix; never trust only the name."""
    if path.is_dir():
        if path.suffix == ".mlpackage" or (path / "Manifest.json").exists():
            return "coreml"
        raise InvalidModel("is a directory but not an .mlpackage (no Manifest.json)", path)
    if not path.exists():
        raise InvalidModel("no such file", path)
    if path.suffix == ".mlmodel":
        raise Unsupported(
            "NeuralNetwork .mlmodel files keep their weights inside the protobuf; convert the model to an "
            "ML Program (.mlpackage) with coremltools first", path)
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) >= 8 and head[4:8] == b"TFL3":
        return "tflite"
    if path.suffix == ".tflite":
        raise InvalidModel("not a TFLite flatbuffer (no TFL3 identifier)", path)
    if path.suffix == ".onnx" or (head[:1] and head[0] == 0x08):  # ModelProto starts with ir_version (field 1)
        return "onnx"
    raise Unsupported("unknown model format (expected .onnx, .tflite or .mlpackage)", path)


def converter(fmt: str):
    if fmt == "onnx":
        from .onnx import convert
    elif fmt == "tflite":
        from .tflite import convert
    elif fmt == "coreml":
        from .coreml import convert
    else:
        raise Unsupported(f"unknown format {fmt!r}")
    return convert.convert_file
