"""A bounds-checked reader of ExecuTorch's ``.pte`` (Program) and ``.ptd`` (FlatTensor) files that copies no payload.

ExecuTorch ships no Python reader that checks offsets (``exir._serialize`` converts the whole flatbuffer to JSON
with ``flatc``, and needs torch). The tables here are read with ``pread`` at absolute positions: every uoffset,
vtable and vector length is checked against the file size before it is followed, so a hostile or truncated file
gives ``InvalidModel``, never a read past the end or an allocation sized by the file. Payloads are only located
(``Segment``, ``Subsegment``, ``InlineData``), never read.

Layouts (pytorch/executorch: ``schema/program.fbs``, ``schema/extended_header.cpp``,
``extension/flat_tensor/serialize/flat_tensor.fbs``, ``flat_tensor_header.cpp``):

- ``.pte``: a flatbuffer with identifier ``ET12`` (bytes 4..8); at byte 8 an extended header ``eh00``, u32 length,
  u64 program_size, u64 segment_base_offset[, u64 segment_data_size]; segments (``Program.segments``: offset
  relative to segment_base_offset, size) after the flatbuffer.
- ``.ptd``: identifier ``FT01``; at byte 8 ``FH01``, u32 length, u64 flatbuffer_offset, u64 flatbuffer_size,
  u64 segment_base_offset, u64 segment_data_size; ``FlatTensor.segments`` relative to segment_base_offset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..._flatbuffers import Reader, Table
from ...errors import InvalidModel

PTE_IDENTIFIER = b"ET12"
PTD_IDENTIFIER = b"FT01"
PTE_HEADER_MAGIC = b"eh00"
PTD_HEADER_MAGIC = b"FH01"
HEADER_OFFSET = 8  # both extended headers start after the root offset and the file identifier

# Field slots (the order of the fields in the schemas).
PROGRAM_VERSION, PROGRAM_PLANS, PROGRAM_CONSTANT_BUFFER, PROGRAM_DELEGATE_DATA = 0, 1, 2, 3
PROGRAM_SEGMENTS, PROGRAM_CONSTANT_SEGMENT, PROGRAM_MUTABLE_SEGMENTS, PROGRAM_NAMED_DATA = 4, 5, 6, 7
PLAN_NAME, PLAN_VALUES, PLAN_DELEGATES, PLAN_BUFFER_SIZES = 0, 2, 7, 8
DELEGATE_ID, DELEGATE_PROCESSED = 0, 1
REF_LOCATION, REF_INDEX = 0, 1
SEGMENT_OFFSET, SEGMENT_SIZE = 0, 1
SUBSEGMENT_INDEX, SUBSEGMENT_OFFSETS = 0, 1
NAMED_KEY, NAMED_SEGMENT, NAMED_LAYOUT = 0, 1, 2
FLAT_VERSION, FLAT_SEGMENTS, FLAT_NAMED_DATA = 0, 1, 2
LAYOUT_SCALAR_TYPE, LAYOUT_SIZES = 0, 1
EVALUE_TYPE, EVALUE_VAL = 0, 1
TENSOR_SCALAR_TYPE, TENSOR_SIZES, TENSOR_BUFFER_IDX, TENSOR_ALLOCATION, TENSOR_EXTRA = 0, 2, 5, 6, 9
EXTRA_FQN, EXTRA_LOCATION = 1, 2
KERNEL_TYPE_TENSOR = 5  # KernelTypes union: NONE = 0, Null, Int, Bool, Double, Tensor, ...
DATA_LOCATION_SEGMENT = 1  # BackendDelegateDataReference.location: INLINE = 0, SEGMENT = 1
TENSOR_LOCATION_EXTERNAL = 1  # ExtraTensorInfo.location: SEGMENT = 0, EXTERNAL = 1

# schema/scalar_type.fbs -> numpy-style dtype names.
SCALAR_TYPES = {
    0: "uint8",
    1: "int8",
    2: "int16",
    3: "int32",
    4: "int64",
    5: "float16",
    6: "float32",
    7: "float64",
    11: "bool",
    12: "qint8",
    13: "quint8",
    14: "qint32",
    15: "bfloat16",
    16: "quint4x2",
    17: "quint2x4",
    22: "bits16",
    23: "float8_e5m2",
    24: "float8_e4m3fn",
    25: "float8_e5m2fnuz",
    26: "float8_e4m3fnuz",
    27: "uint16",
    28: "uint32",
    29: "uint64",
}

# A Program with more entries than this is refused rather than walked (a hostile count costs time, not memory,
# since every element is bounds-checked first; real programs have thousands).
MAX_ENTRIES = 1 << 22


@dataclass(frozen=True)
class Segment:
    """One ``DataSegment``: where its bytes are and where its ``offset`` field sits (None: absent, i.e. 0)."""

    index: int
    file_offset: int  # absolute: segment_base_offset + offset
    nbytes: int
    offset_field: int | None
    size_field: int | None


@dataclass(frozen=True)
class NamedData:
    key: str
    segment: int
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class InlineData:
    """A byte vector inside the flatbuffer (an old-style ``constant_buffer`` entry or inline delegate data)."""

    what: str
    file_offset: int
    nbytes: int


@dataclass(frozen=True)
class Delegate:
    plan: str
    backend: str
    inline: bool  # processed data inline in the flatbuffer (else in a segment)
    index: int  # into backend_delegate_data or Program.segments


@dataclass(frozen=True)
class ConstantTensor:
    """A constant tensor of an execution plan: where its bytes are named from."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    buffer_index: int  # into constant_buffer or constant_segment.offsets; 0 when external
    external_key: str  # its key in a .ptd (``ExtraTensorInfo.fully_qualified_name``) when external


