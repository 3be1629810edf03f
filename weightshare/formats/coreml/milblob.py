"""Core ML weight files (MIL blob storage v2): a bounds-checked reader and a page-aligned writer.

Layout (coremltools ``mlmodel/src/MILBlob/Blob/StorageFormat.hpp``): a 64-byte
``storage_header`` {u32 count, u32 version=2, zeros}, then per blob a 64-byte
``blob_metadata`` {u32 sentinel 0xDEADBEEF, u32 mil_dtype, u64 sizeInBytes,
u64 data offset, u64 padding_size_in_bits, 4 reserved u64}. A ``BlobFileValue``
offset names the metadata record; the record names the data.

Facts from coremltools' reader (``StorageReader.cpp``) that this writer relies on:

- ``GetRawDataView`` reads ``sizeInBytes`` at the record's ``offset``: the data need
  not follow its record directly, so a 64 KiB-aligned payload after a gap is read
  as is.
- ``GetAllOffsets`` walks the file: the first record at 64, each next one at the
  64-byte boundary after the previous payload's end. Records are therefore written
  at exactly that boundary (``BlobWriter`` puts the prefix at ``align_up(end, 64)``)
  and the gap sits between a record and its data, never before a record.
- Sub-byte types (int4, uint1/2/3/4/6) are stored packed; ``sizeInBytes`` counts the
  padded bytes and ``padding_size_in_bits`` (< 8) the unused bits of the last byte.
  The reader rejects 8 or more. Before iOS 18 the reserved fields were left
  uninitialised, so the field is trusted only for sub-byte dtypes and written as 0
  for the others.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from ..._checksum import digest_of
from ..._placement import AlignPolicy, BlobEntry, BlobWriter, PlannedTensor, Progress
from ..._tensors import FileRange, PayloadSource, open_input
from ..._write import BlobPayload
from ...errors import InvalidModel, OutputError

HEADER_SIZE = 64
RECORD_SIZE = 64
RECORD_ALIGN = 64  # DefaultStorageAlignment
SENTINEL = 0xDEADBEEF
VERSION = 2
_HEADER = struct.Struct("<II")
_RECORD = struct.Struct("<IIQQQ")

# BlobDataType (MILBlob/Blob/BlobDataType.hpp); values only ever get appended there.
DTYPES = {
    1: "float16",
    2: "float32",
    3: "uint8",
    4: "int8",
    5: "bfloat16",
    6: "int16",
    7: "uint16",
    8: "int4",
    9: "uint1",
    10: "uint2",
    11: "uint4",
    12: "uint3",
    13: "uint6",
    14: "int32",
    15: "uint32",
    16: "float8_e4m3fn",
    17: "float8_e5m2",
}
SUB_BYTE_BITS = {8: 4, 9: 1, 10: 2, 11: 4, 12: 3, 13: 6}


@dataclass(frozen=True)
class BlobRecord:
    """One ``blob_metadata`` record, checked against the file it came from."""

    offset: int  # of the record itself (what BlobFileValue.offset holds)
    dtype: int
    nbytes: int
    data_offset: int
    padding_bits: int

    @property
    def dtype_name(self) -> str:
        return DTYPES[self.dtype]


class WeightFile:
    """Reads records of one weight.bin; every field is checked before it is used.

    Only 64-byte records and the header are read into memory; payloads are
    returned as ``FileRange`` sources for chunked copying.
    """

    def __init__(self, path: str | os.PathLike[str], inside: str | os.PathLike[str] | None = None):
        """``inside``: the directory ``path`` was checked to lie in (``resolve_inside``); the file is opened
        once, refused unless it is a regular file still inside it, and every read goes through that fd."""
        self.path = os.fspath(path)
        self.file = open_input(self.path, inside)
        self.size = self.file.size
        try:
            head = os.pread(self.file.fd, HEADER_SIZE, 0)
        except OSError as e:
            raise InvalidModel(f"cannot read weight file: {e.strerror}", self.path) from None
        if len(head) < HEADER_SIZE:
            raise InvalidModel(
                f"weight file is shorter ({len(head)} bytes) than its {HEADER_SIZE}-byte header", self.path
            )
        self.count, version = _HEADER.unpack_from(head)
        if version != VERSION:
            raise InvalidModel(
                f"weight file has storage version {version}; only version 2 (MIL blob storage) is supported", self.path
            )

    def record(self, offset: int) -> BlobRecord:
        if offset < HEADER_SIZE or offset + RECORD_SIZE > self.size:
            raise InvalidModel(
                f"blob offset {offset} is not a record offset in the weight file ({self.size} bytes): "
                "past its end or inside its header",
                self.path,
            )
        try:
            raw = os.pread(self.file.fd, RECORD_SIZE, offset)
        except OSError as e:
            raise InvalidModel(f"cannot read weight file: {e.strerror}", self.path) from None
        if len(raw) < RECORD_SIZE:
            raise InvalidModel(f"weight file ended early reading the blob record at offset {offset}", self.path)
        sentinel, dtype, nbytes, data_offset, padding = _RECORD.unpack_from(raw)
        if sentinel != SENTINEL:
            raise InvalidModel(
                f"bad sentinel 0x{sentinel:08X} in the blob record at offset {offset} (expected 0x{SENTINEL:08X})",
                self.path,
            )
        if dtype not in DTYPES:
            raise InvalidModel(f"unknown blob data type {dtype} in the record at offset {offset}", self.path)
        if data_offset < HEADER_SIZE:
            raise InvalidModel(f"blob at offset {offset}: data at {data_offset} overlaps the file header", self.path)
        if data_offset + nbytes > self.size:
            raise InvalidModel(
                f"blob at offset {offset}: data at {data_offset} with {nbytes} bytes runs past the end "
                f"of the weight file ({self.size} bytes)",
                self.path,
            )
        if dtype in SUB_BYTE_BITS:
            bits = SUB_BYTE_BITS[dtype]
            if padding >= 8 or (nbytes == 0 and padding) or (nbytes * 8 - padding) % bits:
                raise InvalidModel(
                    f"blob at offset {offset}: {padding} padding bits do not fit {nbytes} bytes of {DTYPES[dtype]}",
                    self.path,
                )
        else:
            padding = 0
        return BlobRecord(offset, dtype, nbytes, data_offset, padding)

    def payload(self, rec: BlobRecord) -> FileRange:
        src = FileRange(self.path, rec.data_offset, rec.nbytes, self.file)
        src.check_within(self.size)
        return src


def pack_record(dtype: int, nbytes: int, data_offset: int, padding_bits: int) -> bytes:
    return _RECORD.pack(SENTINEL, dtype, nbytes, data_offset, padding_bits).ljust(RECORD_SIZE, b"\0")


def pack_header(count: int) -> bytes:
    return _HEADER.pack(count, VERSION).ljust(HEADER_SIZE, b"\0")


@dataclass(slots=True)
class RecordPayload(BlobPayload):
    """A payload for a weight.bin: its bytes and the record (dtype, padding bits) that describes them."""

    record: BlobRecord


def record_payload(rec: BlobRecord, source: PayloadSource, name: str = "") -> RecordPayload:
    return RecordPayload(PlannedTensor(name, rec.dtype_name, (), source.nbytes), source, source.nbytes, rec)


class WeightFileWriter:
    """``_write.Container`` of a weight.bin: payloads at ``policy`` alignment, each distinct payload once.

    A payload that could be a duplicate (an earlier one has the same dtype and length) is
    hashed before it is written: merging N functions that share their weights then reads N
    copies but writes one (writing the copies and truncating them away, as a plain
    ``BlobWriter`` would, costs N times the page-cache writes). Such a payload, when it turns
    out new, is read twice; the second read is checked against the first. A payload of a new
    length is written at once, hashed on the way.

    Example:
        w = WeightFileWriter(fd, AlignPolicy())
        new_offset = w.add(record, weight_file.payload(record))   # -> BlobFileValue.offset
        w.finish()
    """

    def __init__(self, fd: int, policy: AlignPolicy = AlignPolicy()):
        self.blob = BlobWriter(fd, HEADER_SIZE, policy, dedupe=True)
        self.count = 0
        self.duplicates = 0
        self.duplicate_bytes = 0
        self.bytes_in = 0
        self._seen: dict[tuple[str, int, str], int] = {}
        self._lengths: set[tuple[str, int]] = set()
        self.blob.pwrite(pack_header(0), 0)

    def add(self, rec: BlobRecord, source: PayloadSource, progress: Progress | None = None) -> int:
        """Copy one payload; return the offset of its metadata record in the new file."""
        return self.place(record_payload(rec, source), progress).offset

    def place(self, payload: BlobPayload, progress: Progress | None = None) -> BlobEntry:
        """Copy one payload (a ``RecordPayload``); the entry's offset is its record's (what the model references)."""
        if not isinstance(payload, RecordPayload):
            raise TypeError("a weight.bin holds RecordPayloads: each payload needs its record")
        rec, source = payload.record, payload.source
        # The dtype and padding are part of the identity: the same bytes read as fp16 and as
        # uint8 are two blobs to the reader, which checks the record's dtype.
        tag = f"{rec.dtype}:{rec.padding_bits}"
        self.bytes_in += source.nbytes
        expected = None
        if (tag, source.nbytes) in self._lengths:
            expected = digest_of(source.chunks(self.blob.chunk_size), self.blob.digest)
            known = self._seen.get((tag, source.nbytes, expected))
            if known is not None:
                self.duplicates += 1
                self.duplicate_bytes += source.nbytes
                if progress is not None:
                    progress(source.nbytes)
                return BlobEntry(known, source.nbytes, expected, known, duplicate=True)
        entry = self.blob.add(source, tag=tag, prefix_size=RECORD_SIZE, prefix_align=RECORD_ALIGN, progress=progress)
        if entry.duplicate or expected not in (None, entry.digest):
            raise InvalidModel("weight data changed while it was being read", getattr(source, "path", None))
        record_at = entry.prefix_offset
        assert record_at is not None  # set whenever prefix_size is
        self._lengths.add((tag, source.nbytes))
        self._seen[(tag, source.nbytes, entry.digest)] = record_at
        self.blob.pwrite(pack_record(rec.dtype, entry.nbytes, entry.offset, rec.padding_bits), record_at)
        self.count += 1
        return BlobEntry(record_at, entry.nbytes, entry.digest, record_at)

    def finish(self) -> int:
        """Write the header with the final count and fix the file length; return it."""
        if self.count >= 1 << 32:
            raise OutputError("more than 2**32-1 blobs do not fit a Core ML weight file")
        self.blob.pwrite(pack_header(self.count), 0)
        size = self.blob.finish()
        try:
            os.fsync(self.blob.fd)
        except OSError as e:
            raise OutputError(f"cannot write the weight file: {e.strerror}") from None
        return size

    @property
    def bytes_written(self) -> int:
        return self.blob.bytes_written
