"""Converted outputs are pinned byte for byte: the copy/hash/IO paths may change, the bytes may not.

The SHA-256 digests were computed with the code of main at cc54cfd (before the conversion fast paths), which
recorded SHA-256 checksums: written with ``DIGEST = "sha256"`` the blob is still byte for byte today's. With the
default BLAKE3 checksums only the recorded digests in the header differ (pinned separately). The ONNX model is
pinned with its blob location replaced by a placeholder, because blob names are allowed to change.
"""

import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh
from onnx_fixtures import kitchen_sink
from tflite_fixtures import sample_model

import weightshare
import weightshare._checksum as checksum_module
import weightshare._placement as placement_module

N = 1_500_000  # 6 MiB as fp32: more than one 4 MiB chunk, so chunk boundaries are exercised


def _external(t: onnx.TensorProto, data: Path, location: str) -> onnx.TensorProto:
    with open(data, "ab") as f:
        offset = f.tell()
        f.write(t.raw_data)
    length = len(t.raw_data)
    t.ClearField("raw_data")
    t.data_location = T.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def big_model(directory: Path) -> Path:
    """fp32 raw inline, fp32 external (twice, identical: dedupe), fp16 behind Cast, odd-sized payloads."""
    data = directory / "big.data"
    data.write_bytes(b"\x01" * 4097)  # external payloads start at an odd offset
    ramp = (np.arange(N, dtype=np.float32) % 1013) / 7
    inits = [
        nh.from_array(ramp, "raw32"),
        _external(nh.from_array(ramp[::-1].copy(), "ext32"), data, "big.data"),
        _external(nh.from_array(ramp[::-1].copy(), "ext32b"), data, "big.data"),
        nh.from_array((ramp / 3).astype(np.float16), "w16"),
        nh.from_array(np.arange(1001, dtype=np.float32), "odd"),
    ]
    nodes = [
        h.make_node("Cast", ["w16"], ["w16f"], to=T.FLOAT),
        h.make_node("Add", ["x", "raw32"], ["a"]),
        h.make_node("Add", ["a", "ext32"], ["b"]),
        h.make_node("Add", ["b", "ext32b"], ["c"]),
        h.make_node("Add", ["c", "w16f"], ["y"]),
    ]
    graph = h.make_graph(
        nodes,
        "big",
        [h.make_tensor_value_info("x", T.FLOAT, [N])],
        [h.make_tensor_value_info("y", T.FLOAT, [N])],
        inits,
    )
    path = directory / "big.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))
    return path


def _onnx_digests(report) -> tuple[str, str]:
    model = next(Path(p) for p in report.outputs if p.endswith(".onnx"))
    blob = next(Path(p) for p in report.outputs if not p.endswith(".onnx"))
    m = onnx.load(str(model), load_external_data=False)
    for t in _tensors(m):
        for e in t.external_data:
            if e.key == "location":
                assert e.value == blob.name
                e.value = "BLOB"
    return hashlib.sha256(m.SerializeToString()).hexdigest(), hashlib.sha256(blob.read_bytes()).hexdigest()


def _tensors(message):
    """Every TensorProto anywhere in ``message``: initializers, sparse values, attributes, subgraphs, functions,
    training graphs (a location left out would pin the blob's name)."""
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        for item in value if field.is_repeated else [value]:
            if isinstance(item, onnx.TensorProto):
                yield item
            yield from _tensors(item)