@dataclass
class Program:
    """What a ``.pte`` holds, located; nothing of its payloads is read."""

    path: str
    file_size: int
    program_size: int  # bytes of the flatbuffer (the header's program_size; the file size without segments)
    segment_base: int
    header_pos: int  # where the extended header's segment_base_offset field is (to rewrite it)
    segment_data_size_pos: int | None
    version: int
    plans: list[str] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    constant_segment: int | None = None  # index into segments
    constant_offsets: list[int] = field(default_factory=list)
    constant_offsets_pos: int = 0  # absolute position of constant_segment.offsets[0]
    constant_buffers: list[InlineData] = field(default_factory=list)
    delegate_data: list[InlineData] = field(default_factory=list)
    delegates: list[Delegate] = field(default_factory=list)
    named_data: list[NamedData] = field(default_factory=list)
    mutable_segments: list[int] = field(default_factory=list)
    constants: list[ConstantTensor] = field(default_factory=list)
    planned_bytes: dict[str, int] = field(default_factory=dict)  # plan -> memory-planned buffers (activations)


@dataclass
class DataFile:
    """What a ``.ptd`` holds, located."""

    path: str
    file_size: int
    flatbuffer_offset: int
    flatbuffer_size: int
    segment_base: int
    header_pos: int  # position of the header's segment_base_offset field
    version: int
    segments: list[Segment] = field(default_factory=list)
    named_data: list[NamedData] = field(default_factory=list)


def kind_of(head: bytes) -> str:
    """ "pte", "ptd" or "" from a file's first 8 bytes."""
    if len(head) >= 8 and head[4:8] == PTE_IDENTIFIER:
        return "pte"
    if len(head) >= 8 and head[4:8] == PTD_IDENTIFIER:
        return "ptd"
    return ""


def _segments(r: Reader, root: Table, slot: int, base: int, end: int, what: str) -> list[Segment]:
    out = []
    for i, t in enumerate(root.tables(slot, what)):
        offset, size = t.u64(SEGMENT_OFFSET), t.u64(SEGMENT_SIZE)
        pos = base + offset
        if offset > end or size > end or pos + size > end:
            raise InvalidModel(
                f"{what}[{i}]: {size} bytes at offset {offset} from the segment base {base} run past the end of "
                f"the file ({end} bytes)",
                r.path,
            )
        out.append(Segment(i, pos, size, t.field(SEGMENT_OFFSET, 8), t.field(SEGMENT_SIZE, 8)))
    return out


