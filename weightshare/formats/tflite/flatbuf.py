"""A bounds-checked scan of a TFLite flatbuffer that copies no payload.

The generated schema code (``ai_edge_litert.schema_py_generated``) trusts every
offset it reads, and its object API copies each ``Buffer.data`` vector into a
numpy array. So the buffers table, which holds the weights, is read here with
``pread``: each ``Buffer`` becomes a ``BufferRef`` that only says where its
bytes are. Every uoffset, vtable and vector length is checked against the file
size before it is followed, so a hostile or truncated file gives
``InvalidModel``, never a read past the end or an allocation sized by the file.

The rest of the model (graphs, operator codes, signatures: kilobytes) goes
through the schema's object API over a read-only mapping, with the buffers
hidden from it; any exception it raises on a malformed table becomes ``InvalidModel``.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ai_edge_litert import schema_py_generated as schema

from ..._tensors import FileRange
from ...errors import InvalidModel

FILE_IDENTIFIER = b"TFL3"
SCHEMA_VERSION = 3

# Field slots of the tables read here (tensorflow/lite/schema/schema.fbs).
MODEL_BUFFERS = 4
BUFFER_DATA, BUFFER_OFFSET, BUFFER_SIZE = 0, 1, 2

# Buffer.offset 1 is the converter's "not written yet" placeholder; real out-of-line data starts above it.
OFFSET_PLACEHOLDER = 1

_U16, _U32, _I32, _U64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<i"), struct.Struct("<Q")


class Reader:
    """Typed little-endian reads at absolute positions of a file, never past its end.

    Reads go through ``pread``, not the mapping: a data vector's length word sits
    right before its payload, and touching it through mmap maps the surrounding
    page-cache folio (up to a few MiB on current kernels) into our RSS.
    """

    def __init__(self, fd: int, size: int, path: str):
        self.fd = fd
        self.size = size
        self.path = path

    def need(self, pos: int, n: int, what: str) -> None:
        if pos < 0 or n < 0 or pos + n > self.size:
            raise InvalidModel(
                f"truncated or corrupt flatbuffer: {what} at offset {pos} ({n} bytes) runs past the end of the "
                f"file ({self.size} bytes)",
                self.path,
            )

    def read(self, pos: int, n: int, what: str) -> bytes:
        self.need(pos, n, what)
        data = os.pread(self.fd, n, pos)
        if len(data) != n:
            raise InvalidModel(f"file ended early while reading {what} at offset {pos}", self.path)
        return data

    def u16(self, pos: int, what: str) -> int:
        value: int = _U16.unpack(self.read(pos, 2, what))[0]
        return value

    def u32(self, pos: int, what: str) -> int:
        value: int = _U32.unpack(self.read(pos, 4, what))[0]
        return value

    def i32(self, pos: int, what: str) -> int:
        value: int = _I32.unpack(self.read(pos, 4, what))[0]
        return value

    def u64(self, pos: int, what: str) -> int:
        value: int = _U64.unpack(self.read(pos, 8, what))[0]
        return value

    def indirect(self, pos: int, what: str) -> int:
        """Follow the uoffset stored at ``pos``."""
        return pos + self.u32(pos, what)

    def table(self, pos: int, what: str) -> Table:
        vtable = pos - self.i32(pos, what)
        vt_size = self.u16(vtable, f"vtable of {what}")
        obj_size = self.u16(vtable + 2, f"vtable of {what}")
        if vt_size < 4 or vt_size % 2:
            raise InvalidModel(f"corrupt flatbuffer: vtable of {what} has impossible size {vt_size}", self.path)
        self.need(vtable, vt_size, f"vtable of {what}")
        self.need(pos, max(obj_size, 4), what)
        return Table(self, pos, vtable, vt_size, obj_size, what)

    def vector(self, pos: int, elem_size: int, what: str) -> tuple[int, int]:
        """Return (first element position, element count) of the vector referenced at ``pos``."""
        start = self.indirect(pos, what)
        count = self.u32(start, f"length of {what}")
        self.need(start + 4, count * elem_size, what)
        return start + 4, count


@dataclass(frozen=True)
class Table:
    reader: Reader
    pos: int
    vtable: int
    vt_size: int
    obj_size: int
    what: str

    def field(self, slot: int, width: int) -> int | None:
        """Absolute position of field ``slot`` (``width`` bytes), or None when absent."""
        entry = 4 + 2 * slot
        if entry + 2 > self.vt_size:
            return None
        off = self.reader.u16(self.vtable + entry, f"vtable of {self.what}")
        if off == 0:
            return None
        if off + width > self.obj_size:
            raise InvalidModel(
                f"corrupt flatbuffer: field {slot} of {self.what} lies outside its table", self.reader.path
            )
        return self.pos + off

    def u64(self, slot: int, default: int = 0) -> int:
        pos = self.field(slot, 8)
        return default if pos is None else self.reader.u64(pos, self.what)


@dataclass(frozen=True)
class BufferRef:
    """Where one ``Model.buffers[i]`` keeps its bytes in the input file (nothing is read)."""

    index: int
    file_offset: int  # absolute position of the first payload byte
    nbytes: int
    out_of_line: bool  # True when the input already used Buffer.offset/size

    def source(self, path: str) -> FileRange:
        return FileRange(path, self.file_offset, self.nbytes)


def read_buffer_refs(r: Reader) -> list[BufferRef]:
    """Locate every buffer's payload, checking each against the file size."""
    root = r.table(r.indirect(0, "root table offset"), "Model")
    pos = root.field(MODEL_BUFFERS, 4)
    if pos is None:
        return []
    first, count = r.vector(pos, 4, "Model.buffers")
    refs = []
    for i in range(count):
        what = f"buffer {i}"
        t = r.table(r.indirect(first + 4 * i, what), what)
        offset, size = t.u64(BUFFER_OFFSET), t.u64(BUFFER_SIZE)
        data = t.field(BUFFER_DATA, 4)
        if data is not None:  # LiteRT's InterpreterBuilder reads a present data vector first, offset or not
            start, n = r.vector(data, 1, f"{what} data")
            refs.append(BufferRef(i, start, n, False))
        elif offset > OFFSET_PLACEHOLDER:
            if offset + size > r.size:
                raise InvalidModel(
                    f"{what}: data at offset {offset} with size {size} runs past the end of the file ({r.size} bytes)",
                    r.path,
                )
            refs.append(BufferRef(i, offset, size, True))
        elif offset == OFFSET_PLACEHOLDER and size:
            raise InvalidModel(f"{what}: offset is the converter's placeholder 1, the data was never written", r.path)
        else:
            refs.append(BufferRef(i, 0, 0, False))
    return refs


