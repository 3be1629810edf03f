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

from ..._flatbuffers import Reader
from ..._inputs import open_fd
from ..._tensors import FileRange
from ...errors import InvalidModel

FILE_IDENTIFIER = b"TFL3"
SCHEMA_VERSION = 3

# Field slots of the tables read here (tensorflow/lite/schema/schema.fbs).
MODEL_BUFFERS = 4
BUFFER_DATA, BUFFER_OFFSET, BUFFER_SIZE = 0, 1, 2

# Buffer.offset 1 is the converter's "not written yet" placeholder; real out-of-line data starts above it.
OFFSET_PLACEHOLDER = 1


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


def read_graph(r: Reader, mapping: mmap.mmap | memoryview) -> schema.ModelT:
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
def open_model(path: str, window: tuple[int, int] | None = None) -> Iterator[tuple[Reader, mmap.mmap | memoryview]]:
    """Open ``path`` for bounds-checked preads and map it read-only for the object API.

    Only the pages of the tables the object API reads are touched; payload bytes
    are never read through the mapping (``BufferRef.source`` preads them in chunks).
    ``window`` (offset, size): the flatbuffer is that byte range of the file (a stored zip member, read in place);
    the reader's positions, and ``BufferRef.file_offset``, are then relative to its start.
    """
    fd = open_fd(path)  # a model being converted: its held descriptor
    try:
        size = os.fstat(fd).st_size
        base, length = window if window is not None else (0, size)
        if base < 0 or length < 0 or base + length > size:
            raise InvalidModel(f"a flatbuffer at offset {base} ({length} bytes) runs past the end of the file", path)
        if length < 8:
            raise InvalidModel(f"truncated flatbuffer: the file has only {length} bytes", path)
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        if hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_RANDOM)  # no read-ahead into weights next to the tables
        view = mapping if window is None else memoryview(mapping)[base : base + length]
        yield Reader(fd, length, str(path), base=base), view
    finally:
        os.close(fd)
