"""The safetensors container: a file that is both a valid safetensors file and a raw page-aligned blob.

``SafetensorsBlob`` reserves the header region up front (its size bounded from the planned tensor list) so
that the data section starts at an aligned absolute offset and every payload offset is planned before its
bytes are written, as gguf-py's writer does; the payloads go through the placement engine
(``_placement.BlobWriter``). Like the other containers (``formats.tflite.convert.AppendedContainer``,
``formats.coreml.milblob.WeightFileWriter``) it is a ``_write.Container``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._container import BlobContainer
from ._placement import AlignPolicy, BlobEntry, BlobWriter, PlannedTensor, Progress, align_up
from ._tensors import PayloadSource
from .errors import InvalidModel, OutputError

if TYPE_CHECKING:
    from ._write import BlobPayload

__all__ = [
    "ALIGN_KEY",
    "CONTAINER",
    "METADATA_KEY",
    "SAFETENSORS_DTYPES",
    "SafetensorsBlob",
    "read_safetensors_metadata",
]

ALIGN_KEY = "weightshare.align"  # in a safetensors blob's __metadata__: the AlignPolicy it was written with

# safetensors dtype names for numpy-style dtype keys; anything else is stored as U8.
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_OFFSET_DIGITS = 20  # enough for any uint64 offset
SPARE_FLOOR = 16 << 10  # header room reserved for adopted payloads beyond the spare factor
METADATA_KEY = "weightshare.payloads"


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


@dataclass(slots=True)
class _Stored:
    planned: PlannedTensor
    entry: BlobEntry
    more: list[str] | None = None  # aliases; most payloads have none: no empty list each

    @property
    def aliases(self) -> list[str]:
        return self.more if self.more is not None else []


def _safetensors_view(t: PlannedTensor) -> tuple[str, tuple[int, ...]]:
    st = SAFETENSORS_DTYPES.get(t.dtype)
    if st is not None:
        count = 1
        for d in t.shape:
            count *= d
        if count * _ITEMSIZE[st] == t.nbytes:
            return st, tuple(t.shape)
    return "U8", (t.nbytes,)


def _unique_names(planned: Iterable[PlannedTensor], prefixes: Sequence[str] | None = None) -> None:
    """Set each tensor's ``st_name``: ``prefixes[i]`` + its name, made unique and kept clear of ``__`` keys."""
    seen: set[str] = set()
    for i, t in enumerate(planned):
        full = prefixes[i] + t.name if prefixes else t.name
        base = full if full and not full.startswith("__") else f"tensor{full}"
        name, n = base, 1
        while name in seen:
            n += 1
            name = f"{base}#{n}"
        seen.add(name)
        t.st_name = name


