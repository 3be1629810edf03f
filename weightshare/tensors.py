"""Payload sources: where a weight's bytes come from, read in chunks.

A ``PayloadSource`` knows how many bytes it will produce (``nbytes``) and yields
them in chunks of at most ``chunk_size`` bytes. Sources never hold a whole
payload: they ``preadv`` into one reused buffer. A yielded chunk is only valid
until the next one is requested, so consumers write or hash it at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import numpy as np

from .errors import InvalidModel

CHUNK_SIZE = 4 << 20  # 4 MiB: large enough for full disk speed, small enough to be invisible in RSS


class PayloadSource(Protocol):
    nbytes: int

    def chunks(self, chunk_size: int = CHUNK_SIZE) -> Iterator[memoryview]: ...


@dataclass
class FileRange:
    """``length`` bytes at ``offset`` of ``path``; bounds are checked before any read."""

    path: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0:
            raise InvalidModel(f"negative offset or length ({self.offset}, {self.length})", self.path)

    @property
    def nbytes(self) -> int:
        return self.length

    def check_within(self, file_size: int) -> None:
        if self.offset + self.length > file_size:
            raise InvalidModel(
                f"data at offset {self.offset} with length {self.length} runs past the end of the file "
                f"({file_size} bytes)",
                self.path,
            )

    def chunks(self, chunk_size: int = CHUNK_SIZE) -> Iterator[memoryview]:
        if self.length == 0:
            return
        buf = bytearray(min(chunk_size, self.length))
        view = memoryview(buf)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            pos, end = self.offset, self.offset + self.length
            while pos < end:
                want = min(len(buf), end - pos)
                got = os.preadv(fd, [view[:want]], pos)
                if got <= 0:
                    raise InvalidModel(f"file ended early at offset {pos} (expected data up to {end})", self.path)
                yield view[:got]
                pos += got
        finally:
            os.close(fd)


@dataclass
class BytesSource:
    """A small payload already in memory (inline data, test inputs)."""

    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def chunks(self, chunk_size: int = CHUNK_SIZE) -> Iterator[memoryview]:
        view = memoryview(self.data)
        for i in range(0, len(view), chunk_size):
            yield view[i : i + chunk_size]


@dataclass
class ConcatSource:
    """Several sources, one after the other (protobuf fields split over occurrences)."""

    parts: list

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def chunks(self, chunk_size: int = CHUNK_SIZE) -> Iterator[memoryview]:
        for part in self.parts:
            yield from part.chunks(chunk_size)


@dataclass
class ElementwiseSource:
    """Applies ``convert`` (numpy array in, numpy array out) to a source chunk by chunk.

    ``in_itemsize`` and ``out_itemsize`` give the element sizes; the input chunk
    size is rounded to whole elements so that no element straddles two chunks.
    """

    inner: PayloadSource
    in_itemsize: int
    out_itemsize: int
    convert: Callable[[memoryview], np.ndarray]
    _leftover: bytes = field(default=b"", repr=False)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes // self.in_itemsize * self.out_itemsize

    def chunks(self, chunk_size: int = CHUNK_SIZE) -> Iterator[memoryview]:
        in_chunk = max(self.in_itemsize, chunk_size * self.in_itemsize // self.out_itemsize)
        in_chunk -= in_chunk % self.in_itemsize
        carry = b""
        for piece in self.inner.chunks(in_chunk):
            if carry:
                piece = memoryview(carry + bytes(piece))
                carry = b""
            whole = len(piece) - len(piece) % self.in_itemsize
            if whole < len(piece):
                carry = bytes(piece[whole:])
            if whole:
                yield memoryview(self.convert(piece[:whole])).cast("B")
        if carry:
            raise InvalidModel("payload length is not a whole number of elements")


def read_all(source: PayloadSource) -> bytes:
    """The whole payload in memory: only for payloads that stay inline (small by construction) or whose
    caller has bounded the size."""
    return b"".join(bytes(c) for c in source.chunks())


def fp16_to_fp32(chunk: memoryview) -> np.ndarray:
    """IEEE half to single: exact for every value, NaN payloads and signed zeros kept."""
    return np.frombuffer(chunk, dtype="<f2").astype("<f4")


def bf16_to_fp32(chunk: memoryview) -> np.ndarray:
    """bfloat16 is the top half of a float32: shifting the bits is exact."""
    return np.frombuffer(chunk, dtype="<u2").astype("<u4") << np.uint32(16)
