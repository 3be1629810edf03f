"""Which temporaries a run may remove: only a dead run's, and only what is provably weightshare's.

A temporary's name is exactly one weightshare gives (``_atomic``): a transaction's output
``.weightshare-tmp-<pid>-<token>-<random>-<name>`` or guard ``.weightshare-tmp-<pid>-<token>.guard``, or a staging
directory ``.weightshare-tmp-<random>-<label>`` (mode 0o700). A transaction's output is removed only when its guard
is still there (beside it or in a parent) and no live writer holds it: a dead run's; the guard goes last, once
nothing it protects is left. A staging directory is removed once its own lock is free. Anything else with the
prefix (a user's ``.weightshare-tmp-notes.txt``, a directory of theirs) is kept.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: the package still imports; an OutputTransaction refuses (require_posix)
    fcntl = None  # type: ignore[assignment]

TMP_PREFIX = ".weightshare-tmp-"


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None when another process holds it (or it vanished)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def guard_name(pid: int | str, token: str) -> str:
    return f"{TMP_PREFIX}{pid}-{token}.guard"


# The exact names weightshare gives its temporaries: a transaction's output or guard (``<pid>-<token>``), a
# staging directory (``<random>-<label>``). Only those are ever cleaned; a user's ``.weightshare-tmp-notes`` is not.
_TX_NAME = re.compile(r"\.weightshare-tmp-(\d+)-([0-9a-f]{12})(?:-[0-9a-f]{8}-.|\.guard\Z)", re.S)
_STAGE_NAME = re.compile(r"\.weightshare-tmp-[0-9a-f]{16}-[a-z][a-z-]*")


def temporary(name: str) -> bool:
    """``name`` is one weightshare gives its temporaries (whoever's, alive or dead)."""
    return bool(_TX_NAME.match(name) or _STAGE_NAME.fullmatch(name))


def _guard_dead(entry: Path, name: str) -> bool:
    """The transaction guard ``name`` (in the entry's directory or an ancestor) exists and no live writer holds
    it: the proof that ``entry`` is a dead run's. A missing guard proves nothing; a held one protects it."""
    for d in (entry.parent, *entry.parent.parents):
        try:
            fd = os.open(d / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return False  # its writer holds it
        finally:
            os.close(fd)
        return True
    return False


def _orphaned(directory: Path, prefix: str) -> bool:
    """Nothing of the transaction ``prefix`` is left in ``directory`` or below: its dead guard proves no more."""
    for _here, dirs, names in os.walk(directory):
        if any(n.startswith(prefix) for n in (*dirs, *names)):
            return False
        dirs[:] = [d for d in dirs if not d.startswith(TMP_PREFIX)]
    return True


def _stale(entry: Path, st: os.stat_result) -> bool:
    """``entry`` is provably a dead run's temporary (its own lock, if any, is already taken by the caller)."""
    m = _TX_NAME.match(entry.name)
    if m is None:  # a staging directory: its exact name and its mode (made 0o700) are its proof
        return bool(_STAGE_NAME.fullmatch(entry.name)) and stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o077
    guard = guard_name(m[1], m[2])
    if entry.name != guard:
        return _guard_dead(entry, guard)
    return stat.S_ISREG(st.st_mode) and st.st_size == 0 and _orphaned(entry.parent, guard[: -len(".guard")] + "-")


def clean_stale_temporaries(directory: Path) -> list[Path]:
    """Remove temporaries that no live process holds and that are provably weightshare's (``_stale``): guards
    last, once nothing they protect is left."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    entries = [e for e in directory.iterdir() if e.name.startswith(TMP_PREFIX)]
    for entry in sorted(entries, key=lambda e: e.name.endswith(".guard")):
        fd = _try_lock(entry)  # None: a link, gone, or a live writer holds it, whatever its PID looks like here
        if fd is None:
            continue
        try:
            st = os.fstat(fd)
            if not _stale(entry, st):
                continue
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        finally:
            os.close(fd)
        removed.append(entry)
    return removed


def sweep_temporaries(root: Path) -> list[Path]:
    """``clean_stale_temporaries`` in ``root`` and every directory below it (links not followed; temporary
    directories are removed whole, not entered): a run killed in a subdirectory of OUTDIR that holds no model
    left its temporaries where no later run would otherwise look."""
    removed: list[Path] = []
    if not root.is_dir() or root.is_symlink():
        return removed
    found: list[Path] = []
    for here, dirs, _names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(TMP_PREFIX)]
        found.append(Path(here))
    for d in reversed(found):  # deepest first: a guard in OUTDIR goes once what it proved below is gone
        removed += clean_stale_temporaries(d)
    return removed
