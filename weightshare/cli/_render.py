"""Everything the commands print: the consoles, verbosity, progress bars and the report tables."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from .._placement import Progress
from ..report import ConversionReport, JsonDict, ZooReport

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table as RichTable

    from .._findings import Finding
    from .._folder import FolderReport
    from .._inventory import ModelInventory


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


def stage(message: str) -> None:
    """A stage of long work, on stderr (so JSON on stdout stays clean) whether or not it is a terminal: a command
    that works for tens of seconds says what it is doing; silenced by -q."""
    if VERBOSITY["level"] >= 0:
        err.print(f"{message} ...", markup=False, highlight=False, soft_wrap=True)


def detail(message: str) -> None:
    """Shown with -v only."""
    if VERBOSITY["level"] > 0:
        out.print(message, markup=False, highlight=False, soft_wrap=True)


@dataclass(frozen=True)
class ProgressHooks:
    """What a conversion reports as it goes (``ConvertOptions.progress``, ``progress_total``, ``stage``)."""

    update: Progress | None = None
    total: Callable[[int], None] | None = None
    stage: Callable[[str], None] | None = None


@contextmanager
def progress_bar(enabled: bool, desc: str) -> Iterator[ProgressHooks]:
    """A byte progress bar on stderr when it is a terminal, its description naming a phase that writes no bytes
    (the onnxruntime child of --prepack: seconds at 0 B otherwise); nothing in pipes and CI."""
    if not enabled or not sys.stderr.isatty():
        yield ProgressHooks()
        return
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr)

    def total(n: int) -> None:
        bar.set_description_str(desc, refresh=False)
        bar.reset(total=n)

    def stage(message: str) -> None:
        bar.set_description_str(f"{desc}: {message}")

    try:
        yield ProgressHooks(bar.update, total, stage)
    finally:
        bar.close()


def size(n: float) -> str:
    """The one way a byte count is printed: "2.0 GiB", "56.0 MiB", "3.5 KiB", "17 B"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{round(n)} B"


def size_mib(mib: float) -> str:
    """``size`` of a figure measured in MiB (peak RSS, PSS)."""
    return size(mib * (1 << 20))


def render_report(r: ConversionReport) -> None:
    t = Table(title=f"{r.model} ({r.format})", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("written", "\n".join(r.outputs))
    t.add_row("payloads moved", f"{r.tensors_moved} ({size(r.bytes_in)} in, {size(r.bytes_out)} after unpacking)")
    t.add_row(
        "unique bytes stored",
        f"{size(r.bytes_written)} ({r.deduplicated} duplicates, {size(r.deduplicated_bytes)} saved)",
    )
    t.add_row(
        "unpacked",
        f"{r.unpacked} payloads ({size(r.unpacked_bytes_in)} -> {size(r.unpacked_bytes_out)}), "
        f"{r.ops_removed} ops removed",
    )
    t.add_row("kept inline", f"{r.inline_kept} ({r.inline_kept_bytes:,} bytes)")
    t.add_row("blob size", size(r.blob_bytes))
    t.add_row("time / peak RSS", f"{r.wall_time_s:.2f} s / {size_mib(r.peak_rss_mib)}")
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
            size(m.bytes_in),
            size(m.bytes_out),
            size(m.bytes_written),
            str(m.deduplicated),
        )
    t.add_row(
        "total",
        str(sum(m.tensors_moved for m in z.models)),
        size(z.bytes_in),
        size(z.bytes_out),
        size(z.bytes_written),
        str(sum(m.deduplicated for m in z.models)),
        style="bold",
    )
    out.print(t)
    out.print(
        f"blob {size(z.blob_bytes)}; dedupe ratio {z.dedupe_ratio:.2f}x; "
        f"{z.wall_time_s:.2f} s, peak RSS {size_mib(z.peak_rss_mib)}"
    )


