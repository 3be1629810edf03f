"""The shared blob: alignment, dedupe, checksums, and a file safetensors itself accepts."""

import hashlib
import os

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from weightshare._checksum import split_digest
from weightshare._placement import AlignPolicy, BlobWriter, PlannedTensor
from weightshare._recorded import recorded_payloads
from weightshare._safetensors import SafetensorsBlob, read_safetensors_metadata
from weightshare._tensors import (
    BufferRing,
    BytesSource,
    ConcatSource,
    ElementwiseSource,
    FileRange,
    bf16_to_fp32,
    fp16_to_fp32,
)
from weightshare.errors import InvalidModel


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
    assert meta["w.big"]["blake3"] == blake3.blake3(big.tobytes()).hexdigest()
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


def test_min_align_places_a_payload_and_refuses_a_less_aligned_first_copy(tmp_path):
    # --prepack's packed buffers must start on a page (onnxruntime maps them only at aligned addresses); a copy of
    # their bytes stored earlier at a 64-byte offset cannot stand in for them.
    a = np.arange(1000, dtype=np.uint8)
    path = tmp_path / "m.safetensors"
    planned = [
        PlannedTensor("odd", "uint8", (3,), 3),
        PlannedTensor("plain", "uint8", (1000,), 1000),
        PlannedTensor("packed", "uint8", (1000,), 1000, min_align=4096),
        PlannedTensor("packed2", "uint8", (1000,), 1000, min_align=4096),
    ]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        blob = SafetensorsBlob(fd, planned, AlignPolicy())
        sources = [np.arange(3, dtype=np.uint8), a, a, a]
        e = [blob.add(t, BytesSource(x.tobytes())) for t, x in zip(planned, sources, strict=True)]
        blob.finish()
    finally:
        os.close(fd)
    assert e[1].offset % 4096 and not e[2].duplicate and e[2].offset % 4096 == 0
    assert e[3].duplicate and e[3].offset == e[2].offset  # an aligned first copy is shared
    raw = path.read_bytes()
    assert raw[e[2].offset : e[2].offset + 1000] == a.tobytes()


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


@pytest.mark.parametrize("fast", [True, False])
def test_fp16_conversion_gives_numpy_bits_for_every_half(fast, monkeypatch):
    """The block-wise bit conversion (and its fallback, numpy's cast) on all 65536 halves, at odd starts and
    lengths and across a block boundary: the same bits as numpy's astype, NaN payloads and signed zeros kept."""
    import weightshare._tensors as tensors

    assert tensors._fp16_fast()  # exact on this machine: the fast path is what runs
    monkeypatch.setattr(tensors, "_FP16_EXACT", fast)
    monkeypatch.setattr(tensors, "_FP16_BLOCK", 1 << 12)
    every = np.arange(1 << 16, dtype=np.uint16)
    for start, count in ((0, 1 << 16), (3, 65531), (4093, 5000), (0, 1)):
        halves = np.roll(every, -start)[:count].tobytes()
        expect = np.frombuffer(halves, "<f2").astype("<f4").view("<u4")
        out = bytearray(2 * len(halves))
        got = fp16_to_fp32(memoryview(halves), memoryview(out))
        assert np.array_equal(got.view("<u4"), expect)
        assert bytes(out) == expect.tobytes()
        assert np.array_equal(fp16_to_fp32(memoryview(halves)).view("<u4"), expect)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 300), min_size=1, max_size=5).map(lambda ls: [n - n % 2 for n in ls]), st.integers(1, 40)
)
def test_ring_buffers_keep_each_chunk_until_two_more_are_requested(tmp_path_factory, lengths, chunk):
    """The writer's reused buffers (BufferRing) keep the promise of stable_chunks across the parts of a concat
    and from payload to payload: a chunk is intact until two more have been requested, and the bytes equal
    those read without a ring."""
    chunk *= 2
    path = tmp_path_factory.mktemp("ring") / "data"
    data = np.random.default_rng(len(lengths)).integers(0, 256, sum(lengths), np.uint8).tobytes()
    path.write_bytes(data)
    starts = np.cumsum([0, *lengths[:-1]]).tolist()
    ring = BufferRing()
    for _payload in range(2):  # the ring's buffers carry over to the next payload
        for fold in (False, True):
            raw = ConcatSource([FileRange(str(path), o, n) for o, n in zip(starts, lengths)])
            src = ElementwiseSource(raw, 2, 4, fp16_to_fp32) if fold else raw
            expect = b"".join(bytes(c) for c in src.chunks(chunk))
            got, held = [], []
            for c in src.chunks(chunk, ring=ring):
                held.append((c, bytes(c)))
                if len(held) == 2:  # the consumer may hold chunk i while chunk i+1 is produced
                    view, copy = held.pop(0)
                    assert bytes(view) == copy
                got.append(bytes(c))
            assert b"".join(got) == expect


