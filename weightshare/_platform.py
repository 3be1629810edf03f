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

__all__ = ["TreePeak", "require_posix", "rss_bytes", "same_file", "tree_rss_bytes"]


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


def own_peak_mib() -> float:
    """This process's own peak RSS in MiB: ``VmHWM``. Not getrusage's ``ru_maxrss`` first, which Linux carries from
    the process that forked it (a converter started by a 1.7 GB parent reported 1708 MiB while /proc showed 73);
    ``ru_maxrss`` only where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # not on Windows, where nothing gets this far (require_posix)
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak / 1024 if sys.platform != "darwin" else peak / 2**20)  # Linux: KiB; macOS: bytes


def same_file(path: Path, fd: int) -> bool:
    """``fd`` (just locked) is still the file at ``path``. A concurrent run's cleanup may have removed it before the
    lock: then False, and the caller retries (raising there ended runs with exit 2 "No such file or directory")."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    """The live children of ``pid``, from every one of its threads (a child forked by a worker thread is that
    thread's: ``/proc/PID/task/TID/children``, Linux >= 3.5)."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except (OSError, ValueError):
            continue
    return kids


def rss_bytes(pid: int | str) -> int:
    """The resident set of ``pid`` ("self": this process) in bytes, from its kernel counters (no page walk)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0  # exited between the listing and the read


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def tree_rss_bytes(root: int | None = None) -> int:
    """The RSS of ``root`` (this process) and every live descendant, summed: what the machine holds for a run
    at this instant. 0 where there is no ``/proc``."""
    pids, seen, total = [root if root is not None else os.getpid()], set(), 0
    while pids:
        pid = pids.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += rss_bytes(pid)
        pids += _children(pid)
    return total


class TreePeak:
    """The process tree's peak memory over a run: the highest sum, sampled every ``interval`` seconds, of the RSS
    of this process and all its live descendants (one ORT child at a time, or several, plus the converter).

    One child's ``ru_maxrss`` is not it: it misses the parent beside the child and every other child; a sum of
    per-process peaks overstates what was ever held at once. ``peak_since(t)`` answers for any window that ends
    now (a batch's models and the whole run from one sampler): the samples are kept as a decreasing run of
    maxima, so the answer is the first kept sample at or after ``t``.
    """

    def __init__(self, interval: float = 0.05) -> None:
        import collections
        import threading
        import time

        self._clock = time.perf_counter
        self._maxima: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = interval
        self.sample()
        self._thread = threading.Thread(target=self._run, name="weightshare-tree-peak", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def sample(self) -> int:
        now, rss = self._clock(), tree_rss_bytes()
        with self._lock:
            while self._maxima and self._maxima[-1][1] <= rss:
                self._maxima.pop()
            self._maxima.append((now, rss))
        return rss

    def peak_since(self, t: float) -> int:
        """The highest sample taken at ``time.perf_counter()`` >= ``t`` (one taken now included)."""
        self.sample()
        with self._lock:
            return next((rss for when, rss in self._maxima if when >= t), 0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