def render_inventory(inv: ModelInventory, findings: list[Finding], limit: int) -> None:
    """``inspect``: the payload table (largest first, ``limit`` rows; 0 for all), the totals and the findings."""
    rows = sorted(inv.payloads, key=lambda p: -p.nbytes)
    t = Table(title=f"{inv.model} ({inv.format}, {size(inv.file_bytes)})", title_justify="left")
    settings = inv.settings[:3] if len(inv.settings) > 1 else []
    for col in ("payload", "dtype", "size", "where", "encoding", "align"):
        t.add_column(col, justify="right" if col in ("size", "align") else "left")
    for setting in settings or ["per session"]:
        t.add_column(f"copied/session: {setting}" if settings else setting, justify="right")
    t.add_column("note")
    for p in rows[: limit or None]:
        where = "embedded" if p.location == "embedded" else f"{p.file}@{p.offset}"
        note = "; ".join(
            x
            for x in (
                p.unpacked_at_load,
                p.copy_reason,
                f"duplicate of {p.duplicate_of}" if p.duplicate_of else "",
                p.problem,
                p.stays_inline_because,
            )
            if x
        )
        copies = [p.copies.get(s, p.copied_per_session) for s in settings] if settings else [p.copied_per_session]
        t.add_row(
            p.name,
            p.dtype,
            size(p.nbytes),
            where,
            p.encoding,
            str(p.alignment or ""),
            *[size(c) if c else "0" for c in copies],
            note,
        )
    out.print(t)
    if limit and len(rows) > limit:
        out.print(f"... {len(rows) - limit} smaller payloads not shown (--limit 0 shows all)")
    moves = sum(1 for p in inv.payloads if p.would_move)
    per_setting = "; ".join(f"{s}: {size(inv.copied_under(s))}" for s in settings) or size(inv.copied_per_session)
    out.print(
        f"{len(inv.payloads)} payloads: {size(inv.embedded_bytes)} embedded, {size(inv.external_bytes)} "
        f"external, {size(inv.duplicate_bytes)} duplicated. Copied per session: {per_setting}. "
        f"`convert` would move {moves} payloads and unpack "
        f"{sum(1 for p in inv.payloads if p.unpacked_at_load)}."
    )
    if inv.measured:
        measured = "; ".join(f"{s}: {size(n)}" for s, n in inv.measured.items())
        out.print(
            f"Measured, one more session costs: {measured} (the runtime asked in child processes, PSS from 1 to 4 "
            "sessions)."
        )
    for note in inv.notes + inv.measure_notes:
        out.print(f"note: {note}")
    render_findings(findings, with_file=False)


def finding_line(f: Finding, with_file: bool = True) -> str:
    """One finding without its fix (``render_findings`` prints each code's fix once)."""
    return f"{f.file + ': ' if with_file else ''}{f.severity.value}: {f.code.value}: {f.message}"


def render_findings(findings: list[Finding], with_file: bool = True) -> None:
    """One line per finding, then the fix of each code once (a batch of models repeats a code on many lines).

    A file that could not be read is bad input: its line goes to stderr, where every command's errors go; a path
    with no file at all is said so (``no such file: PATH``), with no fix to give but the path."""
    fixes: dict[str, str] = {}
    for f in findings:
        if f.code.value == "unreadable-model":
            missing = f.message == "no such file"
            line = f"weightshare: error: no such file: {f.file}" if missing else finding_line(f, with_file)
            print(line, file=sys.stderr)
            if missing:
                continue
        else:
            print(finding_line(f, with_file))
        fixes.setdefault(f.code.value, f.fix)
    for code, fix in fixes.items():
        print(f"fix: {code}: {fix}", file=sys.stderr if code == "unreadable-model" else sys.stdout)


@contextmanager
def measuring(enabled: bool, what: str) -> Iterator[Callable[[str], None]]:
    """A stage line on stderr while a command waits for its runtime children (check, inspect): a spinner on a
    terminal, one plain line with -v elsewhere (a CI log), nothing with -q or when ``enabled`` is false. Never on
    stdout: JSON there stays clean. Yields ``stage(text)``, which names the next stage (check: each model)."""
    if not enabled or VERBOSITY["level"] < 0:
        yield lambda text: None
        return
    if sys.stderr.isatty():
        with err.status(f"{what} ...") as status:
            yield lambda text: status.update(f"{text} ...")
        return

    def line(text: str) -> None:
        if VERBOSITY["level"] > 0:
            err.print(f"{text} ...", markup=False, highlight=False, soft_wrap=True)

    line(what)
    yield line


def render_bench(result: JsonDict, plot_path: Path | None) -> None:
    """``bench``: PSS after N sessions, one row per variant and runtime setting."""
    counts = result["sessions"]
    t = Table(title=f"{result['model']}: PSS after N sessions in one process", title_justify="left")
    # LiteRT rows carry one instance's own buffers (activations, KV cache): next to what each extra instance
    # costs, they tell weight copies (the rest) apart
    buffers = len(counts) > 1 and all("buffers_mib" in r for r in result["rows"])
    extra = ["per extra", "buffers"] if buffers else []
    for col in ["variant", "setting", *[f"{n}" for n in counts], f"{counts[-1]}/1", *extra, "private", "shared"]:
        t.add_column(col, justify="left" if col in ("variant", "setting") else "right")
    groups: dict[tuple[str, str], list[JsonDict]] = {}
    for r in result["rows"]:
        groups.setdefault((r["variant"], r["mode"]), []).append(r)
    for (variant, mode), rows in groups.items():
        pss = [r["pss_mib"] for r in rows]
        t.add_row(
            variant,
            mode,
            *[size_mib(v) for v in pss],
            f"{pss[-1] / pss[0]:.2f}x",
            *(
                [size_mib((pss[-1] - pss[0]) / (counts[-1] - counts[0])), size_mib(rows[-1]["buffers_mib"])]
                if buffers
                else []
            ),
            size_mib(rows[-1]["private_mib"]),
            size_mib(rows[-1]["shared_mib"]),
        )
    out.print(t)
    if plot_path is not None:
        out.print(f"plot: {plot_path}")