def _named(table: Table, count: int, what: str, path: str) -> NamedData:
    key = table.string(NAMED_KEY, f"{what} key")
    seg = table.u32(NAMED_SEGMENT)
    if seg >= count:
        raise InvalidModel(f"{what} {key!r} names segment {seg}, but there are {count}", path)
    dtype, shape = "uint8", tuple[int, ...]()
    layout = table.sub(NAMED_LAYOUT, f"{what} layout")
    if layout is not None:
        dtype = SCALAR_TYPES.get(layout.u8(LAYOUT_SCALAR_TYPE), "uint8")
        shape = tuple(layout.scalars(LAYOUT_SIZES, "i", f"{what} sizes"))
    return NamedData(key, seg, dtype, shape)


def _reader(fd: int, path: str, what: str, minimum: int, identifier: bytes) -> tuple[Reader, int]:
    """A reader over the whole file and its size, once the size and the file identifier say it is an ExecuTorch
    ``what`` (a ``.pte`` program or a ``.ptd`` data file): ``InvalidModel`` naming which check failed."""
    size = os.fstat(fd).st_size
    r = Reader(fd, size, path, MAX_ENTRIES)
    if size < minimum:
        raise InvalidModel(f"truncated ExecuTorch {what}: the file has only {size} bytes", path)
    if r.read(4, 4, "file identifier") != identifier:
        raise InvalidModel(f"not an ExecuTorch {what} (no {identifier.decode()} identifier)", path)
    return r, size


