"""What is shown on stderr while work runs: a conversion's byte bar and the clock of each phase that writes no
bytes, the named stages of check, inspect, bench and demo; one line per stage with -v; nothing on a pipe without
it. Never on stdout, where a JSON document stays clean."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .._placement import Progress
from ._render import VERBOSITY, err, size


@dataclass(frozen=True)
class ProgressHooks:
    """What a conversion reports as it goes (``ConvertOptions.progress``, ``progress_total``, ``stage``)."""

    update: Progress | None = None
    total: Callable[[int], None] | None = None
    stage: Callable[[str], None] | None = None


class _StageClock:
    """The phase of a conversion that writes no bytes (reading the model, a runtime's child process), named on
    the progress bar with its elapsed time, redrawn twice a second: a bar frozen at 0 B for minutes reads as hung."""

    def __init__(self, bar: Any) -> None:
        import threading

        self._bar = bar
        self._lock = threading.Lock()
        self._label = ""
        self._since = 0.0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="weightshare-stage-clock", daemon=True)
        self._thread.start()

    def name(self, label: str) -> None:
        """Show ``label`` and a clock from now (the byte counts are off until ``bytes_follow``)."""
        import time

        with self._lock:
            self._label, self._since = label, time.monotonic()
            self._bar.bar_format = "{desc}"
            self._draw()

    @property
    def showing(self) -> bool:
        """A phase is named (no bytes counted since)."""
        return bool(self._label)

    def bytes_follow(self) -> None:
        """Payload bytes are written now: the bar shows them again."""
        with self._lock:
            self._label = ""
            self._bar.bar_format = None

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _draw(self) -> None:
        import time

        elapsed = self._bar.format_interval(time.monotonic() - self._since)
        self._bar.set_description_str(f"{self._label} [{elapsed}]")

    def _tick(self) -> None:
        while not self._stopped.wait(0.5):
            with self._lock:
                if self._label:
                    self._draw()


@contextmanager
def progress_bar(enabled: bool, desc: str) -> Iterator[ProgressHooks]:
    """A conversion's progress, on stderr only. On a terminal: a byte bar while payloads are written and, in every
    phase that writes none (reading, the runtime's child processes), the phase's name and its elapsed clock. With
    -v, one line per phase, on a terminal too (above the bar). Nothing else in pipes and CI. ``enabled`` false
    (-q, machine output): no bar; -v's lines still go to stderr, where they leave JSON on stdout clean."""
    lines = VERBOSITY["level"] > 0
    if not (enabled and sys.stderr.isatty()):

        def line(message: str) -> None:
            err.print(f"{desc}: {message} ...", markup=False, highlight=False, soft_wrap=True)

        yield ProgressHooks(
            None, (lambda n: line(f"writing {size(n)} of payloads")) if lines else None, line if lines else None
        )
        return
    from tqdm import tqdm

    bar = tqdm(
        desc=f"{desc}: reading",
        bar_format="{desc}",  # no byte counts before there are bytes to count
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
        file=sys.stderr,
    )
    clock = _StageClock(bar)

    def stage(message: str) -> None:
        clock.name(f"{desc}: {message}")
        if lines:  # after the bar shows the new stage: tqdm redraws the bar below the line
            tqdm.write(f"{desc}: {message} ...", file=sys.stderr)

    def total(n: int) -> None:
        clock.bytes_follow()
        bar.set_description_str(desc, refresh=False)
        bar.reset(total=n)
        if lines:
            tqdm.write(f"{desc}: writing {size(n)} of payloads ...", file=sys.stderr)

    def update(n: int) -> None:
        if clock.showing:  # bytes written with no total announced first (Core ML): count them from here
            clock.bytes_follow()
            bar.set_description_str(desc, refresh=False)
        bar.update(n)

    clock.name(f"{desc}: reading")
    try:
        yield ProgressHooks(update, total, stage)
    finally:
        clock.close()
        bar.close()


@contextmanager
def stages(live: bool = True) -> Iterator[Callable[[str], None]]:
    """Named stages of long work, on stderr only: a spinner naming the current stage on a terminal (``live``:
    not under machine output), one line per stage with -v (on a terminal too), nothing in a pipe without -v and
    nothing with -q. Never on stdout: JSON there stays clean. Yields ``stage(text)``, which names the next one."""
    lines = VERBOSITY["level"] > 0

    def line(text: str) -> None:
        if lines:
            err.print(f"{text} ...", markup=False, highlight=False, soft_wrap=True)

    if not (live and VERBOSITY["level"] >= 0 and sys.stderr.isatty()):
        yield line
        return
    with err.status("") as status:

        def both(text: str) -> None:
            line(text)
            status.update(f"{text} ...")

        yield both


@contextmanager
def measuring(enabled: bool, what: str) -> Iterator[Callable[[str], None]]:
    """``stages`` while a command waits for its runtime children (check, inspect), the first named ``what``;
    nothing when ``enabled`` is false (nothing is measured)."""
    if not enabled:
        yield lambda text: None
        return
    with stages() as stage:
        stage(what)
        yield stage
