"""scan: find every tensor payload of an ONNX model without parsing it whole.

The walk follows ModelProto at the wire level: graph initializers and sparse
initializers, ``Constant`` and other tensor-valued node attributes, subgraphs of
If/Loop/Scan at any depth, model-local functions and training graphs. Each
payload becomes a ``TensorRef`` (where its bytes are, in which encoding) and is
cut out of the model; what remains is the *skeleton*, small enough to parse with
onnx. Every cut tensor is marked in the skeleton with an ``external_data`` entry
``weightshare.ref = <index>`` so the emitter can find it again.
"""

from __future__ import annotations

import os
import re
from array import array
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import overload

from ..._paths import external_data_roots, model_dir, resolve_inside
from ..._recorded import CheckedSource, recorded_payloads
from ..._tensors import ConcatSource, FileRange, InputFile, PayloadSource, open_input
from ...errors import InvalidModel, Unsupported
from . import dtypes
from .wire import (
    LEN,
    VARINT,
    Field,
    PackedVarintSource,
    WireFile,
    decode_varints,
    encode_len_field,
    encode_varint,
    encode_varint_field,
)

REF_KEY = "weightshare.ref"
MAX_DEPTH = 200  # message nesting; a subgraph costs 3 levels (Graph > Node > Attribute)
EXTERNAL = 1

