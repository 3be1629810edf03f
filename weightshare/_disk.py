"""The temporary disk a conversion uses: bytes allocated under a directory, and their peak while a context is open
(sampled in a thread; ``--prepack`` reports it next to the final outputs)."""

from __future__ import annotations

import os
import threading
from types import TracebackType

__all__ = ["DiskPeak", "allocated_bytes"]


def allocated_bytes(root: str) -> int:
    """Bytes the file system allocated to the files under ``root`` (holes not counted)."""
    total = 0
    stack = [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_blocks * 512
                    except OSError:  # removed while scanning
                        continue
        except OSError:
            continue
    return total


class DiskPeak:
    """The peak of the bytes allocated under ``root`` above its start, while the context is open."""

    def __init__(self, root: str | os.PathLike[str], interval: float = 0.02) -> None:
        self.root = os.fspath(root)
        self.interval = interval
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        self.peak = max(self.peak, allocated_bytes(self.root) - self.baseline)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> DiskPeak:
        self.baseline = allocated_bytes(self.root)
        self._thread = threading.Thread(target=self._run, name="weightshare-disk-peak", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
