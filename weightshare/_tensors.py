"""Payload sources: where a weight's bytes come from, read in chunks.

A ``PayloadSource`` knows how many bytes it will produce (``nbytes``) and yields
them in chunks of at most ``chunk_size`` bytes. Sources never hold a whole
payload: they ``preadv`` into reused buffers. A yielded chunk is only valid until
the next one is requested -- except from sources whose ``stable_chunks`` is True:
those rotate two buffers, so a chunk stays valid until two more have been
requested, which lets the blob writer hash and write chunk i on its thread while
chunk i+1 is produced, without copying it.

Input files are opened once (``open_input``, ``_inputs``) and read through the
kept descriptor, never reopened by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np  # imported where used: `weightshare --help` and `check` need no numpy

from ._inputs import InputFile as InputFile  # re-exported: the readers of payloads import them from here
from ._inputs import open_input as open_input
from .errors import InvalidModel

CHUNK_SIZE = 4 << 20  # 4 MiB: large enough for full disk speed, small enough to be invisible in RSS


class PayloadSource(Protocol):
    @property
    def nbytes(self) -> int: ...

    def chunks(self, chunk_size: int = CHUNK_SIZE) -> Iterator[memoryview]: ...


def stable_chunks(source: object) -> bool:
    """True when ``source``'s chunks stay valid until two more have been requested (see module doc)."""
    return bool(getattr(source, "stable_chunks", False))


class BufferRing:
    """Buffers reused from one payload to the next by a single consumer (the blob writer), so that streaming
    a payload does not fault in fresh pages for its read and convert buffers: 64 fp16 payloads of 8 MiB
    faulted in 768 MiB of new pages (200,000 minor faults), about 0.3 CPU s per GiB written.

    ``take(role, size)`` returns the next of two buffers kept for ``role``, in rotation: a buffer comes back
    only after one more ``take`` of the same role, which is what ``stable_chunks`` promises (a chunk stays
    valid until two more are requested). The rotation is the ring's, not the generator's, so it holds
    across payloads and across the parts of a ``ConcatSource``. A ring must not be shared by two chunk
    streams that are read in lockstep, nor by two threads.
    """

    __slots__ = ("_bufs", "_turn")

    def __init__(self) -> None:
        self._bufs: dict[str, list[memoryview | None]] = {}
        self._turn: dict[str, int] = {}

    def take(self, role: str, size: int) -> memoryview:
        bufs = self._bufs.setdefault(role, [None, None])
        turn = self._turn.get(role, 0)
        self._turn[role] = turn ^ 1
        buf = bufs[turn]
        if buf is None or len(buf) < size:
            buf = bufs[turn] = memoryview(bytearray(size))
        return buf[:size]


def chunks_of(source: PayloadSource, chunk_size: int, ring: BufferRing | None) -> Iterator[memoryview]:
    """``source.chunks(chunk_size)``, through ``ring``'s buffers when the source can use them (``takes_ring``)."""
    if ring is not None and getattr(source, "takes_ring", False):
        return source.chunks(chunk_size, ring=ring)  # type: ignore[call-arg]
    return source.chunks(chunk_size)


def _pread_into(fd: int, view: memoryview, pos: int, path: str, end: int) -> int:
    got = os.preadv(fd, [view], pos)
    if got <= 0:
        raise InvalidModel(f"file ended early at offset {pos} (expected data up to {end})", path)
    return got


