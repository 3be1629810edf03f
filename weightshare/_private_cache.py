"""A private per-user cache directory: what weightshare remembers between runs (verified ``--prepack`` blobs,
measured verdicts) lives in files only this user can read or write, each written whole or not at all.

Trust rests on the directory being ours and private (mode 0700, our uid, not a link) and on each entry being a
regular 0600 file of ours; callers seal what they store with an HMAC under a per-directory random key
(``seal_key``), so an entry edited or planted by anything else is refused, never believed.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["cache_path", "open_private_dir", "read_small", "seal_key", "write_atomic"]

KEY_NAME = "key"
KEY_BYTES = 32


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