class SafetensorsBlob:
    """A safetensors file whose payloads sit at page-aligned absolute offsets.

    Args:
        fd: writable descriptor of the (temporary) output file.
        planned: every payload that may be added, in any order. Sizes must be final.
        policy: payload alignment; the data section starts at a multiple of ``policy.large``.

    Example:
        blob = SafetensorsBlob(fd, planned, AlignPolicy())
        for t, src in zip(planned, sources):
            offset = blob.add(t, src).offset   # absolute file offset, for external data
        blob.finish()
    """

    def __init__(
        self,
        fd: int,
        planned: list[PlannedTensor],
        policy: AlignPolicy = AlignPolicy(),
        dedupe: bool = True,
        metadata: dict[str, str] | None = None,
        prefixes: Sequence[str] | None = None,
        spare: float = 0.0,
    ):
        self.metadata = dict(metadata or {})  # extra string entries for __metadata__ (e.g. the ORT version used)
        self.metadata[ALIGN_KEY] = policy.render()  # `check` reads the alignment asked for instead of assuming it
        _unique_names(planned, prefixes)  # the header's names; the tensors' own names stay as the format made them
        for t in planned:
            t.st_dtype, t.st_shape = _safetensors_view(t)
        self.fd = fd
        bound = self._header_bound(planned, self.metadata)
        # ``spare``: room for a header that many times longer again (payloads ``adopt``-ed later: ``--prepack``'s
        # packed copies), up to 1/32 of the payload bytes plus SPARE_FLOOR: a header is padded with spaces
        room = min(int(bound * spare), sum(t.nbytes for t in planned) // 32) + SPARE_FLOOR if spare > 0 else 0
        self.data_start = align_up(8 + bound + room, max(policy.large, policy.small))
        self._names = {t.st_name for t in planned}
        self.writer = BlobWriter(fd, self.data_start, policy, dedupe)
        # By writer row (offset order): the tensor first stored there; by row, the names of later copies, for the
        # few payloads that have any. A list of references, no object per payload. A zero-length
        # payload has a row (and a header entry) of its own, at the offset the next payload starts at.
        self._planned: list[PlannedTensor] = []
        self._aliases: dict[int, list[str]] = {}
        self.header_sha256 = ""  # hex SHA-256 of the header text, set by finish()

    @staticmethod
    def _header_bound(planned: list[PlannedTensor], metadata: dict[str, str] | None = None) -> int:
        """Length of the header if every offset had 20 digits, a padding entry preceded every tensor and
        no payload were a duplicate, plus 64. Computed piece by piece (the JSON text of 100,000s of tensors
        is never built), equal to ``len(json.dumps(...))`` of that worst case (tests check both agree)."""
        dumps = json.dumps
        big = 10**_OFFSET_DIGITS - 1
        value_base: dict[str, int] = {}  # dtype -> length of its entry value with an empty shape
        pad_value = len(_dumps({"dtype": "U8", "shape": [big], "data_offsets": [big, big]}))
        worst_meta = _dumps({"sha256": "0" * 64, "aliases": []})  # "blake3" and its hex have the same lengths
        meta_item = len(worst_meta) + 1  # + the ':' after the name
        meta_item_quotes = worst_meta.count('"')
        total = 2 + 2 * len(planned)  # braces; one comma per entry but the first (2n + 1 entries)
        inner, inner_escapes = 2 + max(0, len(planned) - 1), 0
        for i, t in enumerate(planned):
            name = dumps(t.st_name)
            base = value_base.get(t.st_dtype)
            if base is None:
                base = value_base[t.st_dtype] = len(
                    _dumps({"dtype": t.st_dtype, "shape": [], "data_offsets": [big, big]})
                )
            shape = sum(len(str(d)) for d in t.st_shape) + max(0, len(t.st_shape) - 1)
            total += len(name) + 1 + base + shape
            total += 2 + 7 + _OFFSET_DIGITS + len(str(i)) + 1 + pad_value  # "__pad__<big><i>":{...}
            inner += 2 * len(name) + meta_item
            inner_escapes += 2 * (name.count('"') + name.count("\\")) + meta_item_quotes
        # The metadata is a JSON string inside the JSON header: its quotes and backslashes get escaped.
        outer = inner + 2 + inner_escapes
        total += len('"__metadata__":') + len(_dumps({"format": "weightshare", METADATA_KEY: ""})) - 2 + outer
        total += sum(len(dumps(k)) + len(dumps(v)) + 2 for k, v in (metadata or {}).items())  # ,"k":"v"
        return total + 64

    def add(self, tensor: PlannedTensor, source: PayloadSource, progress: Progress | None = None) -> BlobEntry:
        if source.nbytes != tensor.nbytes:
            raise InvalidModel(f"tensor {tensor.name!r}: payload has {source.nbytes} bytes, expected {tensor.nbytes}")
        w = self.writer
        row, duplicate = w.add_row(source, progress=progress, min_align=tensor.min_align)
        if duplicate:
            self._aliases.setdefault(row, []).append(tensor.st_name)
        else:
            self._planned.append(tensor)
        return w.entry(row, duplicate)

    def adopt(
        self, tensor: PlannedTensor, offset: int, prefix: str = "", digest: str | None = None
    ) -> BlobEntry | None:
        """A payload the file already holds at ``offset`` (appended by another process: ``--prepack``'s ORT child):
        hashed where it is, not written. None when it cannot stay there (below a stored payload's end, or off its
        alignment): the caller places it as any other. Bytes equal to a stored payload's become that one's
        alias; theirs stay in the file, under a padding entry. ``prefix``: before its name (a zoo's model stem).
        ``digest``: the bytes' tagged digest, known (a copy of bytes hashed before): not read again."""
        w = self.writer
        align = max(w.policy.for_size(tensor.nbytes), tensor.min_align)
        if offset < w.end or offset % align:
            return None
        row, duplicate = w.adopt_row(offset, tensor.nbytes, align, digest)
        self.name_unplanned(tensor, prefix)
        if duplicate:
            self._aliases.setdefault(row, []).append(tensor.st_name)
        else:
            self._planned.append(tensor)
        return w.entry(row, duplicate)

    def name_unplanned(self, tensor: PlannedTensor, prefix: str = "") -> None:
        """Give a tensor the planned list did not hold (``adopt``, a payload copied in) a name of its own."""
        full = prefix + tensor.name
        name, n = full if full and not full.startswith("__") else f"tensor{full}", 1
        base = name
        while name in self._names:
            n += 1
            name = f"{base}#{n}"
        self._names.add(name)
        tensor.st_name = name
        tensor.st_dtype, tensor.st_shape = _safetensors_view(tensor)

    def alias(self, tensor: PlannedTensor, row: int, prefix: str = "") -> None:
        """Name ``tensor`` in the header as another name of the payload stored in the writer's ``row``."""
        self.name_unplanned(tensor, prefix)
        self._aliases.setdefault(row, []).append(tensor.st_name)

    def expect_duplicates(self) -> None:
        """``BlobFile``: a zoo's next model (``BlobWriter.expect_duplicates``)."""
        self.writer.expect_duplicates()

    def header_fits(self) -> bool:
        """Whether the header of what is stored now fits the room reserved before the data."""
        return sum(len(piece.encode()) for piece in self._header_pieces()) <= self.data_start - 8

    def place(self, payload: BlobPayload, progress: Progress | None = None) -> BlobEntry:
        """``_write.Container``: the payload under its planned tensor's name."""
        return self.add(payload.tensor, payload.source, progress)

    @property
    def _stored(self) -> list[_Stored]:
        """Every stored payload by row (offset order), with its tensor and aliases (built on demand; tests read it)."""
        w = self.writer
        return [_Stored(t, w.entry(row), self._aliases.get(row)) for row, t in enumerate(self._planned)]

    @property
    def bytes_in(self) -> int:
        return self.writer.bytes_in

    @property
    def bytes_written(self) -> int:
        return self.writer.bytes_written

    def header(self) -> bytes:
        """The safetensors header (without its length prefix and padding)."""
        return "".join(self._header_pieces()).encode()

    def _header_pieces(self) -> Iterator[str]:
        """The header's JSON text in pieces, the same characters as ``json.dumps`` (separators ``,`` and
        ``:``) of the equivalent dict, which tests check. Streamed so that 100,000s of tensors never hold
        the whole text (or a dict of it) in memory: payload entries first, then the metadata, whose value
        is a JSON string escaped piece by piece (JSON escaping is per character)."""
        dumps = json.dumps
        w, planned = self.writer, self._planned  # rows are in offset order
        yield "{"
        cursor = n_pad = 0
        for row, t in enumerate(planned):
            begin = w.offset(row) - self.data_start
            if begin > cursor:
                yield (
                    f'"__pad__{n_pad}":{{"dtype":"U8","shape":[{begin - cursor}],"data_offsets":[{cursor},{begin}]}},'
                )
            n_pad += 1
            cursor = begin + w.nbytes(row)
            shape = ",".join(str(int(d)) for d in t.st_shape)
            yield (
                f'{dumps(t.st_name)}:{{"dtype":{dumps(t.st_dtype)},"shape":[{shape}],'
                f'"data_offsets":[{begin},{cursor}]}},'
            )
        yield f'"__metadata__":{{"format":"weightshare",{dumps(METADATA_KEY)}:"{{'
        kind, first = dumps(w.digest), True
        for row, t in enumerate(planned):
            aliases = ",".join(dumps(a) for a in self._aliases.get(row, ()))
            meta = f'{dumps(t.st_name)}:{{{kind}:"{w.hexdigest(row)}","aliases":[{aliases}]}}'
            yield ("" if first else ",") + dumps(meta)[1:-1]
            first = False
        yield '}"'
        for key, value in self.metadata.items():
            yield f",{dumps(key)}:{dumps(value)}"
        yield "}}"

    def finish(self) -> int:
        """Write the header (length, JSON text, space padding up to the data) and fix the file length;
        return the file size."""
        room = self.data_start - 8
        pos, batch, size = 8, [], 0
        self._header_hash = hashlib.sha256()
        for piece in self._header_pieces():
            batch.append(piece)
            size += len(piece)
            if size >= 1 << 20:
                pos = self._write_header_text(batch, pos)
                batch, size = [], 0
        pos = self._write_header_text(batch, pos)
        spaces = b" " * min(1 << 20, self.data_start - pos)
        while pos < self.data_start:
            n = min(len(spaces), self.data_start - pos)
            self.writer.pwrite(spaces[:n], pos)
            pos += n
        self.writer.pwrite(room.to_bytes(8, "little"), 0)
        self.header_sha256 = self._header_hash.hexdigest()
        return self.writer.finish()

    def name_digest(self) -> str:
        """``BlobWriter``: the header's SHA-256 (it lists every payload's digest, dtype, shape and offset: equal
        digests, equal files), hashed as it was written by ``finish``."""
        return self.header_sha256

    def _write_header_text(self, batch: list[str], pos: int) -> int:
        data = "".join(batch).encode()
        self._header_hash.update(data)
        if pos + len(data) > self.data_start:  # the bound is computed from the same plan: a bug, not bad input
            raise OutputError(f"safetensors header outgrew its reserved {self.data_start - 8} bytes")
        self.writer.pwrite(data, pos)
        return pos + len(data)


HEADER_LIMIT = 100 << 20  # the largest safetensors header read (a blob of 200,000 tensors has ~40 MiB)


def read_header(fd: int, where: str | os.PathLike[str] | None = None) -> tuple[bytes, bytes]:
    """The safetensors header of the file open on ``fd``: (its 8-byte length prefix, its JSON text), read with
    pread (the fd's offset stays put). The one reader of that header: the blob checks, the ``--prepack`` record
    and the loader's verdict all read it here.

    Raises:
        InvalidModel: shorter than 8 bytes, or a header length past the end of the file or over ``HEADER_LIMIT``.
    """
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise InvalidModel("not a safetensors file (shorter than 8 bytes)", where)
    n = int.from_bytes(head, "little")
    text = os.pread(fd, n, 8) if n <= min(size - 8, HEADER_LIMIT) else b""
    if len(text) != n:
        raise InvalidModel(f"safetensors header length {n} runs past the end of the file", where)
    return head, text


def read_header_at(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """``read_header`` of the file at ``path``; OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return read_header(fd, path)
    finally:
        os.close(fd)


def read_safetensors_metadata(path: str) -> tuple[int, dict[str, Any], Any]:
    """Return (data_start, tensors, payload metadata) of a weightshare blob, reading only its header.

    Both are JSON as found in the file: ``tensors`` is an object, the payload metadata is not checked."""
    _head, text = read_header_at(path)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InvalidModel("safetensors header is not valid JSON", path) from None
    if not isinstance(header, dict):
        raise InvalidModel("safetensors header is not a JSON object", path)
    meta = header.pop("__metadata__", {}) or {}
    payloads = {}
    if isinstance(meta, dict) and METADATA_KEY in meta:
        try:
            payloads = json.loads(meta[METADATA_KEY])
        except (TypeError, json.JSONDecodeError):
            raise InvalidModel("weightshare payload metadata is not valid JSON", path) from None
    return 8 + len(text), header, payloads


def _open(
    fd: int, planned: list[PlannedTensor], policy: AlignPolicy, metadata: dict[str, str], prefixes: Sequence[str] | None
) -> SafetensorsBlob:
    return SafetensorsBlob(fd, planned, policy, metadata=metadata, prefixes=prefixes)


# The formats whose models reference a safetensors blob (ONNX external data, TFLite ExternalBuffer groups) declare it.
CONTAINER = BlobContainer(".safetensors", _open)