@dataclass(slots=True)
class FileRange:
    """``length`` bytes at ``offset`` of an input file; bounds are checked before any read.

    ``file`` is the descriptor opened (and checked) once by ``open_input``; without
    it, ``path`` is opened at each read (inputs named by the user, never by a model).
    """

    path: str
    offset: int
    length: int
    file: InputFile | None = None

    stable_chunks = True  # two rotating buffers
    takes_ring = True

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

    def opened(self) -> InputFile:
        """The input file to read through: the kept one, or a fresh (checked) open of ``path``."""
        return self.file if self.file is not None else open_input(self.path)

    @contextmanager
    def reading(self) -> Iterator[InputFile]:
        """``opened``, closed after the block unless it is the kept one."""
        f = self.opened()
        try:
            yield f
        finally:
            if f is not self.file:
                f.close()

    def chunks(self, chunk_size: int = CHUNK_SIZE, ring: BufferRing | None = None) -> Iterator[memoryview]:
        """The bytes in chunks of at most ``chunk_size``; read into ``ring``'s "read" buffers when given."""
        if self.length == 0:
            return
        if self.length <= chunk_size and ring is None:  # one read, one fresh buffer: the common case of small tensors
            f = self.opened()
            try:
                data = os.pread(f.fd, self.length, self.offset)
            finally:
                if f is not self.file:
                    f.close()
            if len(data) < self.length:
                raise InvalidModel(
                    f"file ended early at offset {self.offset + len(data)} (expected data up to "
                    f"{self.offset + self.length})",
                    self.path,
                )
            yield memoryview(data)
            return
        size = min(chunk_size, self.length)
        ring = ring if ring is not None else BufferRing()  # without the consumer's ring, two buffers of its own
        f = self.opened()
        try:
            pos, end = self.offset, self.offset + self.length
            while pos < end:
                view = ring.take("read", size)
                got = _pread_into(f.fd, view[: min(size, end - pos)], pos, self.path, end)
                yield view[:got]
                pos += got
        finally:
            if f is not self.file:
                f.close()


class _RoleRing(BufferRing):
    """A view of a ring that maps every role to ``prefix``: the inner source of a converter reads into buffers
    of its own, apart from those the converter hands to the consumer."""

    __slots__ = ("_prefix", "_ring")

    def __init__(self, ring: BufferRing, prefix: str) -> None:
        self._ring, self._prefix = ring, prefix

    def take(self, role: str, size: int) -> memoryview:
        return self._ring.take(f"{self._prefix}:{role}", size)


@dataclass
class BytesSource:
    """A small payload already in memory (inline data, test inputs)."""

    data: bytes

    stable_chunks = True  # views of immutable bytes

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

    parts: Sequence[PayloadSource]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def stable_chunks(self) -> bool:
        # Each part rotates its own buffers, and a part's buffers outlive its last chunk.
        return all(stable_chunks(p) for p in self.parts)

    takes_ring = True  # passed on to the parts that take one

    def chunks(self, chunk_size: int = CHUNK_SIZE, ring: BufferRing | None = None) -> Iterator[memoryview]:
        for part in self.parts:
            yield from chunks_of(part, chunk_size, ring)


_OUT_SUPPORT: dict[Callable[..., object], bool] = {}


def _accepts_out(convert: Callable[..., object]) -> bool:
    """Whether ``convert(chunk, out=buffer)`` writes into ``buffer`` (converters that do not are still used,
    allocating their result)."""
    known = _OUT_SUPPORT.get(convert)
    if known is None:
        import inspect

        try:
            known = "out" in inspect.signature(convert).parameters
        except (TypeError, ValueError):
            known = False
        _OUT_SUPPORT[convert] = known
    return known


