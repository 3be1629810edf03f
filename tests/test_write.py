"""The one write path (``weightshare._write``): every container, one accountant, placements by position."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from weightshare._placement import AlignPolicy, BlobEntry, PlannedTensor
from weightshare._safetensors import SafetensorsBlob
from weightshare._tensors import BytesSource
from weightshare._write import BlobPayload, write_payloads
from weightshare.errors import OutputError
from weightshare.formats.coreml.milblob import BlobRecord, WeightFile, WeightFileWriter, record_payload
from weightshare.formats.tflite.convert import AppendedContainer
from weightshare.options import ConvertOptions
from weightshare.report import ConversionReport

POLICY = AlignPolicy(large=4096, small=64, threshold=1024)
RNG = np.random.default_rng(7)
ARRAYS = [
    RNG.standard_normal(300).astype("<f4"),  # small: 64-byte alignment
    RNG.standard_normal(2000).astype("<f4"),  # large: 4096-byte alignment
    None,  # a copy of the first: stored once
    RNG.standard_normal(10).astype("<f4"),
]
ARRAYS[2] = ARRAYS[0].copy()
RECORD_DTYPE = 4  # any Core ML dtype code (4: int8); the record carries it, the bytes are opaque


def _payloads(kind: str) -> list[BlobPayload]:
    out: list[BlobPayload] = []
    for i, a in enumerate(ARRAYS):
        assert a is not None
        data = a.tobytes()
        nbytes_in = len(data) // 2  # as if each had been unpacked from fp16: bytes_in must follow the payload's word
        if kind == "coreml":
            p = record_payload(BlobRecord(0, RECORD_DTYPE, len(data), 0, 0), BytesSource(data), f"t{i}")
            p.nbytes_in = nbytes_in
            out.append(p)
        else:
            out.append(BlobPayload(PlannedTensor(f"t{i}", "float32", a.shape, len(data)), BytesSource(data), nbytes_in))
    return out


def _write(kind: str, path) -> tuple[ConversionReport, list[tuple[int, int]]]:
    report = ConversionReport(model="m", format=kind)
    payloads = _payloads(kind)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if kind == "safetensors":
            container = SafetensorsBlob(fd, [p.tensor for p in payloads], POLICY)
        elif kind == "appended":
            os.pwrite(fd, b"F" * 100, 0)  # the flatbuffer's place
            container = AppendedContainer(fd, 100, ConvertOptions(align=POLICY))
        else:
            container = WeightFileWriter(fd, POLICY)
        placements = write_payloads(container, iter(payloads), report)
        container.finish()
    finally:
        os.close(fd)
    return report, [(placements.offset(i), placements.nbytes(i)) for i in range(len(placements))]


@pytest.mark.parametrize("kind", ["safetensors", "appended", "coreml"])
def test_every_container_is_accounted_alike_and_placed_by_position(tmp_path, kind):
    path = tmp_path / "out.bin"
    report, placed = _write(kind, path)
    sizes = [a.nbytes for a in ARRAYS]
    # one accountant: the same counters whatever the container
    assert (report.tensors_moved, report.bytes_in, report.bytes_out) == (4, sum(sizes) // 2, sum(sizes))
    assert (report.deduplicated, report.deduplicated_bytes) == (1, sizes[0])
    assert report.bytes_written == sum(sizes) - sizes[0]
    assert [n for _, n in placed] == sizes
    assert placed[2] == placed[0] and len({o for o, _ in placed}) == 3  # the copy points at the first
    data = path.read_bytes()
    if kind == "coreml":  # the placement is the record; coremltools' layout is checked in test_coreml_milblob
        wf = WeightFile(path)
        got = [wf.payload(wf.record(offset)) for offset, _ in placed]
        assert [b"".join(bytes(c) for c in src.chunks(1 << 20)) for src in got] == [a.tobytes() for a in ARRAYS]
        return
    for (offset, n), a in zip(placed, ARRAYS):
        assert data[offset : offset + n] == a.tobytes()
        assert offset % (4096 if n >= 1024 else 64) == 0
    if kind == "safetensors":
        loaded = load_file(str(path))
        for i in (0, 1, 3):
            assert np.array_equal(loaded[f"t{i}"], ARRAYS[i])
    else:
        assert data[:100] == b"F" * 100 and data.endswith(bytes(16))  # the caller's bytes kept; trailing zeros


class _Short:
    """A container that places fewer bytes than planned: write_payloads must not record it."""

    def place(self, payload, progress=None):
        return BlobEntry(0, payload.tensor.nbytes - 1, "blake3:00")


def test_a_placement_of_the_wrong_size_is_refused():
    report = ConversionReport(model="m", format="x")
    with pytest.raises(OutputError, match="1 bytes placed, 2 planned"):
        write_payloads(_Short(), [BlobPayload(PlannedTensor("w", "uint8", (2,), 2), BytesSource(b"ab"), 2)], report)
    assert report.tensors_moved == 0