def render_demo(result: JsonDict, sessions: int) -> None:
    """``demo``: file size and PSS of each variant, and the ratios."""
    t = Table(title=f"{sessions} sessions in one process")
    for col in ("model", "file size", "PSS 1 session", f"PSS {sessions} sessions", "per extra session"):
        t.add_column(col, justify="right" if col != "model" else "left")
    for row in result["rows"]:
        t.add_row(
            row["variant"],
            size(row["file_bytes"]),
            size_mib(row["pss_1_mib"]),
            size_mib(row["pss_n_mib"]),
            size_mib(row["per_session_mib"]),
        )
    out.print(t)
    out.print(f"converted: {result['converted']}  (outputs equal: {result['outputs_equal']})")
    out.print(
        f"PSS of {sessions} sessions: original {result['ratio_original']:.2f}x one session, "
        f"converted {result['ratio_converted']:.2f}x (disable_prepacking)"
    )
    out.print(
        f"at default options: original {result['ratio_original_default']:.2f}x, converted --prepack "
        f"{result['ratio_prepacked']:.2f}x  ({result['prepacked']}, outputs equal: "
        f"{result['prepacked_outputs_equal']})"
    )


def render_conversion(result: ZooReport | FolderReport | list[ConversionReport], output: Path, as_json: bool) -> None:
    """``convert``: a zoo's table, a model folder's lines, one model's report, or a batch's lines and totals; with
    ``as_json`` the one document every run has (``_contract.convert_document``)."""
    if as_json:
        from .._contract import convert_document

        print(json.dumps(convert_document(result), indent=2))
    elif isinstance(result, list):
        _render_batch(result)
    elif quiet(False):
        return
    elif isinstance(result, ZooReport):
        render_zoo(result)
    else:
        for r in result.models if VERBOSITY["level"] > 0 else []:
            render_report(r)
        for r in result.models:
            info(f"{r.model}: {r.tensors_moved} payloads moved, {size(r.bytes_written)} stored -> {r.outputs[0]}")
            for note in r.notes if VERBOSITY["level"] <= 0 else []:  # verbose: in the model's table above
                info(note if note.startswith("warning:") else f"note: {note}")
        info(
            f"total: {len(result.models)} models converted, {len(result.copied)} other files copied "
            f"({size(result.copied_bytes)}), {result.wall_time_s:.2f} s, peak RSS {size_mib(result.peak_rss_mib)} "
            f"-> {output}"
        )


def _render_batch(reports: list[ConversionReport]) -> None:
    if quiet(False):
        return
    if len(reports) == 1 or VERBOSITY["level"] > 0:
        for r in reports:
            render_report(r)
    if len(reports) > 1:
        for r in reports:
            info(
                f"{r.model}: {r.tensors_moved} payloads moved, {size(r.bytes_written)} stored, "
                f"{r.unpacked} unpacked, {r.wall_time_s:.2f} s, peak RSS {size_mib(r.peak_rss_mib)} -> {r.outputs[0]}"
            )
            for note in r.notes if VERBOSITY["level"] <= 0 else []:
                info(note if note.startswith("warning:") else f"note: {note}")
        from .._contract import totals

        t = totals(reports)
        info(
            f"total: {t['models']} models, {t['tensors_moved']} payloads moved, {size(t['bytes_written'])} stored, "
            f"{t['wall_time_s']:.2f} s, peak RSS {size_mib(t['peak_rss_mib'])}"
        )


def github(lines: list[str]) -> None:
    """``--format github``: workflow annotations on stdout, one per line (GitHub Actions shows them on the run)."""
    for line in lines:
        print(line)


def github_conversion(result: ZooReport | FolderReport | list[ConversionReport], output: Path) -> None:
    """``convert``/``merge --format github``: a notice per model converted, and one per note a report carries."""
    from .._contract import annotation

    reports = result if isinstance(result, list) else result.models
    lines = []
    for r in reports:
        lines.append(
            annotation(
                "notice",
                f"{r.tensors_moved} payloads moved, {size(r.bytes_written)} stored -> {r.outputs[0]}",
                r.model,
                "weightshare convert",
            )
        )
        lines += [annotation("notice", note, r.model, "weightshare convert") for note in r.notes]
    github(lines)
