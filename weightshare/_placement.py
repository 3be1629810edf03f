"""The placement engine: payloads streamed into a file at aligned offsets, identical payloads stored once.

``BlobWriter`` writes each payload at the offset ``AlignPolicy`` gives its size, hashing it chunk by chunk
(``_checksum``) and storing identical payloads once. It knows nothing of any container or model format: the
safetensors container (``_safetensors.SafetensorsBlob``) wraps it for ONNX and the shared blob, the TFLite
converter appends after its flatbuffer with it, and Core ML puts a 64-byte metadata record in front of each
payload (``prefix_size``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from array import array
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from . import _checksum
from ._checksum import Hasher, new_hasher, split_digest, tagged
from ._tensors import CHUNK_SIZE, BufferRing, FileRange, InputFile, PayloadSource, chunks_of, stable_chunks
from .errors import InvalidModel, OutputError, Unsupported, UsageError

__all__ = [
    "ALIGN_THRESHOLD",
    "LARGE_ALIGN",
    "SMALL_ALIGN",
    "AlignPolicy",
    "BlobEntry",
    "BlobWriter",
    "PlannedTensor",
    "Progress",
    "align_up",
]

LARGE_ALIGN = 64 << 10  # Windows allocation granularity, 16 KiB Apple pages, 64 KiB ARM64 Linux pages
SMALL_ALIGN = 64  # cache line; what every runtime's SIMD loads want
ALIGN_THRESHOLD = 1 << 20


@dataclass(frozen=True)
class AlignPolicy:
    """Alignment of a payload by its size (``--align``, ``--align-threshold``)."""

    large: int = LARGE_ALIGN
    small: int = SMALL_ALIGN
    threshold: int = ALIGN_THRESHOLD

    def __post_init__(self) -> None:
        for value in (self.large, self.small):
            if value < 1 or value & (value - 1):
                raise UsageError(f"alignment must be a power of two, got {value}")
        if self.threshold < 0:
            raise UsageError(f"alignment threshold must not be negative, got {self.threshold}")

    def for_size(self, nbytes: int) -> int:
        return self.large if nbytes >= self.threshold else self.small

    def render(self) -> str:
        """The ``ALIGN_KEY`` metadata value: ``large=65536,small=64,threshold=1048576``."""
        return f"large={self.large},small={self.small},threshold={self.threshold}"

    @classmethod
    def parse(cls, text: object) -> AlignPolicy | None:
        """The policy ``render`` wrote, or None for anything else (a blob from elsewhere, a damaged entry)."""
        if not isinstance(text, str):
            return None
        fields = dict(item.partition("=")[::2] for item in text.split(","))
        try:
            return cls(int(fields["large"]), int(fields["small"]), int(fields["threshold"]))
        except (KeyError, ValueError, UsageError):
            return None


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


Progress = Callable[[int], object]  # called with a byte count as payload bytes are written


@dataclass(slots=True)
class BlobEntry:
    offset: int  # absolute offset of the payload's first byte in the file
    nbytes: int
    digest: str  # the payload's ``tagged`` digest: "blake3:<hex>" by default, bare hex for SHA-256
    prefix_offset: int | None = None  # where the caller's per-payload record goes, if any
    duplicate: bool = False  # True when these bytes were already stored (offset is the first copy's)


_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightshare-blob")


def _sync_file_range() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


# Writes go to the kernel in pieces of this size. On this Linux (6.18, ext4) a pwrite of 1 MiB or more costs
# 0.9-1.4 system CPU s per GiB against 0.17 in 256 KiB pieces, from the same buffer (scripts/bench_convert.py
# prints both loops).
PWRITE_PIECE = 256 << 10
KERNEL_COPY_MIN = 1 << 20  # below this a copy_file_range + hand-over to the hashing thread costs more than it saves
KERNEL_COPY_STEP = 64 << 20  # per copy_file_range call: few syscalls, writeback started often enough
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF, errno.EPERM, errno.ETXTBSY}
_KERNEL_COPY = hasattr(os, "copy_file_range")


def _kernel_copy_works() -> bool:
    return _KERNEL_COPY


def _hash_range(source: PayloadSource, chunk_size: int, kind: str, ring: BufferRing) -> bytes:
    """The raw digest of ``source``'s bytes, read through reused buffers (b"" past ``source.nbytes``)."""
    h, n = new_hasher(kind), 0
    for chunk in chunks_of(source, chunk_size, ring):
        h.update(chunk)
        if (n := n + len(chunk)) > source.nbytes:
            return b""
    return h.digest()


