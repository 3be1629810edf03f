"""Protobuf wire format, read straight from the file.

Only what ONNX needs: varints, the four wire types ONNX uses (0 varint, 1 fixed64,
2 length-delimited, 5 fixed32), and chunked decoding of packed varint fields.
Every length is checked against the end of its enclosing message before it is
used, so a lying length can neither make us read past the file nor allocate
from it: ``WireFile`` only ever reads a small window through ``pread``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._inputs import open_fd
from ..._tensors import CHUNK_SIZE, PayloadSource
from ...errors import InvalidModel

if TYPE_CHECKING:
    import numpy as np  # imported where used: a model without packed fields needs no numpy (start-up time)

VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5
_WINDOW = 256 << 10


@dataclass(slots=True)
class Field:
    number: int
    wire_type: int
    start: int  # offset of the tag
    value_start: int  # offset of the value (for LEN: of the content, after the length)
    end: int  # offset just past the field
    value: int  # the varint value (VARINT), or the content length (LEN)


class WireFile:
    """A protobuf-encoded file read through a small moving window."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self.fd = open_fd(self.path)  # a model being converted: its held descriptor
        self.size = os.fstat(self.fd).st_size
        self._win = b""
        self._win_start = 0

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> WireFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def error(self, message: str) -> InvalidModel:
        return InvalidModel(message, self.path)

    def _ensure(self, pos: int, n: int) -> int:
        """Make ``[pos, pos+n)`` (clipped to the file) visible; return its index in the window."""
        if not (self._win_start <= pos and pos + n <= self._win_start + len(self._win)):
            self._win = os.pread(self.fd, max(_WINDOW, n), pos)
            self._win_start = pos
        return pos - self._win_start

    def varint(self, pos: int, end: int) -> tuple[int, int]:
        i = self._ensure(pos, 10)
        win = self._win
        result = shift = 0
        for k in range(10):
            if pos + k >= end or i + k >= len(win):
                raise self.error(f"truncated varint at offset {pos}")
            b = win[i + k]
            result |= (b & 0x7F) << shift
            if b < 0x80:
                return result & 0xFFFFFFFFFFFFFFFF, pos + k + 1
            shift += 7
        raise self.error(f"varint longer than 10 bytes at offset {pos}")

    def read(self, pos: int, n: int) -> bytes:
        """Small reads only (names, skeleton pieces); payloads go through ``FileRange``."""
        if pos < 0 or pos + n > self.size:
            raise self.error(f"read of {n} bytes at offset {pos} runs past the end of the file ({self.size} bytes)")
        if n <= _WINDOW:
            i = self._ensure(pos, n)
            return self._win[i : i + n]
        data = os.pread(self.fd, n, pos)
        if len(data) != n:
            raise self.error(f"file ended early at offset {pos + len(data)}")
        return data

    def fields(self, start: int, end: int) -> Iterator[Field]:
        """The fields of the message occupying ``[start, end)``."""
        if end > self.size:
            raise self.error(f"message at offset {start} with length {end - start} runs past the end of the file")
        pos = start
        while pos < end:
            # Fast path for the common one-byte tag (field numbers below 16), read from the window in place:
            # the scan calls this for every field of every node, so a method call per tag shows in big graphs.
            i = pos - self._win_start
            if 0 <= i < len(self._win) and self._win[i] < 0x80:
                tag, vpos = self._win[i], pos + 1
            else:
                tag, vpos = self.varint(pos, end)
            number, wire_type = tag >> 3, tag & 7
            if number == 0:
                raise self.error(f"invalid field number 0 at offset {pos}")
            value = 0
            if wire_type == VARINT:
                value, fend = self.varint(vpos, end)
            elif wire_type == LEN:
                i = vpos - self._win_start
                if 0 <= i < len(self._win) and self._win[i] < 0x80 and vpos < end:
                    value, vpos = self._win[i], vpos + 1
                else:
                    value, vpos = self.varint(vpos, end)
                fend = vpos + value
            elif wire_type == FIXED64:
                fend = vpos + 8
            elif wire_type == FIXED32:
                fend = vpos + 4
            else:
                raise self.error(f"unsupported protobuf wire type {wire_type} at offset {pos}")
            if fend > end:
                raise self.error(
                    f"field {number} at offset {pos} (length {fend - vpos}) runs past the end of its message "
                    f"at offset {end}"
                )
            yield Field(number, wire_type, pos, vpos, fend, value)
            pos = fend


