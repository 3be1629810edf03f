"""Payload sources: where a weight's bytes come from, read in chunks.

A ``PayloadSource`` knows how many bytes it will produce (``nbytes``) and yields
them in chunks of at most ``chunk_size`` bytes. Sources never hold a whole
payload: they ``preadv`` into reused buffers. A yielded chunk is only valid until
the next one is requested -- except from sources whose ``stable_chunks`` is True:
those rotate two buffers, so a chunk stays valid until two more have been
requested, which lets the blob writer hash and write chunk i on its thread while
chunk i+1 is produced, without copying it.

Input files are opened once (``open_input``) and read through the kept
descriptor, never reopened by name: a name checked to lie inside the model
directory cannot be swapped for a symlink between the check and the read.

A run's inputs are checked against its plan (``planned_inputs``): each input's identity (device, inode) is taken
when the run plans it, a link's by its resolved target (a Hugging Face hub snapshot links every file into the
cache's ``blobs/``). Every later open of a planned input opens that target without following a link and compares
the descriptor's identity with the plan, so a model swapped (for a link to a file outside the folder, or another
file) between planning and conversion is refused, never read. While a driver converts one model it ``hold``s it:
that model is opened once and every read of it, by any reader, goes through that descriptor (``open_fd``).
"""

from __future__ import annotations

import os
import stat
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np  # imported where used: `weightshare --help` and `check` need no numpy

from .errors import InvalidModel, UnsafePath

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


class InputFile:
    """A regular input file opened once; every payload read goes through ``fd``.

    Closed by ``close()`` or when the last reference goes away (sources of many
    tensors share one ``InputFile``, so none of them owns it).
    """

    __slots__ = ("__weakref__", "_closer", "fd", "path", "size")

    def __init__(self, fd: int, path: str, size: int):
        self.fd, self.path, self.size = fd, path, size
        self._closer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self._closer()


def _fd_real_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None  # no /proc (macOS, some sandboxes): the O_NOFOLLOW and dev/ino checks remain


@dataclass(frozen=True, slots=True)
class PlannedInput:
    """An input as its run planned it: the path named, the file it was then (a link's resolved target), and that
    file's identity."""

    path: str  # absolute, as named (may be a link)
    target: str  # its real path when planned
    dev: int
    ino: int
    is_dir: bool


def plan_input(path: str | os.PathLike[str]) -> PlannedInput | None:
    """The identity of ``path`` now (links followed); None when it cannot be read (its reader says why)."""
    name = os.path.abspath(os.fspath(path))
    try:
        st = os.stat(name)
    except OSError:
        return None
    return PlannedInput(name, os.path.realpath(name), st.st_dev, st.st_ino, stat.S_ISDIR(st.st_mode))


def plan_inputs(paths: Iterable[str | os.PathLike[str]]) -> list[PlannedInput]:
    return [p for p in map(plan_input, paths) if p is not None]


@dataclass
class _RunInputs:
    by_name: dict[str, PlannedInput] = field(default_factory=dict)  # by the path named and by its target
    held: dict[str, InputFile] = field(default_factory=dict)  # by PlannedInput.path


_run: ContextVar[_RunInputs | None] = ContextVar("weightshare_run_inputs", default=None)


def _no_hook(planned: Sequence[PlannedInput]) -> None:
    return None


# Called by a driver between planning its run and opening any planned input for conversion (tests put a barrier
# there; nothing else sets it).
after_plan: Callable[[Sequence[PlannedInput]], None] = _no_hook


@contextmanager
def planned_inputs(planned: Iterable[PlannedInput]) -> Iterator[list[PlannedInput]]:
    """Check every open of these inputs against their planned identity while the context lasts (nested: the
    outer run's inputs stay planned too)."""
    outer = _run.get()
    run = _RunInputs(dict(outer.by_name) if outer is not None else {})
    items = list(planned)
    for p in items:
        run.by_name[p.path] = run.by_name[p.target] = p
    token = _run.set(run)
    try:
        yield items
    finally:
        _run.reset(token)
        for f in run.held.values():
            f.close()


def run_input_paths() -> list[str]:
    """The paths the current run planned (as named): the files given on the command line, a folder's models."""
    run = _run.get()
    return sorted({p.path for p in run.by_name.values()}) if run is not None else []


def is_planned(path: str | os.PathLike[str]) -> bool:
    """Whether the current run planned ``path`` (then ``open_input(path)`` opens what was planned)."""
    return _planned(path) is not None


def _planned(path: str | os.PathLike[str]) -> tuple[_RunInputs, PlannedInput] | None:
    run = _run.get()
    if run is None or not run.by_name:
        return None
    p = run.by_name.get(os.path.abspath(os.fspath(path)))
    return (run, p) if p is not None else None


