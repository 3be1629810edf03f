"""Everything the commands print: the consoles, verbosity, progress bars and the report tables."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from .._placement import Progress
from ..report import ConversionReport, ZooReport

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table as RichTable


# Not a terminal (a pipe, a CI log): no width to fit, so tables are never cut at rich's default 80 columns.
# Colour (and any other escape code) only on a terminal; none at all with NO_COLOR (https://no-color.org).
_STYLES: Literal["auto"] | None = None if os.environ.get("NO_COLOR") else "auto"
# rich is imported on first use (about 0.03 CPU s of start-up that `convert -q`, `check` and --version never need).


class _LazyConsole:
    """A rich ``Console`` on stdout or stderr, made when first used."""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            from rich.console import Console

            tty = (sys.stderr if self._stderr else sys.stdout).isatty()
            self._console = Console(
                stderr=self._stderr, width=None if tty else 4096, highlight=False, color_system=_STYLES
            )
        return getattr(self._console, name)


out = cast("Console", _LazyConsole(stderr=False))
err = cast("Console", _LazyConsole(stderr=True))


def Table(*args: Any, **kwargs: Any) -> RichTable:
    """``rich.table.Table``, imported on first use."""
    from rich.table import Table

    return Table(*args, **kwargs)


# -1 quiet (errors and findings only), 0 normal, 1 verbose; set by the global -q/-v and the commands' own -q.
VERBOSITY = {"level": 0}


def quiet(flag: bool) -> bool:
    if flag:
        VERBOSITY["level"] = -1
    return VERBOSITY["level"] < 0


def info(message: str) -> None:
    """Normal output a user may want; silenced by -q."""
    if VERBOSITY["level"] >= 0:
        out.print(message, markup=False, highlight=False, soft_wrap=True)


def detail(message: str) -> None:
    """Shown with -v only."""
    if VERBOSITY["level"] > 0:
        out.print(message, markup=False, highlight=False, soft_wrap=True)


@contextmanager
def progress_bar(enabled: bool, desc: str) -> Iterator[tuple[Progress | None, Callable[[int], None] | None]]:
    """A byte progress bar on stderr when it is a terminal; nothing in pipes and CI."""
    if not enabled or not sys.stderr.isatty():
        yield None, None
        return
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr)

    def total(n: int) -> None:
        bar.reset(total=n)

    try:
        yield bar.update, total
    finally:
        bar.close()


def _mib(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def render_report(r: ConversionReport) -> None:
    t = Table(title=f"{r.model} ({r.format})", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("written", "\n".join(r.outputs))
    t.add_row("payloads moved", f"{r.tensors_moved} ({_mib(r.bytes_in)} in, {_mib(r.bytes_out)} after unpacking)")
    t.add_row(
        "unique bytes stored",
        f"{_mib(r.bytes_written)} ({r.deduplicated} duplicates, {_mib(r.deduplicated_bytes)} saved)",
    )
    t.add_row(
        "unpacked",
        f"{r.unpacked} payloads ({_mib(r.unpacked_bytes_in)} -> {_mib(r.unpacked_bytes_out)}), "
        f"{r.ops_removed} ops removed",
    )
    t.add_row("kept inline", f"{r.inline_kept} ({r.inline_kept_bytes:,} bytes)")
    t.add_row("blob size", _mib(r.blob_bytes))
    t.add_row("time / peak RSS", f"{r.wall_time_s:.2f} s / {r.peak_rss_mib:.0f} MiB")
    for note in r.notes:
        t.add_row("note", note)
    out.print(t)


def render_zoo(z: ZooReport) -> None:
    t = Table(title=f"{len(z.models)} models -> {z.blob}", title_justify="left")
    for col in ("model", "payloads", "bytes in", "after unpacking", "new unique bytes", "deduplicated"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for m in z.models:
        t.add_row(
            Path(m.model).name,
            str(m.tensors_moved),
            _mib(m.bytes_in),
            _mib(m.bytes_out),
            _mib(m.bytes_written),
            str(m.deduplicated),
        )
    t.add_row(
        "total",
        str(sum(m.tensors_moved for m in z.models)),
        _mib(z.bytes_in),
        _mib(z.bytes_out),
        _mib(z.bytes_written),
        str(sum(m.deduplicated for m in z.models)),
        style="bold",
    )
    out.print(t)
    out.print(
        f"blob {_mib(z.blob_bytes)}; dedupe ratio {z.dedupe_ratio:.2f}x; "
        f"{z.wall_time_s:.2f} s, peak RSS {z.peak_rss_mib:.0f} MiB"
    )