# The header is built as text, piece by piece (100,000s of tensors); these references are the dict + json.dumps
# forms it replaced, and the bytes must stay the same.
def _reference_bound(planned) -> int:
    import json

    big = 10**20 - 1
    tensors = {}
    for i, t in enumerate(planned):
        tensors[t.st_name] = {"dtype": t.st_dtype, "shape": list(t.st_shape), "data_offsets": [big, big]}
        tensors[f"__pad__{big}{i}"] = {"dtype": "U8", "shape": [big], "data_offsets": [big, big]}
    worst = {t.st_name: {"sha256": "0" * 64, "aliases": [t.st_name]} for t in planned}
    tensors["__metadata__"] = {
        "format": "weightshare",
        "weightshare.payloads": json.dumps(worst, separators=(",", ":")),
    }
    return len(json.dumps(tensors, separators=(",", ":")).encode()) + 64


def _reference_header(blob) -> bytes:
    import json

    tensors, meta, cursor = {}, {}, 0
    for n_pad, stored in enumerate(sorted(blob._stored, key=lambda s: s.entry.offset)):
        begin = stored.entry.offset - blob.data_start
        if begin > cursor:
            tensors[f"__pad__{n_pad}"] = {"dtype": "U8", "shape": [begin - cursor], "data_offsets": [cursor, begin]}
        t = stored.planned
        tensors[t.st_name] = {
            "dtype": t.st_dtype,
            "shape": list(t.st_shape),
            "data_offsets": [begin, begin + stored.entry.nbytes],
        }
        kind, value = split_digest(stored.entry.digest)
        meta[t.st_name] = {kind: value, "aliases": stored.aliases}
        cursor = begin + stored.entry.nbytes
    tensors["__metadata__"] = {
        "format": "weightshare",
        "weightshare.payloads": json.dumps(meta, separators=(",", ":")),
        **blob.metadata,  # the alignment policy, and what a format adds
    }
    return json.dumps(tensors, separators=(",", ":")).encode()


_names = st.text(st.characters(codec="utf-8"), max_size=12) | st.sampled_from(['a"b', "c\\d", "\x00\n", "é€😀", ""])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            _names,
            st.sampled_from(["float32", "float16", "int8", "weird"]),
            st.lists(st.integers(0, 70), max_size=3),
            st.booleans(),
        ),
        max_size=8,
    )
)
@pytest.mark.slow
def test_header_text_equals_json_dumps_of_the_dict(tmp_path_factory, specs):
    from weightshare._safetensors import SafetensorsBlob

    planned, sources = [], []
    for name, dtype, shape, dup in specs:
        count = int(np.prod(shape)) if shape else 1
        itemsize = {"float32": 4, "float16": 2, "int8": 1, "weird": 3}[dtype]
        data = bytes([7]) * (count * itemsize) if dup else np.random.default_rng(len(planned)).bytes(count * itemsize)
        planned.append(PlannedTensor(name, dtype, tuple(shape), len(data)))
        sources.append(BytesSource(data))
    path = tmp_path_factory.mktemp("h") / "b.safetensors"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        blob = SafetensorsBlob(fd, planned, AlignPolicy(large=1 << 12, threshold=100))
        assert blob._header_bound(planned) == _reference_bound(planned)
        for t, src in zip(planned, sources):
            blob.add(t, src)
        assert blob.header() == _reference_header(blob)
        blob.finish()
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["sha256", "blake3"])
def test_recorded_digests_read_both_kinds(tmp_path, kind, monkeypatch):
    # Blobs written before BLAKE3 record {"sha256": hex}; new ones {"blake3": hex}. Both are read back.
    import weightshare._checksum as blob_module

    monkeypatch.setattr(blob_module, "DIGEST", kind)
    a = np.arange(1000, dtype=np.float32)
    path = tmp_path / "b.safetensors"
    _, entries, _ = _write_blob(path, [("a", a)])
    _, _, meta = read_safetensors_metadata(str(path))
    expected = (hashlib.sha256 if kind == "sha256" else blake3.blake3)(a.tobytes()).hexdigest()
    assert meta["a"] == {kind: expected, "aliases": []}
    tagged = expected if kind == "sha256" else f"blake3:{expected}"
    assert recorded_payloads(str(path)) == {(entries[0].offset, entries[0].nbytes): tagged}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sha256", "blake3"])