def _open_planned(p: PlannedInput, where: str | os.PathLike[str]) -> int:
    """Open ``p``'s planned target (no link followed there) and check the descriptor is the planned file."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    if p.is_dir:
        flags |= getattr(os, "O_DIRECTORY", 0)
    now = os.path.realpath(p.path)
    if now != p.target:  # re-pointed: the planned target is still safe to read, but it is no longer the input
        raise UnsafePath(f"changed after it was checked (now resolves to {now[:200]}); refusing to read it", where)
    try:
        fd = os.open(p.target, flags)
    except OSError as e:
        raise UnsafePath(f"changed after it was checked ({e.strerror}); refusing to read it", where) from None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (p.dev, p.ino):
        os.close(fd)
        raise UnsafePath("changed after it was checked (replaced by another file); refusing to read it", where)
    return fd


@contextmanager
def hold(path: str | os.PathLike[str]) -> Iterator[None]:
    """Open a planned input once, checked against the plan; every read of it in the context goes through that
    descriptor (``open_input``, ``open_fd``). A path the run did not plan is left as it is."""
    found = _planned(path)
    if found is None or found[1].is_dir:
        if found is not None:  # a package directory: its identity checked now; its files are opened inside it
            os.close(_open_planned(found[1], path))
        yield
        return
    run, p = found
    if p.path in run.held:
        yield
        return
    fd = _open_planned(p, path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidModel(f"{os.path.basename(p.path)!r} is not a regular file", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    run.held[p.path] = InputFile(fd, p.path, st.st_size)
    try:
        yield
    finally:
        run.held.pop(p.path).close()


def open_fd(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of ``path`` the caller closes: a duplicate of the held one for an input being
    converted, a checked open for another planned input, else ``os.open``."""
    found = _planned(path)
    if found is None:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    run, p = found
    held = run.held.get(p.path)
    if held is not None:
        return os.dup(held.fd)
    fd = _open_planned(p, path)
    os.set_blocking(fd, True)
    return fd


def open_input(
    path: str | os.PathLike[str],
    inside: str | os.PathLike[str] | tuple[Path, ...] | None = None,
    origin: str | os.PathLike[str] | None = None,
) -> InputFile:
    """Open ``path`` for reading, once, refusing anything but a regular file.

    With ``inside`` (the model directory; ``path`` must already have passed
    ``resolve_inside``), the last component must not be a symlink and the opened
    descriptor's real path must lie inside ``inside`` (or one of them, ``external_data_roots``): a file swapped
    for a symlink, or a directory on the way swapped, after the check is refused, never read.
    The open is non-blocking so that a FIFO is refused instead of waiting for a writer.
    An input the run planned is opened at its planned target and checked against the plan (``planned_inputs``); one
    being converted is not opened again (``hold``).
    """
    path = os.fspath(path)
    where = origin if origin is not None else path
    found = _planned(path)
    if found is not None and not found[1].is_dir:
        return _open_planned_input(found[0], found[1], path, inside, where)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if inside is not None:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if inside is not None and os.path.islink(path):
            raise UnsafePath(f"{os.path.basename(path)!r} became a symlink while being opened", where) from None
        raise InvalidModel(f"cannot open {os.path.basename(path)!r}: {e.strerror}", where) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidModel(f"{os.path.basename(path)!r} is not a regular file", where)
        if inside is not None:
            _check_opened_inside(fd, st, path, inside, where)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return InputFile(fd, path, st.st_size)


def _open_planned_input(
    run: _RunInputs,
    p: PlannedInput,
    path: str,
    inside: str | os.PathLike[str] | tuple[Path, ...] | None,
    where: str | os.PathLike[str],
) -> InputFile:
    held = run.held.get(p.path)
    fd = os.dup(held.fd) if held is not None else _open_planned(p, where)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidModel(f"{os.path.basename(path)!r} is not a regular file", where)
        if inside is not None:
            _check_opened_inside(fd, st, p.target, inside, where)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return InputFile(fd, path, st.st_size)


def _planned_real(base: str | os.PathLike[str]) -> str:
    """A directory's real path as the run planned it (a package swapped for a link afterwards does not move the
    bound), else as it is now."""
    found = _planned(base)
    return found[1].target if found is not None else os.path.realpath(base)


def _check_opened_inside(
    fd: int,
    st: os.stat_result,
    path: str,
    inside: str | os.PathLike[str] | tuple[Path, ...],
    where: str | os.PathLike[str],
) -> None:
    bases = [_planned_real(b) for b in inside] if isinstance(inside, tuple) else [_planned_real(inside)]
    real = _fd_real_path(fd)
    if real is None:  # fall back to: the name now resolves to the very file we hold, and inside base
        real = os.path.realpath(path)
        now = os.stat(real)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise UnsafePath(f"{os.path.basename(path)!r} changed while being opened", where)
    if not any(os.path.commonpath([base, real]) == base for base in bases):
        raise UnsafePath(f"{os.path.basename(path)!r} resolves outside the model directory once opened", where)


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