def _start_writeback(fd: int, pos: int, n: int) -> None:
    """Let the disk start on what was just written (Linux), so the fsync before the final rename finds
    little left to do. Measured on a 1 GiB fp16 model (2 GiB out): 10.6 s -> 7.3-9.1 s."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, pos, n, _SYNC_FILE_RANGE_WRITE)


class BlobWriter:
    """Streams payloads into ``fd`` from offset ``start`` on.

    Args:
        fd: an open, writable file descriptor; the writer uses pwrite only.
        start: first byte the writer may use (bytes before it belong to the caller).
        policy: payload alignment.
        dedupe: store identical payloads once (same ``tag``, length and digest).
        digest: checksum kind, "blake3" (default when installed) or "sha256".
    """

    def __init__(
        self,
        fd: int,
        start: int = 0,
        policy: AlignPolicy = AlignPolicy(),
        dedupe: bool = True,
        chunk_size: int = CHUNK_SIZE,
        digest: str | None = None,
    ):
        self.digest = digest or _checksum.DIGEST
        new_hasher(self.digest)  # refuse an unknown kind before anything is written
        self.fd = fd
        self.end = start
        self.policy = policy
        self.dedupe = dedupe
        self.chunk_size = chunk_size
        # One row per stored payload, in offset order, in flat arrays rather than an object each: 100,000s of
        # payloads. Raw digests, 32 bytes a row; prefix offsets only once a payload has a prefix.
        self._offsets = array("q")
        self._nbytes = array("q")
        self._digests = bytearray()
        self._prefixes: array[int] | None = None  # -1: no prefix
        # Untagged payloads: an open-addressing table of row numbers (-1: free) probed by the digest's first 8 bytes,
        # 8 to 16 bytes a payload rather than a dict entry and a key object each. Tagged ones (Core ML, a few
        # thousand): (tag, size, digest) -> row.
        self._table = array("q", [-1]) * 1024
        self._tagged: dict[tuple[str, int, bytes], int] = {}
        self._sizes: set[int] = set()  # the stored payloads' lengths (``likely_duplicate`` sources)
        self._expected: set[int] = set()  # lengths stored before ``expect_duplicates``: hashed before written
        self.bytes_in = 0
        self.bytes_written = 0
        self._wb_start = start  # first byte whose writeback has not been started
        # Read and convert buffers reused from payload to payload (no fresh pages per payload): one ring for the
        # calling thread, one for the writer thread's hashing of kernel-copied payloads.
        self._ring = BufferRing()
        self._hash_ring = BufferRing()

    def add(
        self,
        source: PayloadSource,
        tag: str = "",
        prefix_size: int = 0,
        prefix_align: int = 64,
        progress: Progress | None = None,
    ) -> BlobEntry:
        """Write one payload; return where it lives (the first copy, for a duplicate)."""
        row, duplicate = self.add_row(source, tag, prefix_size, prefix_align, progress)
        return self.entry(row, duplicate)

    @property
    def rows(self) -> int:
        """How many payloads are stored (duplicates not counted)."""
        return len(self._offsets)

    def entry(self, row: int, duplicate: bool = False) -> BlobEntry:
        """The stored payload ``row`` (0 = first stored) as a ``BlobEntry``, made on demand."""
        prefix = self._prefixes[row] if self._prefixes is not None else -1
        digest = tagged(self.digest, self.hexdigest(row))
        return BlobEntry(self._offsets[row], self._nbytes[row], digest, None if prefix < 0 else prefix, duplicate)

    def offset(self, row: int) -> int:
        return self._offsets[row]

    def nbytes(self, row: int) -> int:
        return self._nbytes[row]

    def hexdigest(self, row: int) -> str:
        """The untagged hex digest of stored payload ``row`` (of kind ``self.digest``)."""
        return self._digests[32 * row : 32 * row + 32].hex()

    def add_row(
        self,
        source: PayloadSource,
        tag: str = "",
        prefix_size: int = 0,
        prefix_align: int = 64,
        progress: Progress | None = None,
        min_align: int = 0,
    ) -> tuple[int, bool]:
        """Write one payload; return (its row, whether it was a duplicate of that row). ``min_align``: the
        payload's offset is a multiple of it (and of the policy's alignment), a duplicate's first copy too."""
        nbytes = source.nbytes
        align = max(self.policy.for_size(nbytes), min_align)
        prefix_offset = None
        if prefix_size:
            prefix_offset = align_up(self.end, prefix_align)
            offset = align_up(prefix_offset + prefix_size, align)
        else:
            offset = align_up(self.end, align)
        copied = isinstance(source, FileRange) and nbytes >= KERNEL_COPY_MIN and _kernel_copy_works()
        expected = nbytes in self._expected or (copied and getattr(source, "likely_duplicate", False))
        likely = self.dedupe and not tag and expected and nbytes in self._sizes
        if likely:  # hashed where it is first: a duplicate is then never written (a zoo's models staged alike)
            digest = _hash_range(source, self.chunk_size, self.digest, self._ring)
            if (first := self._find(digest, nbytes, align)) is not None:
                self.bytes_in += nbytes
                if progress is not None:
                    progress(nbytes)
                return first, True
        if likely and copied:
            assert isinstance(source, FileRange)
            with source.reading() as f:
                self._copy_rest(f, source, offset, self._kernel_copy(f, source, offset, progress), progress)
        elif copied:
            assert isinstance(source, FileRange)
            digest = self._copy_unchanged(source, offset, progress)
        else:
            digest = self._stream(source, offset, nbytes, progress)
        self.bytes_in += nbytes
        if len(digest) != 32:
            raise Unsupported(f"digests of kind {self.digest!r} are not 32 bytes long")
        first = None
        if self.dedupe:
            first = self._tagged.get((tag, nbytes, digest)) if tag else self._find(digest, nbytes, align)
        if first is not None and self._offsets[first] % align:
            first = None  # the first copy sits below the alignment this one needs: keep this one too
        if first is not None:
            # Drop the second copy: nothing after self.end has been claimed yet.
            os.ftruncate(self.fd, self.end)
            self._wb_start = min(self._wb_start, self.end)
            return first, True
        row = len(self._offsets)
        self._offsets.append(offset)
        self._nbytes.append(nbytes)
        self._digests += digest
        if prefix_offset is not None and self._prefixes is None:
            self._prefixes = array("q", [-1]) * row
        if self._prefixes is not None:
            self._prefixes.append(-1 if prefix_offset is None else prefix_offset)
        if self.dedupe:
            if tag:
                self._tagged[(tag, nbytes, digest)] = row
            else:
                self._insert(row)
        self.end = offset + nbytes
        self.bytes_written += nbytes
        self._sizes.add(nbytes)
        return row, False

    def expect_duplicates(self) -> None:
        """What is added from here on may repeat what is stored (a zoo's next model): a payload of a stored length
        is hashed before it is written, so a duplicate is never written (truncated away, it counts as written)."""
        self._expected = set(self._sizes)

    def drop_buffers(self) -> None:
        """Give back the reused read buffers (a few chunks) while the writer waits to go on (``--prepack``'s
        staged blob waits for the ORT child: the converter's buffers would add to the process tree's peak)."""
        self._ring, self._hash_ring = BufferRing(), BufferRing()

    def adopt_row(self, offset: int, nbytes: int, align: int, known: str | None = None) -> tuple[int, bool]:
        """Record ``nbytes`` the file holds at ``offset`` (at or past ``end``, a multiple of ``align``), hashed by
        reading them back unless ``known`` is their tagged digest; (its row, whether a duplicate) as ``add_row``."""
        kind, hexdigest = split_digest(known) if known else ("", "")
        h = new_hasher(self.digest)
        pos, stop = offset, offset + (0 if kind == self.digest else nbytes)
        while pos < stop:
            chunk = os.pread(self.fd, min(self.chunk_size, stop - pos), pos)
            if not chunk:
                raise OutputError(f"the blob ends at {pos}, inside a payload adopted up to {stop}")
            h.update(chunk)
            pos += len(chunk)
        digest = bytes.fromhex(hexdigest) if kind == self.digest else h.digest()
        self.bytes_in += nbytes
        first = self._find(digest, nbytes, align) if self.dedupe else None
        if first is not None:
            return first, True
        row = len(self._offsets)
        self._offsets.append(offset)
        self._nbytes.append(nbytes)
        self._digests += digest
        if self._prefixes is not None:
            self._prefixes.append(-1)
        if self.dedupe:
            self._insert(row)
        self.end = offset + nbytes
        self.bytes_written += nbytes
        self._sizes.add(nbytes)
        return row, False

    def _find(self, digest: bytes, nbytes: int, align: int = 1) -> int | None:
        """The row holding these bytes (same digest, same length) at a multiple of ``align``, if any."""
        table, digests = self._table, self._digests
        mask = len(table) - 1
        i = int.from_bytes(digest[:8], "little") & mask
        while (row := table[i]) >= 0:
            if (
                self._nbytes[row] == nbytes
                and digests[32 * row : 32 * row + 32] == digest
                and self._offsets[row] % align == 0
            ):
                return row
            i = (i + 1) & mask
        return None

    def _insert(self, row: int) -> None:
        table = self._table
        if 2 * (row + 1) > len(table):  # at most half full
            table = self._table = array("q", [-1]) * (2 * len(table))
            for r in range(row):
                self._place(table, r)
        self._place(table, row)

    def _place(self, table: array[int], row: int) -> None:
        mask = len(table) - 1
        i = int.from_bytes(self._digests[32 * row : 32 * row + 8], "little") & mask
        while table[i] >= 0:
            i = (i + 1) & mask
        table[i] = row

    def _stream(self, source: PayloadSource, offset: int, nbytes: int, progress: Progress | None) -> bytes:
        """Read (and unpack) chunks here while the writer thread hashes and writes the previous one."""
        digest = new_hasher(self.digest)
        pos = offset
        pending: Future[None] | None = None
        # A single chunk gains nothing from the pipeline; handing it over would cost more than it
        # saves when a model has 100,000s of small tensors.
        pipelined = nbytes > self.chunk_size
        # Sources with stable chunks rotate two buffers: chunk i stays intact while chunk i+1 is
        # produced, which is all the pipeline needs. Others reuse one buffer: copy.
        private = stable_chunks(source)
        try:
            for chunk in chunks_of(source, self.chunk_size, self._ring):
                if pos + len(chunk) > offset + nbytes:
                    raise InvalidModel(f"payload is longer than its declared {nbytes} bytes")
                if not pipelined:
                    self._consume(digest, chunk, pos)
                else:
                    data = chunk if private else bytes(chunk)
                    # Hash here, while the chunk is fresh in this core's cache and the writer thread is still
                    # writing the previous one: the two threads then carry about the same load (read, unpack and
                    # hash here, the copy into the page cache there; 1 GiB fp16 -> fp32 0.46 -> 0.3 s).
                    digest.update(data)
                    if pending is not None:
                        pending.result()
                    pending = _WRITER.submit(self._write, data, pos)
                pos += len(chunk)
                if progress is not None:
                    progress(len(chunk))
        finally:
            # Never return (or raise) with a write in flight: the caller may close the fd next.
            if pending is not None:
                pending.exception() if sys.exc_info()[0] else pending.result()
        if pos != offset + nbytes:
            raise InvalidModel(f"payload is shorter ({pos - offset} bytes) than its declared {nbytes} bytes")
        return digest.digest()

    def _copy_unchanged(self, source: FileRange, offset: int, progress: Progress | None) -> bytes:
        """Bytes copied as they are: the kernel copies (``copy_file_range``) while the writer thread hashes
        the same range through its own reused buffer, so the bytes cross into user space once."""
        with source.reading() as f:
            rng = FileRange(f.path, source.offset, source.length, f)
            hashing = _WRITER.submit(_hash_range, rng, self.chunk_size, self.digest, self._hash_ring)
            try:
                done = self._kernel_copy(f, source, offset, progress)
            except BaseException:
                hashing.exception()  # wait: the hashing thread must not read a file we may close next
                raise
            result: bytes = hashing.result()
            self._copy_rest(f, source, offset, done, progress)
        return result

    def _copy_rest(self, f: InputFile, source: FileRange, offset: int, done: int, progress: Progress | None) -> None:
        """What the kernel did not copy of ``source`` (another filesystem, an old kernel), copied here."""
        if done < source.length:
            rest = FileRange(source.path, source.offset + done, source.length - done, f)
            for chunk in rest.chunks(self.chunk_size, ring=self._ring):
                self._pwrite_all(chunk, offset + done)
                done += len(chunk)
                self._wrote(offset + done)
                if progress is not None:
                    progress(len(chunk))

    def _kernel_copy(self, f: InputFile, source: FileRange, offset: int, progress: Progress | None) -> int:
        """Copy as much of ``source`` as the kernel will; return how many bytes it copied."""
        global _KERNEL_COPY
        done, step = 0, max(self.chunk_size, KERNEL_COPY_STEP)
        while done < source.length:
            want = min(step, source.length - done)
            try:
                n = os.copy_file_range(f.fd, self.fd, want, source.offset + done, offset + done)
            except OSError as e:
                if e.errno in _NO_KERNEL_COPY and done == 0:
                    _KERNEL_COPY = False
                    return done
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EIO):
                    raise OutputError(f"cannot write the weight blob: {e.strerror}") from None
                raise InvalidModel(
                    f"cannot read payload at offset {source.offset + done}: {e.strerror}", source.path
                ) from None
            if n == 0:
                raise InvalidModel(
                    f"file ended early at offset {source.offset + done} (expected data up to "
                    f"{source.offset + source.length})",
                    source.path,
                )
            done += n
            self._wrote(offset + done)
            if progress is not None:
                progress(n)
        return done

    def _consume(self, digest: Hasher, data: bytes | memoryview, pos: int) -> None:
        digest.update(data)
        self._write(data, pos)

    def _write(self, data: bytes | memoryview, pos: int) -> None:
        self._pwrite_all(memoryview(data), pos)
        self._wrote(pos + len(data))

    def _wrote(self, end: int) -> None:
        """Start writeback of what was written up to ``end`` once a chunk's worth has gathered: one
        sync_file_range per chunk, not per payload (100,000s of small payloads)."""
        if end - self._wb_start >= self.chunk_size:
            _start_writeback(self.fd, self._wb_start, end - self._wb_start)
            self._wb_start = end

    def _pwrite_all(self, data: memoryview, pos: int) -> None:
        try:
            while len(data):
                n = os.pwrite(self.fd, data[:PWRITE_PIECE], pos)
                data, pos = data[n:], pos + n
        except OSError as e:
            raise OutputError(f"cannot write the weight blob: {e.strerror}") from None

    def pwrite(self, data: bytes, pos: int) -> None:
        """Write caller-owned bytes (headers, records) that lie outside payloads."""
        self._pwrite_all(memoryview(data), pos)

    def finish(self, trailing_zeros: int = 0) -> int:
        """Fix the file length to the last payload (plus ``trailing_zeros``); return it."""
        size = self.end + trailing_zeros
        try:
            os.ftruncate(self.fd, size)
        except OSError as e:
            raise OutputError(f"cannot write the weight blob: {e.strerror}") from None
        return size


@dataclass(slots=True)
class PlannedTensor:
    """A payload the caller will write: its preferred name, dtype key and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    st_name: str = ""  # unique name in the safetensors header, filled in by SafetensorsBlob
    st_dtype: str = ""
    st_shape: tuple[int, ...] = ()
    min_align: int = 0  # at least this alignment, whatever the policy gives its size (0: the policy's)