@pytest.mark.parametrize("fmt", ["onnx", "tflite"])
def test_check_verifies_blobs_of_either_kind(tmp_path, kind, fmt, monkeypatch):
    # A blob written today (SHA-256) and one written with BLAKE3 both pass check, and a flipped payload byte in
    # either is reported.
    from onnx_fixtures import kitchen_sink
    from tflite_fixtures import sample_model

    import weightshare
    import weightshare._checksum as blob_module
    from weightshare._check import check
    from weightshare.options import ConvertOptions

    monkeypatch.setattr(blob_module, "DIGEST", kind)
    (tmp_path / "in").mkdir()
    src = kitchen_sink(tmp_path / "in") if fmt == "onnx" else sample_model(tmp_path / "in" / "m.tflite", fc_out=256)
    options = ConvertOptions(external=True) if fmt == "tflite" else None
    report = weightshare.convert(src, tmp_path / "out", options)
    monkeypatch.setattr(blob_module, "DIGEST", "blake3")  # the reader does not depend on the writer's default
    model = next(p for p in report.outputs if p.endswith((".onnx", ".tflite")))
    blob = next(p for p in report.outputs if p.endswith(".safetensors"))
    sums = recorded_payloads(blob)
    assert sums and all((":" in v) == (kind == "blake3") for v in sums.values())
    assert not [f for f in check([model])[1] if f.code == "checksum-mismatch"]
    offset, _ = max(sums)
    with open(blob, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    assert [f for f in check([model])[1] if f.code == "checksum-mismatch"]


@pytest.mark.slow
def test_zero_length_payloads_are_listed_and_pass_check_and_verify(tmp_path):
    # A zero-length payload sits at the offset the next payload starts at. The header used to leave it out (the
    # next one took its place), so safetensors readers did not list it and check/verify, which found no digest
    # at its (offset, length), reported a correct conversion as checksum-mismatch.
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh
    from safetensors.numpy import load_file

    import weightshare
    from weightshare._check import check
    from weightshare._dispatch import verify
    from weightshare.options import ConvertOptions

    empty = nh.from_array(np.zeros((0, 4), np.float32), "empty")
    empty2 = nh.from_array(np.zeros((0, 4), np.float32), "empty2")  # a duplicate of it: an alias
    w = nh.from_array(np.arange(4, dtype=np.float32), "w")
    nodes = [
        h.make_node("Concat", ["x", "empty", "empty2"], ["y0"], axis=0),
        h.make_node("Add", ["y0", "w"], ["y"]),
    ]
    x = h.make_tensor_value_info("x", T.FLOAT, [1, 4])
    y = h.make_tensor_value_info("y", T.FLOAT, [1, 4])
    src = tmp_path / "zl.onnx"
    onnx.save(h.make_model(h.make_graph(nodes, "g", [x], [y], [empty, empty2, w])), src)
    report = weightshare.convert(src, tmp_path / "out", ConvertOptions(inline_threshold=0))
    assert report.tensors_moved == 3
    blob = next(p for p in report.outputs if p.endswith(".safetensors"))
    loaded = load_file(blob)
    assert loaded["empty"].shape == (0, 4) and np.array_equal(loaded["w"], np.arange(4, dtype=np.float32))
    _, _, meta = read_safetensors_metadata(blob)
    assert meta["empty"]["aliases"] == ["empty2"] and meta["w"]["aliases"] == []
    assert len(recorded_payloads(blob)) == 2  # (offset, 0) and (offset, 16): both recorded
    model = str(tmp_path / "out" / "zl.onnx")
    assert check([model])[1] == []
    result = verify(str(src), model)
    assert result.passed and result.payloads_hashed == 3, result.checksum_mismatches
