"""A bounds-checked reader of flatbuffers at absolute file positions, for the formats that are flatbuffers (TFLite,
ExecuTorch's .pte and .ptd).

Generated flatbuffer code trusts every offset it reads. Here every uoffset, vtable and vector length is checked
against the end of the data before it is followed, so a hostile or truncated file gives ``InvalidModel``, never a
read past the end or an allocation sized by the file. Reads go through ``pread``, not a mapping: a data vector's
length word sits right before its payload, and touching it through mmap maps the surrounding page-cache folio (up to
a few MiB on current kernels) into the reader's RSS.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from .errors import InvalidModel

__all__ = ["Reader", "Table"]

_U8, _U16, _U32, _I32, _U64 = (struct.Struct(f) for f in ("<B", "<H", "<I", "<i", "<Q"))


class Reader:
    """Typed little-endian reads at absolute positions of a file, never past ``size``."""

    def __init__(self, fd: int, size: int, path: str, max_entries: int | None = None, base: int = 0):
        self.fd = fd
        self.size = size
        self.base = base  # where position 0 is in the file: a flatbuffer stored inside another file (a zip member)
        self.path = path
        self.max_entries = max_entries  # a vector claiming more entries is refused before it is walked

    def need(self, pos: int, n: int, what: str) -> None:
        if pos < 0 or n < 0 or pos + n > self.size:
            raise InvalidModel(
                f"truncated or corrupt flatbuffer: {what} at offset {pos} ({n} bytes) runs past the end of the "
                f"data ({self.size} bytes)",
                self.path,
            )

    def read(self, pos: int, n: int, what: str) -> bytes:
        self.need(pos, n, what)
        data = os.pread(self.fd, n, self.base + pos)
        if len(data) != n:
            raise InvalidModel(f"file ended early while reading {what} at offset {pos}", self.path)
        return data

    def u8(self, pos: int, what: str) -> int:
        value: int = _U8.unpack(self.read(pos, 1, what))[0]
        return value

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
        """(first element position, element count) of the vector referenced at ``pos``."""
        start = self.indirect(pos, what)
        count = self.u32(start, f"length of {what}")
        if self.max_entries is not None and count > self.max_entries:
            raise InvalidModel(f"corrupt flatbuffer: {what} claims {count} entries", self.path)
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

    def u8(self, slot: int, default: int = 0) -> int:
        pos = self.field(slot, 1)
        return default if pos is None else self.reader.u8(pos, self.what)

    def u32(self, slot: int, default: int = 0) -> int:
        pos = self.field(slot, 4)
        return default if pos is None else self.reader.u32(pos, self.what)

    def u64(self, slot: int, default: int = 0) -> int:
        pos = self.field(slot, 8)
        return default if pos is None else self.reader.u64(pos, self.what)

    def sub(self, slot: int, what: str) -> Table | None:
        pos = self.field(slot, 4)
        return None if pos is None else self.reader.table(self.reader.indirect(pos, what), what)

    def string(self, slot: int, what: str) -> str:
        pos = self.field(slot, 4)
        if pos is None:
            return ""
        start, n = self.reader.vector(pos, 1, what)
        if n > 1 << 16:
            raise InvalidModel(f"corrupt flatbuffer: {what} is {n} bytes long", self.reader.path)
        return self.reader.read(start, n, what).decode("utf-8", "replace")

    def tables(self, slot: int, what: str) -> list[Table]:
        pos = self.field(slot, 4)
        if pos is None:
            return []
        first, count = self.reader.vector(pos, 4, what)
        return [
            self.reader.table(self.reader.indirect(first + 4 * i, f"{what}[{i}]"), f"{what}[{i}]") for i in range(count)
        ]

    def scalars(self, slot: int, fmt: str, what: str) -> list[int]:
        """A vector of fixed-width scalars (``fmt``: a struct code such as "q", "Q", "i")."""
        pos = self.field(slot, 4)
        if pos is None:
            return []
        width = struct.calcsize("<" + fmt)
        first, count = self.reader.vector(pos, width, what)
        return list(struct.unpack(f"<{count}{fmt}", self.reader.read(first, count * width, what)))
