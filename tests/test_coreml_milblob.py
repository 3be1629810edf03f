"""weight.bin (MIL blob storage v2): exact bytes written, read back by coremltools' own reader, and a reader that
never trusts a field it has not checked."""

from __future__ import annotations

import os
import struct

import coreml_fixtures as F
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightshare._placement import AlignPolicy
from weightshare._tensors import BytesSource
from weightshare.errors import InvalidModel
from weightshare.formats.coreml.milblob import BlobRecord, WeightFile, WeightFileWriter, pack_record


def _write(path, payloads, policy=AlignPolicy()):
    """payloads: (dtype, padding_bits, bytes); returns the new record offsets."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        w = WeightFileWriter(fd, policy)
        offsets = [w.add(BlobRecord(0, dtype, len(data), 0, pad), BytesSource(data)) for dtype, pad, data in payloads]
        w.finish()
    finally:
        os.close(fd)
    return offsets, w


def test_golden_layout(tmp_path):
    small = np.arange(10, dtype="<f2").tobytes()  # 20 bytes
    big = np.arange(1 << 19, dtype="<f2").tobytes()  # exactly 1 MiB: 64 KiB alignment
    path = tmp_path / "weight.bin"
    offsets, w = _write(path, [(1, 0, small), (1, 0, big), (4, 0, b"\x07" * 3), (1, 0, small)])
    data = path.read_bytes()
    assert data[:64] == struct.pack("<II", 3, 2) + bytes(56)  # 3 unique blobs, version 2
    assert data[64:128] == pack_record(1, 20, 128, 0) == struct.pack("<IIQQQ", 0xDEADBEEF, 1, 20, 128, 0) + bytes(32)
    assert data[128:148] == small
    # the next record at the 64-byte boundary after the payload (GetAllOffsets), its data at 64 KiB
    assert data[192:256] == pack_record(1, 1 << 20, 65536, 0)
    assert data[256:65536] == bytes(65536 - 256)
    assert data[65536 : 65536 + (1 << 20)] == big
    rec3 = 65536 + (1 << 20)
    assert data[rec3 : rec3 + 64] == pack_record(4, 3, rec3 + 64, 0)
    assert len(data) == rec3 + 64 + 3
    assert offsets == [64, 192, rec3, 64]  # the repeated payload points at its first copy
    assert w.duplicates == 1 and w.duplicate_bytes == 20
    assert F.walk_records(path) == [64, 192, rec3]


def test_coremltools_reader_reads_every_dtype(tmp_path):
    from coremltools.libmilstoragepython import _BlobStorageReader

    rng = np.random.default_rng(1)
    fp16 = rng.standard_normal(1000).astype("<f2")
    fp32 = rng.standard_normal((600, 512)).astype("<f4")  # > 1 MiB
    i8 = rng.integers(-128, 128, 77, dtype=np.int8)
    u3 = rng.integers(0, 8, 13, dtype=np.uint8)  # 13 x 3 bits = 39 bits: 5 bytes, 1 padding bit
    packed_u3 = np.packbits(
        np.unpackbits(u3[:, None], axis=1, count=3, bitorder="little").ravel(), bitorder="little"
    ).tobytes()
    path = tmp_path / "weight.bin"
    offsets, _ = _write(
        path, [(1, 0, fp16.tobytes()), (2, 0, fp32.tobytes()), (4, 0, i8.tobytes()), (12, 1, packed_u3)]
    )
    reader = _BlobStorageReader(str(path))
    assert np.array_equal(reader.read_fp16_data(offsets[0]), fp16.view(np.uint16))
    assert np.array_equal(reader.read_float_data(offsets[1]).ravel(), fp32.ravel())
    assert np.array_equal(reader.read_int8_data(offsets[2]), i8)
    assert np.array_equal(reader.read_uint3_data(offsets[3]), u3)
    assert WeightFile(path).record(offsets[3]).padding_bits == 1


def test_same_bytes_different_dtype_are_two_blobs(tmp_path):
    offsets, w = _write(
        tmp_path / "w.bin", [(3, 0, b"\1" * 64), (4, 0, b"\1" * 64), (11, 0, b"\1" * 64), (11, 4, b"\1" * 64)]
    )
    assert len(set(offsets)) == 4 and w.duplicates == 0


def _file(tmp_path, header=struct.pack("<II", 1, 2), records=b""):
    path = tmp_path / "weight.bin"
    path.write_bytes(header.ljust(64, b"\0") + records)
    return path


@pytest.mark.parametrize(
    "record, offset, message",
    [
        (pack_record(1, 4, 128, 0) + b"abcd", 64, None),
        (struct.pack("<IIQQQ", 0xDEADBEEE, 1, 4, 128, 0).ljust(64, b"\0") + b"abcd", 64, "bad sentinel"),
        (pack_record(99, 4, 128, 0) + b"abcd", 64, "unknown blob data type 99"),
        (pack_record(1, 5, 128, 0) + b"abcd", 64, "runs past the end"),
        (pack_record(1, 4, 1 << 63, 0) + b"abcd", 64, "runs past the end"),
        (pack_record(1, 4, 16, 0) + b"abcd", 64, "overlaps the file header"),
        (pack_record(1, 4, 128, 0) + b"abcd", 1 << 62, "not a record offset in the weight file"),
        (pack_record(1, 4, 128, 0) + b"abcd", 8, "not a record offset in the weight file"),
        (pack_record(11, 4, 128, 8) + b"abcd", 64, "padding bits"),  # uint4 with 8 padding bits
        (pack_record(12, 4, 128, 3) + b"abcd", 64, "padding bits"),  # uint3: 29 bits is not whole elements
        (pack_record(1, 4, 128, 12345) + b"abcd", 64, None),  # pre-iOS18 garbage in an unused field: ignored
    ],
)
def test_record_checks(tmp_path, record, offset, message):
    wf = WeightFile(_file(tmp_path, records=record))
    if message is None:
        rec = wf.record(offset)
        assert (rec.nbytes, rec.data_offset, rec.padding_bits) == (4, 128, 0)
        assert b"".join(bytes(c) for c in wf.payload(rec).chunks()) == b"abcd"
    else:
        with pytest.raises(InvalidModel, match=message):
            wf.record(offset)


def test_header_checks(tmp_path):
    with pytest.raises(InvalidModel, match="storage version 1"):
        WeightFile(_file(tmp_path, header=struct.pack("<II", 1, 1)))
    (tmp_path / "short.bin").write_bytes(b"\0" * 63)
    with pytest.raises(InvalidModel, match="shorter"):
        WeightFile(tmp_path / "short.bin")


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(blob=st.binary(min_size=64, max_size=400), offset=st.integers(0, 1 << 64))
def test_reader_never_trusts_fields(tmp_path, blob, offset):
    """Arbitrary bytes: either a record whose payload lies inside the file, or InvalidModel; nothing else."""
    path = tmp_path / "fuzz.bin"
    path.write_bytes(struct.pack("<II", 1, 2) + blob[8:])
    wf = WeightFile(path)
    for off in (offset, 64, 64 + offset % 300):
        try:
            rec = wf.record(off)
        except InvalidModel:
            continue
        assert 64 <= rec.data_offset and rec.data_offset + rec.nbytes <= len(blob)
        assert off + 64 <= len(blob)
