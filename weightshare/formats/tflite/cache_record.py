"""XNNPACK weight caches bound to their own content, and the locked staging their builds run in.

LiteRT checks nothing of a cache but XNNPACK's build header: a cache with flipped bytes, another model's cache
copied or linked under the expected name, or a truncated one is used as it is (wrong outputs), and a file it
cannot load is rebuilt *in place* by whichever process opens it (concurrent readers then SIGBUS). So
``convert --prepack`` writes, beside each cache, a record of it (``<cache>.json``: its size, its SHA-256 and
the digest of the model content it was built for), and a reader:

- opens the cache once (O_NOFOLLOW: a symlink is refused), checks size and checksum on that descriptor
  against the record, and hands LiteRT ``/proc/self/fd/<fd>``, the very file it checked (a rename over the
  name in between changes nothing);
- uses no cache at all when anything fails: LiteRT is never given a path it could decide to rebuild.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from ...errors import OutputError

RECORD_SUFFIX = ".json"
_FORMAT = "weightshare-xnnpack-cache-record/1"
_CHUNK = 4 << 20
_MAX_RECORD = 4096  # a record is ~200 bytes; anything larger is not one
_sums: dict[tuple[int, int, int, int, int], str] = {}  # (dev, ino, size, mtime, ctime) -> sha256, per process


def record_path(cache: Path) -> Path:
    return cache.with_name(cache.name + RECORD_SUFFIX)


def _sha256_fd(fd: int) -> str:
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in _sums:
        return _sums[key]
    h = hashlib.sha256()
    pos = 0
    while chunk := os.pread(fd, _CHUNK, pos):
        h.update(chunk)
        pos += len(chunk)
    _sums[key] = h.hexdigest()
    return _sums[key]


def write_record(cache_tmp: Path, record_tmp: Path, model_digest: str) -> None:
    """Record the size and checksum of the built cache ``cache_tmp`` (and the model content) in ``record_tmp``."""
    try:
        fd = os.open(cache_tmp, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size, digest = os.fstat(fd).st_size, _sha256_fd(fd)
        finally:
            os.close(fd)
        text = json.dumps({"format": _FORMAT, "model": model_digest, "size": size, "sha256": digest})
        record_tmp.write_text(text + "\n")
    except OSError as e:
        raise OutputError(f"cannot record the XNNPACK weight cache: {e.strerror}", cache_tmp) from None


def _read_record(cache: Path) -> dict[str, object] | str:
    try:
        fd = os.open(record_path(cache), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return f"no record {record_path(cache).name} of its size and checksum (not written by convert --prepack)"
    try:
        data = os.read(fd, _MAX_RECORD + 1)
    finally:
        os.close(fd)
    try:
        record = json.loads(data) if len(data) <= _MAX_RECORD else None
    except (ValueError, UnicodeDecodeError):
        record = None
    if (
        not isinstance(record, dict)
        or record.get("format") != _FORMAT
        or not isinstance(record.get("size"), int)
        or not isinstance(record.get("sha256"), str)
        or not isinstance(record.get("model"), str)
    ):
        return f"its record {record_path(cache).name} is malformed"
    return record


def open_verified(cache: Path, model_digest: str) -> tuple[int | None, str]:
    """An fd of ``cache`` whose content is what its record says, built for ``model_digest``; else (None, why)."""
    record = _read_record(cache)
    if isinstance(record, str):
        return None, record
    if record["model"] != model_digest:
        return None, "its record says it was built for other model content"
    try:
        fd = os.open(cache, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return None, f"cannot open it ({e.strerror}; a symbolic link is never used)"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif st.st_size != record["size"]:
            why = f"{st.st_size:,} bytes, but {record['size']:,} when it was built (truncated or replaced)"
        elif _sha256_fd(fd) != record["sha256"]:
            why = "its content differs from the checksum recorded when it was built (damaged or replaced)"
        else:
            return fd, "matches"
    except OSError as e:
        why = f"cannot read it ({e.strerror})"
    os.close(fd)
    return None, why


def fd_path(fd: int, fallback: Path) -> str:
    """A path that names the open file ``fd`` itself, whatever is renamed over its name meanwhile."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else str(fallback)


class HeldFd:
    """Keeps a verified cache descriptor open as long as the model that maps it (closed with it)."""

    def __init__(self, fd: int):
        self.fd: int | None = fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()
