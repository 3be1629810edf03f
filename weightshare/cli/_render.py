"""Everything the commands print: the consoles, verbosity, progress bars and the report tables."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

from ..report import ConversionReport, JsonDict, ZooReport

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table as RichTable

    from .._findings import Finding
    from .._folder import FolderReport
    from .._inventory import ModelInventory, PayloadInfo


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
    t = Table(title=f"{len(z.models)} models -> {', '.join(z.blobs or [z.blob])}", title_justify="left")
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
    if z.folder:
        out.print(f"{len(z.copied)} other files copied ({size(z.copied_bytes)}): the folder's tree is kept")
    for note in [n for m in z.models for n in m.notes] + z.notes:
        info(note if note.startswith("warning:") else f"note: {note}")


def text_width() -> int | None:
    """The columns ``inspect``'s text must fit: the terminal's; in a pipe, COLUMNS when it is set (None: no limit,
    every table as wide as it needs)."""
    if sys.stdout.isatty():
        return int(out.width)
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else None


def wrap(text: str, width: int | None, indent: str = "  ") -> str:
    """``text`` as whole lines of at most ``width`` columns (continuations indented), unchanged without a width."""
    if width is None:
        return text
    import textwrap

    return textwrap.fill(text, width, subsequent_indent=indent, break_long_words=True, break_on_hyphens=False) or text


def _plain(text: str, width: int | None = None, indent: str = "  ") -> None:
    """A line of ours, wrapped by us: rich neither re-wraps it nor reads markup in it."""
    out.print(wrap(text, width, indent), markup=False, highlight=False, soft_wrap=True)


def _payload_note(p: PayloadInfo) -> str:
    reasons = (
        p.unpacked_at_load,
        p.copy_reason,
        f"duplicate of {p.duplicate_of}" if p.duplicate_of else "",
        p.problem,
        p.stays_inline_because,
    )
    return "; ".join(x for x in reasons if x)


def _payload_table(inv: ModelInventory, rows: list[PayloadInfo], settings: list[str], keys: dict[str, int]) -> Any:
    """One row per payload; its note as the number of a line printed under the table (notes repeat, and a note
    column would be wider than the rest together)."""
    from rich.text import Text

    t = Table(title=Text(f"{inv.model} ({inv.format}, {size(inv.file_bytes)})"), title_justify="left")
    for col in ("payload", "dtype", "size", "where", "encoding", "align"):
        t.add_column(col, justify="right" if col in ("size", "align") else "left")
    for setting in settings or ["per session"]:
        t.add_column(f"copied/session\n{setting}" if settings else "copied/session", justify="right")
    t.add_column("note", justify="right")
    for p in rows:
        copies = [p.copies.get(s, p.copied_per_session) for s in settings] if settings else [p.copied_per_session]
        note = _payload_note(p)
        cells = [p.name, p.dtype, size(p.nbytes), _where(p), p.encoding, str(p.alignment or "")]
        cells += [size(c) if c else "0" for c in copies]
        t.add_row(*map(Text, cells), Text(f"[{keys[note]}]" if note else ""))
    return t


def _where(p: PayloadInfo) -> str:
    return "embedded" if p.location == "embedded" else f"{p.file}@{p.offset}"


def _fits(table: Any, width: int | None) -> bool:
    if width is None:
        return True
    from rich.measure import Measurement

    options = out.options.update_width(1 << 16)
    return bool(Measurement.get(out, options, table).maximum <= width)


def _stacked(inv: ModelInventory, rows: list[PayloadInfo], settings: list[str], width: int) -> None:
    """The payloads as records of whole lines, for a terminal too narrow for the table: nothing cut, nothing
    wrapped one word per line."""
    _plain(f"{inv.model} ({inv.format}, {size(inv.file_bytes)})", width)
    for p in rows:
        _plain(p.name, width)
        align = f", aligned to {p.alignment}" if p.alignment else ""
        _plain(f"  {p.dtype}, {size(p.nbytes)}, {_where(p)}, {p.encoding}{align}", width, "    ")
        if settings:
            copies = "; ".join(f"{s} {size(p.copies.get(s, p.copied_per_session))}" for s in settings)
        else:
            copies = size(p.copied_per_session)
        _plain(f"  copied per session: {copies}", width, "    ")
        note = _payload_note(p)
        if note:
            _plain(f"  note: {note}", width, "    ")


def render_inventory(inv: ModelInventory, findings: list[Finding], limit: int) -> None:
    """``inspect``: the payload table (largest first, ``limit`` rows; 0 for all), the totals and the findings.

    The table when it fits the terminal (or COLUMNS in a pipe), each payload as a few whole lines when it does
    not; every other line wrapped to the width as whole lines."""
    width = text_width()
    rows = sorted(inv.payloads, key=lambda p: -p.nbytes)
    shown = rows[: limit or None]
    settings = inv.settings[:3] if len(inv.settings) > 1 else []
    keys: dict[str, int] = {}
    for note in filter(None, map(_payload_note, shown)):
        keys.setdefault(note, len(keys) + 1)
    table = _payload_table(inv, shown, settings, keys)
    if _fits(table, width):
        out.print(table)
        for note, key in keys.items():
            _plain(f"[{key}] {note}", width, "    ")
    else:
        assert width is not None
        _stacked(inv, shown, settings, width)
    if limit and len(rows) > limit:
        _plain(f"... {len(rows) - limit} smaller payloads not shown (--limit 0 shows all)", width)
    moves = sum(1 for p in inv.payloads if p.would_move)
    per_setting = "; ".join(f"{s}: {size(inv.copied_under(s))}" for s in settings) or size(inv.copied_per_session)
    _plain(
        f"{len(inv.payloads)} payloads: {size(inv.embedded_bytes)} embedded, {size(inv.external_bytes)} "
        f"external, {size(inv.duplicate_bytes)} duplicated. Copied per session: {per_setting}. "
        f"`convert` would move {moves} payloads and unpack "
        f"{sum(1 for p in inv.payloads if p.unpacked_at_load)}.",
        width,
        "",
    )
    if inv.measured:
        measured = "; ".join(f"{s}: {size(n)}" for s, n in inv.measured.items())
        _plain(
            f"Measured, one more session costs: {measured} (the runtime asked in child processes, PSS from 1 to 4 "
            "sessions).",
            width,
            "",
        )
    for note in inv.notes + inv.measure_notes:
        _plain(f"note: {note}", width)
    render_findings(findings, with_file=False, width=width)


def finding_line(f: Finding, with_file: bool = True) -> str:
    """One finding without its fix (``render_findings`` prints each code's fix once)."""
    return f"{f.file + ': ' if with_file else ''}{f.severity.value}: {f.code.value}: {f.message}"


def render_findings(findings: list[Finding], with_file: bool = True, width: int | None = None) -> None:
    """One line per finding, then the fix of each code once (a batch of models repeats a code on many lines).

    A file that could not be read is bad input: its line goes to stderr, where every command's errors go; a path
    with no file at all is said so (``no such file: PATH``), with no fix to give but the path. ``width``: each
    line wrapped to it (inspect, for a reader; check keeps one line per finding, for grep)."""
    fixes: dict[str, str] = {}
    for f in findings:
        if f.code.value == "unreadable-model":
            missing = f.message == "no such file"
            line = f"weightshare: error: no such file: {f.file}" if missing else finding_line(f, with_file)
            print(line, file=sys.stderr)
            if missing:
                continue
        else:
            print(wrap(finding_line(f, with_file), width))
        fixes.setdefault(f.code.value, f.fix)
    for code, fix in fixes.items():
        print(wrap(f"fix: {code}: {fix}", width), file=sys.stderr if code == "unreadable-model" else sys.stdout)


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
        for note in result.notes:
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
