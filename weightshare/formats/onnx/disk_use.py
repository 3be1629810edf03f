"""Temporary disk of ``--prepack``: staged bytes given back as they are copied, and the peak measured.

``ReleasedRange``: a payload read from a staged file whose blocks are freed (``fallocate`` with
``FALLOC_FL_PUNCH_HOLE``) once the blob holds them, so that the final blob grows while the staging
shrinks and OUTDIR never holds the weights twice over. Only whole blocks inside the range are
freed: bytes of a neighbouring range are never touched. Where the file system cannot punch holes
(or off Linux) nothing is freed and nothing else changes.

``DiskPeak``: the bytes allocated under a directory, sampled in a thread every ``interval`` seconds
(and on demand), above what it held at the start.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from ..._tensors import FileRange

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
BLOCK = 4096

_fallocate = None
_punch_works = True
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _fallocate = _libc.fallocate
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    _fallocate.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux/glibc: nothing is given back early
    _fallocate = None


def punch(path: str, offset: int, length: int) -> bool:
    """Free the whole blocks inside ``[offset, offset + length)`` of ``path``; whether the file system did."""
    global _punch_works
    start = -(-offset // BLOCK) * BLOCK
    stop = (offset + length) // BLOCK * BLOCK
    if _fallocate is None or not _punch_works or stop <= start:
        return False
    fd = os.open(path, os.O_WRONLY)
    try:
        if _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, start, stop - start) != 0:
            _punch_works = False  # EOPNOTSUPP and kin: the file system keeps the blocks until the staging goes
            return False
    finally:
        os.close(fd)
    return True


def can_punch() -> bool:
    """Whether blocks are freed here (False off Linux, or once a file system refused)."""
    return _fallocate is not None and _punch_works


@dataclass(slots=True)
class ReleasedRange(FileRange):
    """A staged ``FileRange`` whose blocks are freed once its payload is placed (``_write.write_payloads``)."""

    releasable: bool = True  # False when another payload's range overlaps it

    def release(self) -> None:
        if self.releasable:
            punch(self.path, self.offset, self.length)


def mark_overlaps(ranges: list[ReleasedRange]) -> None:
    """Ranges of one file that overlap another (never expected) keep their blocks."""
    by_file: dict[str, list[ReleasedRange]] = {}
    for r in ranges:
        by_file.setdefault(r.path, []).append(r)
    for rs in by_file.values():
        rs.sort(key=lambda r: (r.offset, r.length))
        reach, last = -1, None
        for r in rs:
            # widened to blocks: two ranges sharing a block must not punch it for each other
            lo, hi = r.offset // BLOCK, -(-(r.offset + r.length) // BLOCK)
            if last is not None and lo < reach:
                r.releasable = last.releasable = False
            if hi > reach:
                reach, last = hi, r