# The kitchen sink's blob differs from cc54cfd's in the header only: Constant payloads are named by the Constant's
# output since the fold rewrite ("c32", was its tensor's name "c32v"); the data section is byte for byte cc54cfd's.
# The header's __metadata__ gained "weightshare.align" (the alignment policy, read by `check`); the
# data section is unchanged.
SINK_MODEL = "52f33c793b2f935dbfddc2437d6c3d8c17def039eb15edeb1febb769e2f286ca"
SINK_BLOB = {
    "sha256": "d8dea14cc415ce45427ac08bddbac961ddb5d402ac94567d9b67daae3e70ee79",
    "blake3": "e6760a1449644187a72f11c478255d028bc6342d47553ec452d7d7e14d340123",
}
BIG_MODEL = "60e7295ff6b2bedb5b480a302f343d9667745290c7cb0563df5e5043ae171858"
BIG_BLOB = {
    "sha256": "b2e1532abda1b1da535099220dab811176854a64de827d84dae8e9447baa6e59",
    "blake3": "21390e77a9f52c606676fb5f8bd53e849afe3937e2ab0dfc94ad33e294cffd6f",
}


@pytest.mark.parametrize("digest", ["sha256", "blake3"])
def test_onnx_kitchen_sink_bytes_are_pinned(tmp_path, monkeypatch, digest):
    monkeypatch.setattr(checksum_module, "DIGEST", digest)
    (tmp_path / "in").mkdir()
    report = weightshare.convert(kitchen_sink(tmp_path / "in", seed=3), tmp_path / "out")
    assert _onnx_digests(report) == (SINK_MODEL, SINK_BLOB[digest])


@pytest.mark.parametrize("kernel_copy", ["used", "refused"])
def test_onnx_multi_chunk_payload_bytes_are_pinned(tmp_path, monkeypatch, kernel_copy):
    # Unchanged payloads go through copy_file_range; when the kernel refuses it (EXDEV: another filesystem
    # on old kernels), the writer falls back to pread/pwrite. Both give the same bytes.
    real = os.copy_file_range
    calls = []

    def copy_file_range(*args):
        calls.append(args[2])
        if kernel_copy == "refused":
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", copy_file_range)
    monkeypatch.setattr(placement_module, "_KERNEL_COPY", True)
    (tmp_path / "in").mkdir()
    report = weightshare.convert(big_model(tmp_path / "in"), tmp_path / "out")
    assert _onnx_digests(report) == (BIG_MODEL, BIG_BLOB["blake3"])
    assert calls if kernel_copy == "used" else len(calls) == 1  # refused once, then never asked again


def test_sha256_blob_is_todays_and_differs_from_blake3_only_in_the_recorded_digests(tmp_path, monkeypatch):
    (tmp_path / "in").mkdir()
    model = big_model(tmp_path / "in")
    blobs = {}
    for digest in ("sha256", "blake3"):
        monkeypatch.setattr(checksum_module, "DIGEST", digest)
        report = weightshare.convert(model, tmp_path / digest)
        assert _onnx_digests(report) == (BIG_MODEL, BIG_BLOB[digest])
        blobs[digest] = Path(next(p for p in report.outputs if p.endswith(".safetensors"))).read_bytes()
    start, header = {}, {}
    for digest, raw in blobs.items():
        n = int.from_bytes(raw[:8], "little")
        start[digest], header[digest] = 8 + n, json.loads(raw[8 : 8 + n])
    assert start["sha256"] == start["blake3"] and len(blobs["sha256"]) == len(blobs["blake3"])
    assert blobs["sha256"][start["sha256"] :] == blobs["blake3"][start["blake3"] :]  # every payload byte
    meta = {d: json.loads(header[d].pop("__metadata__")["weightshare.payloads"]) for d in blobs}
    assert header["sha256"] == header["blake3"]  # names, dtypes, shapes, offsets
    assert {k: (v["aliases"], len(v["sha256"])) for k, v in meta["sha256"].items()} == {
        k: (v["aliases"], len(v["blake3"])) for k, v in meta["blake3"].items()
    }


def test_tflite_bytes_are_pinned(tmp_path):
    report = weightshare.convert(sample_model(tmp_path / "t.tflite", seed=2, fc_out=256), tmp_path / "out")
    assert [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in report.outputs] == [
        "e89dc47aaa65369ae9e8725b1d3d4604cf99e64a25da669253debc81dd050502"
    ]