@dataclass
class ElementwiseSource:
    """Applies ``convert`` (numpy array in, numpy array out) to a source chunk by chunk.

    ``in_itemsize`` and ``out_itemsize`` give the element sizes; the input chunk
    size is rounded to whole elements so that no element straddles two chunks.
    When ``convert`` takes an ``out`` buffer, results go into two rotating buffers
    (no fresh pages per chunk, no copy by the writer).
    """

    inner: PayloadSource
    in_itemsize: int
    out_itemsize: int
    convert: Callable[..., np.ndarray]

    stable_chunks = True  # rotating output buffers, or a fresh array per chunk
    takes_ring = True

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes // self.in_itemsize * self.out_itemsize

    def chunks(self, chunk_size: int = CHUNK_SIZE, ring: BufferRing | None = None) -> Iterator[memoryview]:
        """Converted chunks; with ``ring``, read into its "unpack-in" buffers and convert into its "unpack"
        ones (each input piece is converted before the next is read, so the inner source gets a ring of
        its own role and never clobbers a chunk the consumer still holds)."""
        in_chunk = max(self.in_itemsize, chunk_size * self.in_itemsize // self.out_itemsize)
        in_chunk -= in_chunk % self.in_itemsize
        into = _accepts_out(self.convert)
        out_size = min(in_chunk, self.inner.nbytes) // self.in_itemsize * self.out_itemsize
        inner = chunks_of(self.inner, in_chunk, _RoleRing(ring, "unpack-in") if ring is not None else None)
        outs = ring if ring is not None else BufferRing()  # without the consumer's ring, two buffers of its own
        carry = b""
        for piece in inner:
            if carry:
                piece = memoryview(carry + bytes(piece))
                carry = b""
            whole = len(piece) - len(piece) % self.in_itemsize
            if whole < len(piece):
                carry = bytes(piece[whole:])
            if not whole:
                continue
            n_out = whole // self.in_itemsize * self.out_itemsize
            if into and n_out <= out_size:
                result = self.convert(piece[:whole], out=outs.take("unpack", out_size)[:n_out])
            else:  # a carried piece can exceed one chunk: rare, allocate
                result = self.convert(piece[:whole])
            yield result.data.cast("B")
        if carry:
            raise InvalidModel("payload length is not a whole number of elements")


def read_all(source: PayloadSource) -> bytes:
    """The whole payload in memory: only for payloads that stay inline (small by construction) or whose
    caller has bounded the size."""
    return b"".join(bytes(c) for c in source.chunks())


_FP16_BLOCK = 1 << 17  # halves per pass of the bit conversion: 256 KiB in, 512 KiB out, within L2
_FP16_EXACT: bool | None = None  # whether _fp16_bits_to_fp32 gives numpy's bits here (checked once, on all 65536)


def _fp16_bits_to_fp32(src: np.ndarray, dst: np.ndarray) -> None:
    """IEEE half bits (``src``, uint16) to single bits (``dst``, uint32, same length), exactly as numpy casts.

    numpy's half -> float cast converts one element at a time (0.6 CPU s per GiB of fp32 here); these are whole-
    array integer and float operations on cache-sized blocks (about 0.15): the half's sign, exponent and mantissa
    are moved into a float's fields, the float multiplied by 2**112 to rebias the exponent (exact for normals,
    subnormals and zeros, sign kept), and infinities and NaNs (exponent all ones, |x| >= 2**16 after the
    multiply, which no finite half reaches) get an all-ones exponent with their payload as it was.
    """
    import numpy as np

    scale = np.float32(2.0**112)
    for i in range(0, len(src), _FP16_BLOCK):
        d = dst[i : i + _FP16_BLOCK]
        np.copyto(d, src[i : i + _FP16_BLOCK].view(np.int16), casting="unsafe")  # sign-extended
        np.left_shift(d, 13, out=d)
        np.bitwise_and(d, 0x8FFFE000, out=d)  # sign to bit 31, exponent and mantissa to bits 13..27
        f = d.view(np.float32)
        np.multiply(f, scale, out=f)
        if f.max() >= 65536.0 or f.min() <= -65536.0:  # an infinity or a NaN: rare in weights
            np.bitwise_or(d, 0x7F800000, out=d, where=np.abs(f) >= 65536.0)


def _fp16_fast() -> bool:
    """Whether the bit conversion is exact on this machine and thread (a denormals-are-zero FPU mode would
    flush the subnormal halves): compared once with numpy's own cast on every half."""
    global _FP16_EXACT
    if _FP16_EXACT is None:
        import numpy as np

        every = np.arange(1 << 16, dtype=np.uint16)
        got = np.empty(1 << 16, np.uint32)
        _fp16_bits_to_fp32(every, got)
        _FP16_EXACT = bool(np.array_equal(got, every.view(np.float16).astype(np.float32).view(np.uint32)))
    return _FP16_EXACT


def fp16_to_fp32(chunk: memoryview, out: memoryview | None = None) -> np.ndarray:
    """IEEE half to single: exact for every value, NaN payloads and signed zeros kept.

    With ``out`` (a writable buffer of 2x the chunk's bytes) the result is written there."""
    import numpy as np

    src = np.frombuffer(chunk, dtype="<u2")
    dst = np.empty(len(src), "<u4") if out is None else np.frombuffer(out, dtype="<u4")
    if _fp16_fast() and src.dtype.isnative:
        _fp16_bits_to_fp32(src, dst)
    else:
        np.copyto(dst.view("<f4"), src.view("<f2"))
    return dst.view("<f4")


def bf16_to_fp32(chunk: memoryview, out: memoryview | None = None) -> np.ndarray:
    """bfloat16 is the top half of a float32: shifting the bits is exact."""
    import numpy as np

    src = np.frombuffer(chunk, dtype="<u2")
    if out is None:
        return src.astype("<u4") << np.uint32(16)
    dst = np.frombuffer(out, dtype="<u4")
    np.copyto(dst, src)
    dst <<= np.uint32(16)
    return dst