# Which length-delimited fields of each message kind can (transitively) hold tensors.
_CHILDREN = {
    "model": {7: "graph", 20: "training", 25: "function"},
    "training": {1: "graph", 2: "graph"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "function": {7: "node"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
}


class TensorRef:
    """One payload found by the scan: a view of row ``index`` of a ``RefTable``, made when asked for.

    The table keeps every payload's facts in flat arrays (about 80 bytes a tensor); a TensorRef, its
    ``parts`` and its ``name`` exist only while a caller holds them (200,000 payloads).
    """

    __slots__ = ("index", "table")

    def __init__(self, table: RefTable, index: int):
        self.table, self.index = table, index

    @property
    def name(self) -> str:
        return self.table.name(self.index)

    @property
    def data_type(self) -> int:
        return self.table.data_types[self.index]

    @property
    def dims(self) -> tuple[int, ...]:
        return self.table.dims(self.index)

    @property
    def field(self) -> int:  # dtypes.RAW_DATA, a typed field number, or 0 when it was external data
        return self.table.fields[self.index]

    @property
    def parts(self) -> list[FileRange]:  # the payload bytes (packed field contents, raw bytes or the external range)
        return self.table.parts(self.index)

    @property
    def wire(self) -> list[tuple[int, int]]:  # whole payload fields in the model file
        return self.table.wire(self.index)

    @property
    def path(self) -> str:
        return self.table.path

    @property
    def recorded_digest(self) -> str | None:  # the digest weightshare recorded for these bytes, when it wrote them
        return self.table.recorded.get(self.index)

    @property
    def nbytes_in(self) -> int:
        return self.table.nbytes_in(self.index)

    @property
    def typed(self) -> bool:
        return self.field not in (0, dtypes.RAW_DATA)

    @property
    def native_nbytes(self) -> int:
        return dtypes.raw_nbytes(self.data_type, self.dims)

    def native_source(self) -> PayloadSource:
        """The payload as raw little-endian bytes, the form external data and raw_data hold."""
        parts = self.parts
        inner: PayloadSource = ConcatSource(parts) if len(parts) != 1 else parts[0]
        recorded = self.recorded_digest
        if recorded is not None:
            inner = CheckedSource(inner, recorded, self.name, parts[0].path)
        if not self.typed:
            return inner
        layout = dtypes.typed_layout(self.field, self.data_type, self.dims)
        assert layout is not None, "the scan keeps only typed fields whose layout is valid"
        kind, count, itemsize = layout
        if kind == "copy":
            return inner
        return PackedVarintSource(inner, count, itemsize, self.path, boolean=self.data_type == dtypes.BOOL)


class RefTable(Sequence["TensorRef"]):
    """Every payload the scan found, column by column (memory small in the number of tensors).

    A row is a data type, a field number, its dims (a slice of one flat array), one byte range of an input
    file and one wire range in the model, and where its name lies in the model file: about 80 bytes,
    against about 1 KB for a TensorRef object with its FileRange, lists, tuple and name. The rare rest
    (payloads split over several fields, recorded digests, names of a model read without a kept fd)
    lives in small dicts. ``table[i]`` is a ``TensorRef`` view of row i.
    """

    def __init__(self, path: str, model_file: InputFile | None):
        self.path = path
        self.model_file = model_file  # names are read back from the model through it
        self.data_types = array("H")
        self.fields = array("B")
        self._dims_end = array("q")
        self._dims = array("q")
        self._file = array("I")  # index into self._files
        self._offset = array("q")
        self._length = array("q")
        self._wire = array("q")  # start, end of the payload field in the model (0, 0 for external data)
        self._name = array("q")  # offset, length of the name's bytes in the model file
        self._files: list[tuple[str, InputFile | None]] = []
        self._file_ids: dict[tuple[str, int], int] = {}
        self._multi: dict[int, tuple[list[FileRange], list[tuple[int, int]]]] = {}  # several payload fields
        self._names: dict[int, str] = {}  # names when there is no kept model fd to read them back from
        self.recorded: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.fields)

    @overload
    def __getitem__(self, index: int) -> TensorRef: ...

    @overload
    def __getitem__(self, index: slice) -> list[TensorRef]: ...

    def __getitem__(self, index: int | slice) -> TensorRef | list[TensorRef]:
        if isinstance(index, slice):
            return [TensorRef(self, i) for i in range(len(self))[index]]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return TensorRef(self, index)

    def __iter__(self) -> Iterator[TensorRef]:
        return (TensorRef(self, i) for i in range(len(self)))

    def append(
        self,
        data_type: int,
        dims: tuple[int, ...],
        field: int,
        parts: list[FileRange],
        wire: list[tuple[int, int]],
        name: str,
        name_range: tuple[int, int] | None,
    ) -> TensorRef:
        index = len(self.fields)
        self.data_types.append(data_type)
        self.fields.append(field)
        self._dims.extend(dims)
        self._dims_end.append(len(self._dims))
        if len(parts) == 1 and len(wire) <= 1:
            part = parts[0]
            key = (part.path, id(part.file))
            fid = self._file_ids.get(key)
            if fid is None:
                fid = self._file_ids[key] = len(self._files)
                self._files.append((part.path, part.file))
            self._file.append(fid)
            self._offset.append(part.offset)
            self._length.append(part.length)
            self._wire.extend(wire[0] if wire else (0, 0))
        else:
            self._multi[index] = (list(parts), list(wire))
            self._file.append(0)
            self._offset.append(0)
            self._length.append(sum(p.length for p in parts))
            self._wire.extend((0, 0))
        if name_range is not None and self.model_file is not None:
            self._name.extend(name_range)
        else:
            self._name.extend((0, -1))
            if name:
                self._names[index] = name
        return TensorRef(self, index)

    def name(self, index: int) -> str:
        start, length = self._name[2 * index], self._name[2 * index + 1]
        if length < 0:
            return self._names.get(index, "")
        assert self.model_file is not None
        data = os.pread(self.model_file.fd, length, start)  # read by the scan already: within the file
        return data.decode("utf-8", "replace")

    def dims(self, index: int) -> tuple[int, ...]:
        start = self._dims_end[index - 1] if index else 0
        return tuple(self._dims[start : self._dims_end[index]])

    def source_files(self) -> list[str]:
        """Every file a payload is read from (the model and its external-data files)."""
        return [path for path, _file in self._files]

    def parts(self, index: int) -> list[FileRange]:
        multi = self._multi.get(index)
        if multi is not None:
            return list(multi[0])
        path, file = self._files[self._file[index]]
        return [FileRange(path, self._offset[index], self._length[index], file)]

    def wire(self, index: int) -> list[tuple[int, int]]:
        multi = self._multi.get(index)
        if multi is not None:
            return list(multi[1])
        start, end = self._wire[2 * index], self._wire[2 * index + 1]
        return [(start, end)] if end else []

    def nbytes_in(self, index: int) -> int:
        return self._length[index]


class Scanner:
    def __init__(
        self,
        wf: WireFile,
        model_dir: Path,
        model_file: InputFile | None = None,
        roots: tuple[Path, ...] | None = None,
    ):
        self.wf = wf
        self.model_dir = model_dir  # the given path's directory: where ONNX Runtime opens external data
        self.roots = roots or (model_dir,)  # where that data may resolve to (external_data_roots)
        self.model_file = model_file  # payloads inside the model are read through this fd, not by name
        self.refs = RefTable(wf.path, model_file)
        self._external: dict[str, InputFile] = {}  # each external file opened (and checked) once
        self._digests: dict[str, dict[tuple[int, int], str]] = {}

    def _recorded(self, path: str) -> dict[tuple[int, int], str]:
        if path not in self._digests:  # one header read per external file
            self._digests[path] = recorded_payloads(path)
        return self._digests[path]

    def scan(self) -> bytes:
        """Return the skeleton (the model with payloads cut out); fills ``self.refs``."""
        if self.wf.size == 0:
            raise self.wf.error("empty file")
        try:
            new = self._message(0, self.wf.size, "model", 0)
        except InvalidModel as e:
            # Every ModelProto that ONNX Runtime loads starts with its ir_version (field 1, tag byte 0x08; fields
            # are written in number order): a file that fails to parse and does not start so is another kind of file.
            if self.wf.read(0, 1) != b"\x08":
                raise self.wf.error(f"not an ONNX model ({e.message})") from None
            raise
        return bytes(new) if new is not None else self.wf.read(0, self.wf.size)

    def _message(self, start: int, end: int, kind: str, depth: int) -> bytes | bytearray | None:
        """Rewritten content of a message, or None when it holds no payload (copy it as it is)."""
        if depth > MAX_DEPTH:
            raise self.wf.error(f"messages nested deeper than {MAX_DEPTH} levels at offset {start}")
        if kind == "tensor":
            return self._tensor(start, end)
        children = _CHILDREN[kind]
        out: bytearray | None = None  # one growing buffer, not a list of 100,000s of pieces
        copy_from = start
        for f in self.wf.fields(start, end):
            child = children.get(f.number)
            if child is None or f.wire_type != LEN:
                continue
            new = self._message(f.value_start, f.end, child, depth + 1)
            if new is None:
                continue
            if out is None:
                out = bytearray()
            out += self.wf.read(copy_from, f.start - copy_from)
            out += encode_varint(f.number << 3 | LEN)
            out += encode_varint(len(new))
            out += new
            copy_from = f.end
        if out is None:
            return None
        out += self.wf.read(copy_from, end - copy_from)
        return out

    def _tensor(self, start: int, end: int) -> bytes | None:
        wf = self.wf
        dims: list[int] = []
        data_type = 0
        name = ""
        name_range = None
        payload: list[Field] = []
        external: dict[str, str] = {}
        location = 0
        kept: list[bytes] = []
        for f in wf.fields(start, end):
            n = f.number
            if n == 1:
                dims.extend(self._dims(f))
            elif n == 2 and f.wire_type == VARINT:
                data_type = f.value
            elif n == 8 and f.wire_type == LEN:
                name = wf.read(f.value_start, f.value).decode("utf-8", "replace")
                name_range = (f.value_start, f.value)
            elif n == 3:
                raise Unsupported(f"tensor {name!r} uses segments, which weightshare does not handle", wf.path)
            elif n == dtypes.RAW_DATA or n in dtypes.TYPED_FIELDS:
                if f.wire_type != LEN:
                    raise Unsupported(
                        f"tensor {name!r} stores {dtypes.TYPED_FIELDS.get(n, 'raw_data')} unpacked; "
                        "re-save the model with onnx to pack it",
                        wf.path,
                    )
                payload.append(f)
                continue
            elif n == 13 and f.wire_type == LEN:
                key, value = self._string_pair(f)
                if key == "location" and "location" in external:
                    raise InvalidModel(f"tensor {name!r} has two external data locations", wf.path)
                external[key] = value  # a repeated offset or length: the last one counts, as in ORT
                continue
            elif n == 14 and f.wire_type == VARINT:
                location = f.value
                continue
            kept.append(wf.read(f.start, f.end - f.start))
        if not payload and location != EXTERNAL:
            if REF_KEY in external:  # the marker of a cut tensor must be one the scan wrote, once per payload
                raise InvalidModel(
                    f"tensor {name!r} uses the external data key {REF_KEY!r}, which weightshare reserves", wf.path
                )
            return None  # strings, empty tensors: nothing to move
        dims_t = tuple(dims)
        if data_type not in dtypes.BITS:
            raise InvalidModel(
                f"tensor {name!r} has data type {data_type}, which cannot hold a numeric payload", wf.path
            )
        ref = self._ref(name, name_range, data_type, dims_t, payload, external if location == EXTERNAL else None)
        marker = _MARKER_KEY + encode_len_field(2, str(ref.index).encode())
        kept.append(encode_len_field(13, marker))
        kept.append(_EXTERNAL_LOCATION)
        return b"".join(kept)

    def _dims(self, f: Field) -> list[int]:
        if f.wire_type == VARINT:
            values = [f.value]
        elif f.wire_type == LEN:
            if f.value > 64 * 10:
                raise self.wf.error(f"tensor at offset {f.start} declares more than 64 dims")
            import numpy as np  # packed dims only: most writers do not pack them

            arr, used = decode_varints(np.frombuffer(self.wf.read(f.value_start, f.value), np.uint8))
            if used != f.value:
                raise self.wf.error(f"corrupt dims at offset {f.start}")
            values = [int(v) for v in arr]
        else:
            raise self.wf.error(f"corrupt dims at offset {f.start}")
        dims = [v - (1 << 64) if v >= 1 << 63 else v for v in values]
        if any(d < 0 for d in dims):
            raise self.wf.error(f"tensor at offset {f.start} has a negative dimension {min(dims)}")
        return dims

    def _string_pair(self, f: Field) -> tuple[str, str]:
        key = value = ""
        for g in self.wf.fields(f.value_start, f.end):
            if g.wire_type == LEN and g.number in (1, 2):
                text = self.wf.read(g.value_start, g.value).decode("utf-8", "replace")
                if g.number == 1:
                    key = text
                else:
                    value = text
        return key, value

    def _ref(
        self,
        name: str,
        name_range: tuple[int, int] | None,
        data_type: int,
        dims: tuple[int, ...],
        payload: list[Field],
        external: dict[str, str] | None,
    ) -> TensorRef:
        wf = self.wf
        expected = dtypes.raw_nbytes(data_type, dims)
        index = len(self.refs)
        if external is not None:
            if payload:
                raise InvalidModel(f"tensor {name!r} has both external and embedded data", wf.path)
            part = self._external_range(name, external, expected)
            ref = self.refs.append(data_type, dims, 0, [part], [], name, name_range)
            recorded = self._recorded(part.path).get((part.offset, part.length))
            if recorded is not None:
                self.refs.recorded[index] = recorded
        else:
            numbers = {f.number for f in payload}
            if len(numbers) > 1:
                raise InvalidModel(f"tensor {name!r} has data in more than one field", wf.path)
            number = numbers.pop()
            if number == dtypes.RAW_DATA:
                payload = payload[-1:]  # a repeated non-repeated field: the last one wins
            self._check_typed_size(name, data_type, dims, number, sum(f.value for f in payload), expected)
            parts = [FileRange(wf.path, f.value_start, f.value, self.model_file) for f in payload]
            ref = self.refs.append(
                data_type, dims, number, parts, [(f.start, f.end) for f in payload], name, name_range
            )
        return ref

    def _check_typed_size(
        self, name: str, data_type: int, dims: tuple[int, ...], field: int, nbytes_in: int, expected: int
    ) -> None:
        path = self.wf.path
        if field == dtypes.RAW_DATA:
            if nbytes_in != expected:
                raise InvalidModel(
                    f"tensor {name!r}: raw_data has {nbytes_in} bytes, its dims and type need {expected}", path
                )
            return
        layout = dtypes.typed_layout(field, data_type, dims)
        field_name = dtypes.TYPED_FIELDS[field]
        if layout is None:
            raise Unsupported(f"tensor {name!r}: data type {data_type} stored in {field_name} is not supported", path)
        kind, count, itemsize = layout
        if kind == "copy" and nbytes_in != count * itemsize:
            raise InvalidModel(
                f"tensor {name!r}: {field_name} has {nbytes_in // itemsize} values, its dims need {count}", path
            )
        if kind == "varint" and not (count <= nbytes_in <= 10 * count):
            raise InvalidModel(
                f"tensor {name!r}: {field_name} has {nbytes_in} bytes, which cannot hold "
                f"the {count} values its dims need",
                path,
            )

    def _external_range(self, name: str, info: dict[str, str], expected: int) -> FileRange:
        wf = self.wf
        _check_external_keys(name, info, wf.path)
        location = info.get("location")
        if not location:
            raise InvalidModel(f"tensor {name!r} is external but has no location", wf.path)
        target = resolve_inside(
            self.model_dir, location, f"external data of tensor {name!r}", wf.path, roots=self.roots
        )
        f = self._open_external(target, location, name)
        offset = _ort_integer(name, "offset", info.get("offset", "0"), wf.path)
        length = _ort_integer(name, "length", info.get("length", "0"), wf.path)
        size = f.size
        if length == 0:  # ORT: no length, or 0, means "the tensor's own size from offset"
            length = expected
        if offset < 0 or offset + length > size:
            raise InvalidModel(
                f"external data of tensor {name!r} (offset {offset}, length {length}) runs past the "
                f"end of {location!r} ({size} bytes)",
                wf.path,
            )
        if length != expected:
            raise InvalidModel(
                f"external data of tensor {name!r} has {length} bytes, its dims and type need {expected}", wf.path
            )
        # named as ONNX Runtime opens it (beside the model path given), read through the fd opened at ``target``
        return FileRange(str(self.model_dir / location), offset, length, f)

    def _open_external(self, target: Path, location: str, name: str) -> InputFile:
        """Open the checked path once (no symlink, regular file, still inside the model directory) and keep
        the fd: the bytes copied are those of the file that passed the check."""
        key = str(target)
        f = self._external.get(key)
        if f is None:
            if not target.exists():
                raise InvalidModel(f"external data file {location!r} of tensor {name!r} is missing", self.wf.path)
            f = self._external[key] = open_input(target, self.roots, self.wf.path)
        return f


# What ONNX Runtime (1.32, tensor_external_data_info.cc) accepts as external data: these keys, a non-empty
# value each, and offset/length as plain ASCII decimal (ParseStringWithClassicLocale: no sign but an offset's
# "-", no spaces, no "_", no other digits, within int64). Python's int() accepts "+16", " 16", "16_384" and
# "١٦"; reading such a model would give the converted file offsets that the original never had in ORT.
_EXTERNAL_KEYS = ("location", "offset", "length", "checksum")
_ORT_DIGITS = {"offset": re.compile(r"-?[0-9]+"), "length": re.compile(r"[0-9]+")}


def _check_external_keys(name: str, info: dict[str, str], path: str) -> None:
    for key, value in info.items():
        if key not in _EXTERNAL_KEYS and not key.startswith("prepacked"):
            raise InvalidModel(
                f"tensor {name!r} has an unknown external data key {key[:40]!r} (ONNX Runtime refuses it)", path
            )
        if not value:
            raise InvalidModel(
                f"tensor {name!r} has an empty external data {key[:40]!r} (ONNX Runtime refuses it)", path
            )


def _ort_integer(name: str, key: str, value: str, path: str) -> int:
    number = int(value) if _ORT_DIGITS[key].fullmatch(value) else None
    if number is None or not -(1 << 63) <= number < 1 << 63:
        raise InvalidModel(
            f"tensor {name!r} has external data {key} {value[:40]!r}, which is not a plain decimal "
            "integer (ONNX Runtime refuses it)",
            path,
        )
    return number


def scan_model(path: Path) -> tuple[bytes, RefTable]:
    """Return (skeleton bytes, payload refs) of the ONNX model at ``path``."""
    model_file = open_input(path)
    with WireFile(path) as wf:
        if not os.path.samestat(os.fstat(wf.fd), os.fstat(model_file.fd)):
            raise InvalidModel("the file changed while it was being opened", path)
        scanner = Scanner(wf, model_dir(path), model_file, external_data_roots(path))
        skeleton = scanner.scan()
    return skeleton, scanner.refs


def _varint_at(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")


def _fields_of(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(number, wire type, field start, value start, field end) of every field of the message at
    ``[start, end)`` of an in-memory buffer."""
    pos = start
    while pos < end:
        b = buf[pos]
        tag, vpos = (b, pos + 1) if b < 0x80 else _varint_at(buf, pos)
        wire_type = tag & 7
        if wire_type == LEN:
            b = buf[vpos]
            n, vstart = (b, vpos + 1) if b < 0x80 else _varint_at(buf, vpos)
            fend = vstart + n
        elif wire_type == VARINT:
            vstart = vpos
            _, fend = _varint_at(buf, vpos)
        elif wire_type == 1:
            vstart, fend = vpos, vpos + 8
        elif wire_type == 5:
            vstart, fend = vpos, vpos + 4
        else:
            raise ValueError(f"wire type {wire_type} at offset {pos}")
        if fend > end:
            raise ValueError(f"field at offset {pos} runs past its message")
        yield tag >> 3, wire_type, pos, vstart, fend
        pos = fend


_MARKER_KEY = encode_len_field(1, REF_KEY.encode())
_EXTERNAL_LOCATION = encode_varint_field(14, EXTERNAL)  # data_location: EXTERNAL, after every cut tensor's marker


def place_markers(skeleton: bytes, entries: Callable[[int], bytes]) -> bytes:
    """``skeleton`` (a serialized ModelProto whose cut tensors still carry their ``weightshare.ref`` entry) with
    each marker entry replaced by ``entries(index)``: the encoded external_data field(s) that go in its place.

    The same bytes as setting those entries on the parsed model and serializing it (the serializer writes
    fields in number order, so the entries sit exactly where the marker sat), without holding the parsed
    model, its tensors or a Python object per tensor while the blob is written.
    """
    try:
        new = _place(skeleton, 0, len(skeleton), "model", entries, 0)
    except (ValueError, IndexError) as e:  # the skeleton comes from our own serializer: a bug, not bad input
        raise InvalidModel(f"internal error re-reading the rewritten model: {e}") from None
    return skeleton if new is None else bytes(new)


def _place(
    buf: bytes, start: int, end: int, kind: str, entries: Callable[[int], bytes], depth: int
) -> bytearray | None:
    if depth > MAX_DEPTH + 8:
        raise ValueError("messages nested too deep")
    out: bytearray | None = None
    copy_from = start
    if kind == "tensor":
        for number, wire_type, fstart, vstart, fend in _fields_of(buf, start, end):
            if number != 13 or wire_type != LEN or not buf.startswith(_MARKER_KEY, vstart):
                continue
            key_end = vstart + len(_MARKER_KEY)
            if key_end >= fend or buf[key_end] != (2 << 3 | LEN):
                continue
            n, vpos = _varint_at(buf, key_end + 1)
            if vpos + n != fend:
                continue
            if out is None:
                out = bytearray()
            out += memoryview(buf)[copy_from:fstart]
            out += entries(int(buf[vpos:fend]))
            copy_from = fend
    else:
        children = _CHILDREN[kind]
        for number, wire_type, fstart, vstart, fend in _fields_of(buf, start, end):
            child = children.get(number)
            if child is None or wire_type != LEN:
                continue
            new = _place(buf, vstart, fend, child, entries, depth + 1)
            if new is None:
                continue
            if out is None:
                out = bytearray()
            out += memoryview(buf)[copy_from:fstart]
            out += encode_varint(number << 3 | LEN)
            out += encode_varint(len(new))
            out += new
            copy_from = fend
    if out is None:
        return None
    out += memoryview(buf)[copy_from:end]
    return out
