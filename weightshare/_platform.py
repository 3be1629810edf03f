"""Which systems weightshare runs on.

Linux: everything. macOS: everything but the runtimes that do not exist there (Core ML is the reason to be
there). Windows: the package imports, so that a program can load converted models through ``weightshare.ort``;
what needs POSIX file APIs (positioned reads for every model read, ``flock`` for the all-or-nothing outputs)
refuses with one line instead of failing half-way.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

from .errors import Unsupported

__all__ = ["require_posix", "same_file"]


def _missing() -> list[str]:
    missing = [f"os.{name}" for name in ("pread",) if not hasattr(os, name)]
    if importlib.util.find_spec("fcntl") is None:
        missing.append("fcntl.flock")
    return missing


def require_posix(what: str) -> None:
    """Refuse ``what`` (e.g. "convert") on a system without the POSIX file APIs it needs.

    Args:
        what: the operation, for the message.

    Raises:
        Unsupported: ``os.pread`` or ``fcntl`` is missing (Windows).
    """
    missing = _missing()
    if missing:
        raise Unsupported(
            f"{what} needs POSIX file APIs this system lacks ({', '.join(missing)}); run it on Linux or macOS "
            "(the converted models load on any system)"
        )


def malloc_trim() -> bool:
    """Hand freed heap pages back to the OS (glibc), e.g. after closing sessions.

    Returns:
        True when ``malloc_trim`` ran; False where the C library has none.
    """
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def same_file(path: Path, fd: int) -> bool:
    """``fd`` (just locked) is still the file at ``path``. A concurrent run's cleanup may have removed it before the
    lock: then False, and the caller retries (raising there ended runs with exit 2 "No such file or directory")."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