class _WithoutBuffers:
    """Shows the schema's ``ModelT`` a Model whose buffers vector is absent, so no payload is copied."""

    def __init__(self, model: schema.Model) -> None:
        self._model = model

    def __getattr__(self, name: str) -> object:
        return getattr(self._model, name)

    def BuffersIsNone(self) -> bool:
        return True


# What the generated accessors raise when a table points outside the file.
_MALFORMED = (
    IndexError,
    struct.error,
    ValueError,
    TypeError,
    OverflowError,
    UnicodeDecodeError,
    AttributeError,
    RecursionError,
)


def check_header(r: Reader) -> None:
    if r.read(4, 4, "file identifier") != FILE_IDENTIFIER:
        raise InvalidModel("not a TFLite flatbuffer (no TFL3 identifier)", r.path)


def read_graph(r: Reader, mapping: mmap.mmap) -> schema.ModelT:
    """The model without its buffers: the schema object API over the mapped file."""
    try:
        model = schema.Model.GetRootAs(mapping, 0)
        graph = schema.ModelT.InitFromObj(_WithoutBuffers(model))
    except _MALFORMED as e:
        raise InvalidModel(
            f"corrupt flatbuffer: a table points outside the file ({type(e).__name__})", r.path
        ) from None
    if graph.version != SCHEMA_VERSION:
        raise InvalidModel(f"schema version {graph.version} is not {SCHEMA_VERSION}", r.path)
    return graph


@contextmanager
def open_model(path: str) -> Iterator[tuple[Reader, mmap.mmap]]:
    """Open ``path`` for bounds-checked preads and map it read-only for the object API.

    Only the pages of the tables the object API reads are touched; payload bytes
    are never read through the mapping (``BufferRef.source`` preads them in chunks).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise InvalidModel(f"truncated flatbuffer: the file has only {size} bytes", path)
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        if hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_RANDOM)  # no read-ahead into weights next to the tables
        yield Reader(fd, size, str(path)), mapping
    finally:
        os.close(fd)