_ONE_BYTE = [bytes((i,)) for i in range(0x80)]  # the scan encodes ~20 tags and lengths per tensor


def encode_varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _ONE_BYTE[value]
    if 0 <= value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    value &= 0xFFFFFFFFFFFFFFFF
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_len_field(number: int, content: bytes) -> bytes:
    return encode_varint(number << 3 | LEN) + encode_varint(len(content)) + content


def encode_varint_field(number: int, value: int) -> bytes:
    return encode_varint(number << 3 | VARINT) + encode_varint(value)


def decode_varints(buf: np.ndarray) -> tuple[np.ndarray, int]:
    """Decode every complete varint in ``buf`` (uint8). Returns (uint64 values, bytes consumed).

    Vectorised: find the terminating bytes (high bit clear), give each byte its
    position within its varint, and OR the shifted 7-bit groups together.
    """
    import numpy as np

    ends = np.flatnonzero(buf < 0x80)
    if len(ends) == 0:
        if len(buf) >= 10:
            raise ValueError("varint longer than 10 bytes")
        return np.empty(0, np.uint64), 0
    consumed = int(ends[-1]) + 1
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if lengths.max() > 10 or len(buf) - consumed >= 10:
        raise ValueError("varint longer than 10 bytes")
    pos_in_varint = np.arange(consumed, dtype=np.int64) - np.repeat(starts, lengths)
    groups = (buf[:consumed] & 0x7F).astype(np.uint64) << (7 * pos_in_varint).astype(np.uint64)
    return np.bitwise_or.reduceat(groups, starts), consumed


@dataclass
class PackedVarintSource:
    """Packed varint field(s) decoded to ``count`` little-endian unsigned values of ``itemsize`` bytes.

    Protobuf sign-extends negative int32 values to 64 bits; keeping the low
    ``itemsize`` bytes gives the two's complement value for every ONNX type stored
    this way (int8..int64, uint16/fp16/bf16 bit patterns, bool).
    """

    inner: PayloadSource  # the packed bytes
    count: int
    itemsize: int
    path: str = ""
    boolean: bool = False  # BOOL in int32_data: ORT casts each int32 to bool (any non-zero value is 1)

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    def chunks(self, chunk_size: int = CHUNK_SIZE) -> Iterator[memoryview]:
        # About 1/4 of chunk_size in: the decoder's temporaries are 16-24 bytes per input byte.
        import numpy as np

        in_chunk = max(16, chunk_size // 16)
        out_type = np.dtype(f"<u{self.itemsize}")
        carry = np.empty(0, np.uint8)
        produced = 0
        for piece in self.inner.chunks(in_chunk):
            buf = np.frombuffer(piece, np.uint8)
            if len(carry):
                buf = np.concatenate([carry, buf])
            try:
                values, used = decode_varints(buf)
            except ValueError as e:
                raise InvalidModel(f"corrupt packed field: {e}", self.path) from None
            carry = buf[used:].copy()
            produced += len(values)
            if produced > self.count:
                raise InvalidModel(f"packed field has more values than the {self.count} its dims declare", self.path)
            if len(values):
                if self.boolean:
                    values = values != 0
                yield values.astype(out_type).data.cast("B")
        if len(carry) or produced != self.count:
            raise InvalidModel(
                f"packed field has {produced} values{' and a truncated varint' if len(carry) else ''}; "
                f"its dims declare {self.count}",
                self.path,
            )
