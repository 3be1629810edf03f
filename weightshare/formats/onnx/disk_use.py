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
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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
    # a zoo's models are staged alike: the blob writer hashes such a range before copying it, and a duplicate of a
    # stored payload is never written (``_placement.BlobWriter.add_row``)
    likely_duplicate: bool = True

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


SCRATCH = "scratch"  # in a staging: a link to an ORT child's memory-backed directory
SCRATCH_ENV = "WEIGHTSHARE_ORT_SCRATCH"  # where that directory is made ("0": none, the files stay on disk)
SCRATCH_PREFIX = "weightshare-ort-"
_MKDTEMP_NAME = re.compile(re.escape(SCRATCH_PREFIX) + r"[a-z0-9_]{8}")  # tempfile's names


@contextmanager
def memory_scratch(stage: Path, need: int) -> Iterator[str]:
    """A private directory on a memory-backed file system (``SCRATCH_ENV``, /dev/shm by default), linked from
    ``stage`` as ``SCRATCH`` (yielded), for an ORT child's own files: their bytes are read back and dropped,
    never kept, so writing them to disk would only be bytes written. Its user keeps one segment's, window's
    or node's file there at a time (at most ``need`` bytes: ``child.Target``, ``cpu.check_rounding``), and it is
    removed with everything in it once the child is done. "" when there is none with ``need`` bytes free: the
    files stay in ``stage``."""
    root = os.environ.get(SCRATCH_ENV, "/dev/shm")
    try:
        st = os.statvfs(root)
        ok = root not in ("", "0") and os.path.isdir(root) and st.f_bavail * st.f_frsize >= need
    except OSError:
        ok = False
    if not ok:
        yield ""
        return
    import fcntl  # here: a memory-backed scratch exists on POSIX systems only

    sweep_scratch(root)
    where = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=root)
    held = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # alive while this run is: a later run's sweep leaves it alone
        os.symlink(where, stage / SCRATCH)
        yield SCRATCH
    finally:
        shutil.rmtree(where, ignore_errors=True)
        os.close(held)
        (stage / SCRATCH).unlink(missing_ok=True)


def sweep_scratch(root: str) -> None:
    """Remove the scratch directories of runs that died before removing theirs (killed with -9): memory the
    system would otherwise hold until a reboot. A live run holds its directory's flock; any process namespace."""
    import fcntl

    try:
        names = [n for n in os.listdir(root) if n.startswith(SCRATCH_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live run's
        try:
            held, named = os.fstat(fd), os.stat(path, follow_symlinks=False)
            # the directory locked is the one named (not swapped since), this user's, and as mkdtemp makes one
            # (its name's shape, mode 0o700): only then removed; a directory of yours named like one stays
            if (
                (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
                and named.st_uid == os.getuid()
                and not named.st_mode & 0o077
                and _MKDTEMP_NAME.fullmatch(name)
            ):
                shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