def read_program(fd: int, path: str) -> Program:
    """Locate everything a ``.pte`` holds; ``InvalidModel`` for anything out of bounds."""
    r, size = _reader(fd, path, "program", 32, PTE_IDENTIFIER)
    program_size, segment_base, data_size_pos = size, size, None
    header_pos = 0
    if r.read(HEADER_OFFSET, 4, "extended header") == PTE_HEADER_MAGIC:
        length = r.u32(HEADER_OFFSET + 4, "extended header length")
        if length < 24:
            raise InvalidModel(f"extended header length {length} < 24", path)
        program_size = r.u64(HEADER_OFFSET + 8, "program_size")
        header_pos = HEADER_OFFSET + 16
        segment_base = r.u64(header_pos, "segment_base_offset")
        if length >= 32:
            data_size_pos = HEADER_OFFSET + 24
        if program_size > size or segment_base > size or (segment_base and segment_base < program_size):
            raise InvalidModel(
                f"extended header: program_size {program_size} / segment_base_offset {segment_base} do not fit the "
                f"file ({size} bytes)",
                path,
            )
    # Tables of the flatbuffer must lie inside it, not in the segments after it.
    fr = Reader(fd, program_size, path, MAX_ENTRIES)
    root = fr.table(fr.indirect(0, "root table offset"), "Program")
    prog = Program(path, size, program_size, segment_base, header_pos, data_size_pos, root.u32(PROGRAM_VERSION))
    prog.segments = _segments(r, root, PROGRAM_SEGMENTS, segment_base, size, "Program.segments")
    if any(s.nbytes for s in prog.segments) and not header_pos:
        # the exporter omits the header when every segment is empty (external_constants=True, all in a .ptd)
        raise InvalidModel("the program has segments but no extended header locating them", path)
    for i, buf in enumerate(root.tables(PROGRAM_CONSTANT_BUFFER, "Program.constant_buffer")):
        pos = buf.field(0, 4)
        if pos is not None:
            start, n = fr.vector(pos, 1, f"constant_buffer[{i}]")
            prog.constant_buffers.append(InlineData(f"constant_buffer[{i}]", start, n))
        else:
            prog.constant_buffers.append(InlineData(f"constant_buffer[{i}]", 0, 0))
    for i, blob in enumerate(root.tables(PROGRAM_DELEGATE_DATA, "Program.backend_delegate_data")):
        pos = blob.field(0, 4)
        start, n = fr.vector(pos, 1, f"backend_delegate_data[{i}]") if pos is not None else (0, 0)
        prog.delegate_data.append(InlineData(f"backend_delegate_data[{i}]", start, n))
    cs = root.sub(PROGRAM_CONSTANT_SEGMENT, "Program.constant_segment")
    if cs is not None:
        seg = cs.u32(SUBSEGMENT_INDEX)
        offsets = cs.scalars(SUBSEGMENT_OFFSETS, "Q", "constant_segment.offsets")
        if offsets:
            if seg >= len(prog.segments):
                raise InvalidModel(f"constant_segment names segment {seg}, but there are {len(prog.segments)}", path)
            limit = prog.segments[seg].nbytes
            if any(o > limit for o in offsets) or any(b < a for a, b in zip(offsets, offsets[1:])):
                raise InvalidModel("constant_segment.offsets are not ascending inside their segment", path)
            prog.constant_segment = seg
            prog.constant_offsets = offsets
            pos = cs.field(SUBSEGMENT_OFFSETS, 4)
            assert pos is not None  # offsets were read from it
            prog.constant_offsets_pos = fr.indirect(pos, "constant_segment.offsets") + 4
    for t in root.tables(PROGRAM_MUTABLE_SEGMENTS, "Program.mutable_data_segments"):
        prog.mutable_segments.append(t.u32(SUBSEGMENT_INDEX))
    prog.named_data = [
        _named(t, len(prog.segments), "named_data", path) for t in root.tables(PROGRAM_NAMED_DATA, "Program.named_data")
    ]
    for plan in root.tables(PROGRAM_PLANS, "Program.execution_plan"):
        name = plan.string(PLAN_NAME, "ExecutionPlan.name")
        prog.plans.append(name)
        for d in plan.tables(PLAN_DELEGATES, f"{name}.delegates"):
            ref = d.sub(DELEGATE_PROCESSED, f"{name} delegate processed")
            inline = ref is None or ref.u8(REF_LOCATION) != DATA_LOCATION_SEGMENT
            index = 0 if ref is None else ref.u32(REF_INDEX)
            limit = len(prog.delegate_data) if inline else len(prog.segments)
            if ref is not None and index >= limit:
                raise InvalidModel(f"a delegate of {name!r} names data {index}, but there are {limit}", path)
            prog.delegates.append(Delegate(name, d.string(DELEGATE_ID, "BackendDelegate.id"), inline, index))
        prog.constants.extend(_constants(plan, name))
        sizes = plan.scalars(PLAN_BUFFER_SIZES, "q", f"{name}.non_const_buffer_sizes")
        prog.planned_bytes[name] = sum(max(n, 0) for n in sizes)
    return prog


def _constants(plan: Table, plan_name: str) -> list[ConstantTensor]:
    """The constant tensors of a plan (no allocation_info, a data buffer or an external key)."""
    out = []
    for i, ev in enumerate(plan.tables(PLAN_VALUES, f"{plan_name}.values")):
        if ev.u8(EVALUE_TYPE) != KERNEL_TYPE_TENSOR:
            continue
        t = ev.sub(EVALUE_VAL, f"{plan_name}.values[{i}]")
        if t is None or t.field(TENSOR_ALLOCATION, 4) is not None:
            continue
        extra = t.sub(TENSOR_EXTRA, f"{plan_name}.values[{i}] extra info")
        fqn = extra.string(EXTRA_FQN, "fully_qualified_name") if extra is not None else ""
        external = extra is not None and extra.u8(EXTRA_LOCATION) == TENSOR_LOCATION_EXTERNAL
        idx = t.u32(TENSOR_BUFFER_IDX)
        if not idx and not external:
            continue
        dtype = SCALAR_TYPES.get(t.u8(TENSOR_SCALAR_TYPE), "uint8")
        shape = tuple(t.scalars(TENSOR_SIZES, "i", "Tensor.sizes"))
        out.append(
            ConstantTensor(
                fqn or f"{plan_name}/value{i}", dtype, shape, 0 if external else idx, fqn if external else ""
            )
        )
    return out


