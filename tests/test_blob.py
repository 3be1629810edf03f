"""The shared blob: alignment, dedupe, checksums, and a file safetensors itself accepts."""

import hashlib
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from safetensors import safe_open

from weightshare.blob import AlignPolicy, BlobWriter, PlannedTensor, SafetensorsBlob, read_safetensors_metadata
from weightshare.errors import InvalidModel
from weightshare.tensors import BytesSource, ElementwiseSource, fp16_to_fp32, bf16_to_fp32


def _write_blob(path, arrays, policy=AlignPolicy()):
    planned = [PlannedTensor(name, str(a.dtype), a.shape, a.nbytes) for name, a in arrays]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        blob = SafetensorsBlob(fd, planned, policy)
        entries = [blob.add(t, BytesSource(a.tobytes())) for t, (_, a) in zip(planned, arrays)]
        size = blob.finish()
    finally:
        os.close(fd)
    return planned, entries, size


def test_safetensors_blob_is_valid_aligned_and_deduplicated(tmp_path):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((512, 1024), dtype=np.float32)  # 2 MiB: large alignment
    small = rng.standard_normal(100).astype(np.float16)
    arrays = [("w.big", big), ("w.small", small), ("w.copy", big.copy()), ("odd", np.arange(3, dtype=np.int8))]
    path = tmp_path / "m.weights.safetensors"
    planned, entries, size = _write_blob(path, arrays)

    assert size == os.path.getsize(path)
    assert entries[0].offset % 65536 == 0
    assert entries[1].offset % 64 == 0 and entries[3].offset % 64 == 0
    assert entries[2].duplicate and entries[2].offset == entries[0].offset
    with safe_open(str(path), "np") as f:
        names = set(f.keys())
        assert {"w.big", "w.small", "odd"} <= names and "w.copy" not in names
        assert np.array_equal(f.get_tensor("w.big"), big)
        assert np.array_equal(f.get_tensor("w.small"), small)
    data_start, header, meta = read_safetensors_metadata(str(path))
    assert data_start % 65536 == 0
    assert meta["w.big"]["aliases"] == ["w.copy"]
    assert meta["w.big"]["sha256"] == hashlib.sha256(big.tobytes()).hexdigest()
    raw = path.read_bytes()
    for (_, a), e in zip(arrays, entries):
        assert raw[e.offset : e.offset + e.nbytes] == a.tobytes()


def test_blob_is_deterministic(tmp_path):
    arrays = [("a", np.ones(300000, np.float32)), ("b", np.zeros(10, np.int64))]
    _write_blob(tmp_path / "1.safetensors", arrays)
    _write_blob(tmp_path / "2.safetensors", arrays)
    assert (tmp_path / "1.safetensors").read_bytes() == (tmp_path / "2.safetensors").read_bytes()


def test_duplicate_leaves_no_stale_bytes_in_padding(tmp_path):
    # A duplicate is written, then dropped; the padding before the next payload must read as zeros.
    a = np.full(1000, 7, np.uint8)
    arrays = [("a", a), ("dup", a.copy()), ("c", np.full(10, 9, np.uint8))]
    path = tmp_path / "b.safetensors"
    _, entries, _ = _write_blob(path, arrays)
    raw = path.read_bytes()
    gap = raw[entries[0].offset + 1000 : entries[2].offset]
    assert gap == bytes(len(gap))


def test_short_payload_is_rejected(tmp_path):
    fd = os.open(tmp_path / "x", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        w = BlobWriter(fd)

        class Lying:
            nbytes = 100

            def chunks(self, chunk_size):
                yield memoryview(b"x" * 10)

        with pytest.raises(InvalidModel):
            w.add(Lying())
    finally:
        os.close(fd)


@settings(max_examples=50, deadline=None)
@given(st.binary(min_size=0, max_size=4096).filter(lambda b: len(b) % 2 == 0), st.integers(2, 64))
def test_chunked_fp16_and_bf16_conversion_matches_numpy(data, chunk):
    chunk -= chunk % 2
    src = ElementwiseSource(BytesSource(data), 2, 4, fp16_to_fp32)
    out = b"".join(bytes(c) for c in src.chunks(chunk))
    assert out == np.frombuffer(data, "<f2").astype("<f4").tobytes()
    src = ElementwiseSource(BytesSource(data), 2, 4, bf16_to_fp32)
    out = b"".join(bytes(c) for c in src.chunks(chunk))
    expect = (np.frombuffer(data, "<u2").astype("<u4") << 16).tobytes()
    assert out == expect
