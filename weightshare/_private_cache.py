"""A private per-user cache directory: what weightshare remembers between runs (verified ``--prepack`` blobs,
measured verdicts) lives in files only this user can read or write, each written whole or not at all.

Trust rests on the directory being ours and private (mode 0700, our uid, not a link) and on each entry being a
regular 0600 file of ours; callers seal what they store with an HMAC under a per-directory random key
(``seal_key``), so an entry edited or planted by anything else is refused, never believed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Bound",
    "cache_path",
    "open_private_dir",
    "prune",
    "read_sealed",
    "read_small",
    "seal_key",
    "write_atomic",
    "write_sealed",
]

KEY_NAME = "key"
KEY_BYTES = 32
TMP_AGE_S = 3600  # a killed writer's temporary goes after an hour


def cache_path(name: str) -> Path | None:
    """``$XDG_CACHE_HOME/weightshare/NAME`` (else ``~/.cache/...``); None when neither base is an absolute path."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not base or not os.path.isabs(base):
        home = os.environ.get("HOME", "")
        if not home or not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    return Path(base) / "weightshare" / name


def _ours(st: os.stat_result, mode: int) -> bool:
    return st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077 == 0 and stat.S_IFMT(st.st_mode) == mode


@contextmanager
def open_private_dir(path: Path | None, create: bool) -> Iterator[int | None]:
    """A descriptor on ``path`` if it is ours and private (created 0700 when ``create``); None otherwise."""
    if path is None:
        yield None
        return
    if create:
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:
            yield None
            return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        yield None
        return
    try:
        yield fd if _ours(os.fstat(fd), stat.S_IFDIR) else None
    finally:
        os.close(fd)


def read_small(name: str, dir_fd: int, limit: int) -> bytes | None:
    """The bytes of ``name`` in ``dir_fd`` if it is a regular 0600 file of ours no larger than ``limit``."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not _ours(st, stat.S_IFREG) or st.st_size > limit:
            return None
        return os.pread(fd, limit + 1, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


def write_atomic(name: str, data: bytes, dir_fd: int, replace: bool = True) -> bool:
    """Write ``data`` to a private temporary in ``dir_fd`` and rename it to ``name`` (not over one if not
    ``replace``); False on any failure, leaving nothing behind."""
    tmp = f".tmp-{secrets.token_hex(8)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        if replace:
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        else:
            os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            os.unlink(tmp, dir_fd=dir_fd)
        return True
    except OSError:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        return False


def seal_key(dir_fd: int, create: bool) -> bytes | None:
    """The directory's random HMAC key (made when ``create`` and missing; a racing writer may win, and both then
    read the one that was linked in); None when there is none or it is not ours."""
    key = read_small(KEY_NAME, dir_fd, KEY_BYTES)
    if key is None and create:
        write_atomic(KEY_NAME, secrets.token_bytes(KEY_BYTES), dir_fd, replace=False)
        key = read_small(KEY_NAME, dir_fd, KEY_BYTES)
    return key if key is not None and len(key) == KEY_BYTES else None


@dataclass(frozen=True)
class Bound:
    """How a cache is kept small: its entries are ``name_len`` hex digits long; at most ``max_entries`` (the least
    recently written go), and none older than ``max_age_s`` when set."""

    name_len: int
    max_entries: int
    max_age_s: float | None = None


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).hexdigest().encode()


def read_sealed(path: Path | None, name: str, limit: int) -> bytes | None:
    """The body of entry ``name`` in the private directory ``path`` if its seal is the directory key's HMAC of it;
    None for a missing, foreign, oversized or edited entry (a miss, never an error)."""
    with open_private_dir(path, create=False) as dir_fd:
        if dir_fd is None:
            return None
        key = seal_key(dir_fd, create=False)
        data = read_small(name, dir_fd, limit)
    if key is None or data is None:
        return None
    body, _, mac = data.rpartition(b"\n")
    return body if hmac.compare_digest(mac, _mac(key, body)) else None


def write_sealed(path: Path | None, name: str, body: bytes, bound: Bound) -> bool:
    """Write ``body`` sealed under ``name`` in the private directory ``path`` (created), then keep the directory
    within ``bound``; False when the directory is not usable (best effort: a cache that cannot be written is only
    slower)."""
    with open_private_dir(path, create=True) as dir_fd:
        key = None if dir_fd is None else seal_key(dir_fd, create=True)
        if dir_fd is None or key is None:
            return False
        done = write_atomic(name, body + b"\n" + _mac(key, body), dir_fd)
        prune(dir_fd, name, bound)
    return done


def prune(dir_fd: int, keep: str, bound: Bound, now: float | None = None) -> None:
    """Keep the directory within ``bound`` (``keep``, just written, counts as newest); best effort, concurrent
    writers may prune the same."""
    now = time.time() if now is None else now
    entries: list[tuple[float, str]] = []
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return
    for n in names:
        is_entry = len(n) == bound.name_len and all(c in "0123456789abcdef" for c in n)
        if not is_entry and not n.startswith(".tmp-"):
            continue  # the key, or nothing of ours
        try:
            st = os.stat(n, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if not is_entry:
            if now - st.st_mtime > TMP_AGE_S:
                _unlink(n, dir_fd)
        elif n != keep and bound.max_age_s is not None and now - st.st_mtime > bound.max_age_s:
            _unlink(n, dir_fd)
        else:
            entries.append((now if n == keep else st.st_mtime, n))
    for _mtime, n in sorted(entries, reverse=True)[bound.max_entries :]:
        _unlink(n, dir_fd)


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