def read_data_file(fd: int, path: str) -> DataFile:
    """Locate everything a ``.ptd`` holds."""
    r, size = _reader(fd, path, "data file", 48, PTD_IDENTIFIER)
    if r.read(HEADER_OFFSET, 4, "FlatTensor header") != PTD_HEADER_MAGIC:
        raise InvalidModel("not an ExecuTorch data file (no FH01 header)", path)
    length = r.u32(HEADER_OFFSET + 4, "FlatTensor header length")
    if length < 40:
        raise InvalidModel(f"FlatTensor header length {length} < 40", path)
    fb_offset = r.u64(HEADER_OFFSET + 8, "flatbuffer_offset")
    fb_size = r.u64(HEADER_OFFSET + 16, "flatbuffer_size")
    header_pos = HEADER_OFFSET + 24
    base = r.u64(header_pos, "segment_base_offset")
    if fb_offset > size or fb_size > size - fb_offset or base > size:
        raise InvalidModel(
            f"FlatTensor header: flatbuffer {fb_size} bytes at {fb_offset}, segments at {base}, do not fit the file "
            f"({size} bytes)",
            path,
        )
    # The runtime reads the FlatTensor root from the start of the file (offset 0 is the root uoffset).
    fr = Reader(fd, fb_offset + fb_size, path, MAX_ENTRIES)
    root = fr.table(fr.indirect(0, "root table offset"), "FlatTensor")
    data = DataFile(path, size, fb_offset, fb_size, base, header_pos, root.u32(FLAT_VERSION))
    data.segments = _segments(r, root, FLAT_SEGMENTS, base, size, "FlatTensor.segments")
    data.named_data = [
        _named(t, len(data.segments), "FlatTensor.named_data", path)
        for t in root.tables(FLAT_NAMED_DATA, "FlatTensor.named_data")
    ]
    return data


XNNPACK_HEADER_MAGIC = b"XH00"  # XNNPACKHeader at byte 4 of an XNNPACK delegate blob (xnnpack_graph_serialize.py)
XNN_GRAPH_CONSTANT_DATA = 8  # XNNGraph.constant_data: [ConstantDataOffset] (backends/xnnpack/serialization/schema.fbs)
CONSTANT_DATA_NAMED_KEY = 2  # ConstantDataOffset.named_key


def xnnpack_keys(fd: int, pos: int, nbytes: int, path: str) -> list[str] | None:
    """The named-data keys an XNNPACK delegate blob at ``pos`` reads (``ConstantDataOffset.named_key``); None when
    the blob has no XNNPACK header (another backend, or a layout this reader does not know).

    The blob: 4 bytes, ``XH00``, u16 header length, u32 flatbuffer offset, u32 flatbuffer size, u32 constant data
    offset, u64 constant data size; the ``XNNGraph`` flatbuffer at that offset, inside the blob."""
    if nbytes < 22:
        return None
    r = Reader(fd, pos + nbytes, path, MAX_ENTRIES)
    if r.read(pos + 4, 4, "XNNPACK header") != XNNPACK_HEADER_MAGIC:
        return None
    fb_offset = r.u32(pos + 10, "XNNPACK flatbuffer offset")
    fb_size = r.u32(pos + 14, "XNNPACK flatbuffer size")
    if fb_offset > nbytes or fb_size > nbytes - fb_offset:
        raise InvalidModel(f"XNNPACK delegate blob: flatbuffer of {fb_size} bytes at {fb_offset} runs past it", path)
    fr = Reader(fd, pos + fb_offset + fb_size, path, MAX_ENTRIES)
    root = fr.table(fr.indirect(pos + fb_offset, "XNNGraph root offset"), "XNNGraph")
    keys = []
    for t in root.tables(XNN_GRAPH_CONSTANT_DATA, "XNNGraph.constant_data"):
        key = t.string(CONSTANT_DATA_NAMED_KEY, "ConstantDataOffset.named_key")
        if key:
            keys.append(key)
    return keys
