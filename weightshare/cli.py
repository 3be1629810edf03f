"""The `weightshare` command: a thin Typer layer over ``weightshare.api``.

Exit codes: 0 ok, 1 a check or verify found a problem, 2 bad input or usage.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, NoReturn, cast

import typer
from typer.core import TyperCommand, TyperGroup

from . import api
from ._folder import is_model_folder
from .blob import ALIGN_THRESHOLD, LARGE_ALIGN, AlignPolicy, Progress
from .errors import WeightshareError
from .options import INLINE_THRESHOLD, ConvertOptions, Unpack
from .report import ConversionReport, JsonDict, ZooReport

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table as RichTable


def _flags_without_placeholder(command: TyperCommand | TyperGroup, ctx: Any) -> None:
    """typer prints a ``<bool>`` type beside every flag, which takes no value: show none (an empty metavar)."""
    for param in command.get_params(ctx):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


class _Command(TyperCommand):
    def format_help(self, ctx: Any, formatter: Any) -> None:  # typer._click types: not public
        _flags_without_placeholder(self, ctx)
        super().format_help(ctx, formatter)


class _Group(TyperGroup):
    def format_help(self, ctx: Any, formatter: Any) -> None:  # typer._click types: not public
        _flags_without_placeholder(self, ctx)
        super().format_help(ctx, formatter)


# markdown: docstring paragraphs are reflowed to the terminal width (rich mode kept their hard line breaks, which
# then wrapped again into ragged one-word lines). Help text with <angle brackets> puts them in `code spans`:
# markdown takes a bare <digest12> for an HTML tag and drops it.
app = typer.Typer(
    cls=_Group,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Rewrite ONNX, TFLite and Core ML models so that their weights are memory-mapped once and "
    "shared by every session, interpreter, function and process.",
)
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


def _version(value: bool) -> None:
    if value:
        from . import __version__

        print(f"weightshare {__version__}")
        raise typer.Exit(0)


@app.callback()
def _global(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    quiet_all: bool = typer.Option(
        False, "-q", "--quiet", help="Print nothing but errors, findings and requested JSON."
    ),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Print more detail (per-model tables, notes)."),
) -> None:
    """Rewrite ONNX, TFLite and Core ML models so that their weights are memory-mapped once and shared by every
    session, interpreter, function and process."""
    VERBOSITY["level"] = -1 if quiet_all else 1 if verbose else 0


def fail(message: str, code: int = 2) -> NoReturn:
    err.print(f"weightshare: error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


class Terminated(KeyboardInterrupt):
    """SIGTERM (timeout, docker stop, kill): unwound like Ctrl-C so that temporaries are removed."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn input problems into one line and exit code 2; never a traceback."""
    try:
        yield
    except WeightshareError as e:
        fail(e.line())
    except Terminated:
        fail("terminated; no output was left behind", 128 + signal.SIGTERM)
    except KeyboardInterrupt:
        fail("interrupted; no output was left behind", 130)
    except MemoryError:
        fail("out of memory")
    except OSError as e:
        fail(f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}")


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


@app.command()
def convert(
    models: list[Path] = typer.Argument(
        ...,
        help="ONNX (.onnx), TFLite (.tflite) or Core ML (.mlpackage) models, or one model folder: its tree is "
        "reproduced in OUTDIR, models converted, every other file copied.",
    ),
    output: Path = typer.Option(..., "-o", "--output", help="Output directory (created if missing)."),
    blob: str | None = typer.Option(
        None,
        "--blob",
        help="Blob name inside OUTDIR: the blob is written as "
        "`NAME.<digest12>.safetensors`, digest of its content (default NAME: "
        "MODEL.weights).",
    ),
    blob_grace: float = typer.Option(
        600.0,
        "--blob-grace",
        help="Seconds an earlier blob that no model in "
        "OUTDIR references any more is kept, for readers that opened the old model.",
    ),
    keep_packed: bool = typer.Option(
        False, "--keep-packed", help="Do not unpack: keep fp16 + Cast/DEQUANTIZE and typed protobuf fields as they are."
    ),
    unpack: list[Unpack] = typer.Option(
        [],
        "--unpack",
        metavar="sparse|dequantize|ort-cpu",
        help="Opt-in unpacking: 'sparse' (TFLite: DENSIFY of a "
        "constant sparse tensor becomes a dense constant). 'dequantize' (TFLite: weight-only int8, DEQUANTIZE of "
        "an int8 constant, stored once as the fp32 values LiteRT computes). 'ort-cpu' (ONNX: store fp16 "
        "weights as the fp32 copies ONNX Runtime's CPU provider makes per session; "
        "CPU-specific, a GPU provider would run fp16).",
    ),
    external: bool = typer.Option(
        False,
        "--external",
        help="TFLite: write weights to a safetensors blob referenced "
        "by ExternalBuffer groups. Only LiteRT CompiledModel loads these, the classic "
        "Interpreter does not.",
    ),
    prepack: bool = typer.Option(
        False,
        "--prepack",
        help="Share the runtime's packed weights too. ONNX: store "
        "ONNX Runtime's pre-packed MatMul/Gemm weights and NCHWc Conv weights (this CPU, "
        "this onnxruntime) in the blob, so plain default-option sessions share every byte; "
        "MODEL.portable.onnx is written as well for other CPUs (use weightshare.ort.session)."
        " Needs onnxruntime. TFLite: also write the XNNPACK weight cache of the converted "
        "model (its name carries a digest of the model, its blob and the LiteRT version); "
        "load with weightshare.litert.compiled_model.",
    ),
    align: int = typer.Option(LARGE_ALIGN, "--align", help="Alignment of payloads >= --align-threshold (bytes)."),
    align_threshold: int = typer.Option(
        ALIGN_THRESHOLD,
        "--align-threshold",
        help="Payload size from which --align applies; smaller payloads are 64-byte aligned.",
    ),
    inline_threshold: int = typer.Option(
        INLINE_THRESHOLD, "--inline-threshold", help="Payloads smaller than this stay inside the model file."
    ),
    shared_blob: str | None = typer.Option(
        None,
        "--shared-blob",
        help="Zoo mode: every model in OUTDIR "
        "references this one blob (`NAME.<digest12>.safetensors`); identical "
        "payloads are stored once. Models are swapped in one by one, each "
        "with its blob. TFLite models join with --external.",
    ),
    ort_child_timeout: float | None = typer.Option(
        None,
        "--ort-child-timeout",
        help="Seconds the onnxruntime child of --prepack / --unpack ort-cpu may run (CPU time follows); "
        "default: 300 plus 600 per GiB of model.",
    ),
    ort_child_memory: int | None = typer.Option(
        None, "--ort-child-memory", help="Address space (MiB) of that child; default: 4096 plus 8x the model."
    ),
    ort_max_growth: float | None = typer.Option(
        None,
        "--ort-max-growth",
        help="What that child may write (optimized and packed copies) as a multiple of the model's size; "
        "default 4 (at least 16 MiB).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the conversion report as one JSON document."),
    quiet_: bool = typer.Option(False, "-q", "--quiet", help="No progress bar, no report: errors only."),
) -> None:
    """Rewrite MODEL(s) into OUTDIR with every weight in a page-aligned, memory-mappable blob.

    Unpacks fp16 weights that the runtime would otherwise convert per session
    (ONNX Cast to float, TFLite DEQUANTIZE) and stores identical payloads once.
    Outputs appear all together or not at all.
    """
    reports = []
    quiet_ = quiet(quiet_)

    def options(update: Progress | None = None, total: Callable[[int], None] | None = None) -> ConvertOptions:
        return ConvertOptions(
            align=AlignPolicy(large=align, threshold=align_threshold),
            inline_threshold=inline_threshold,
            keep_packed=keep_packed,
            unpack=frozenset(u.value for u in unpack),
            blob_name=blob,
            external=external,
            prepack=prepack,
            progress=update,
            progress_total=total,
            blob_grace_s=blob_grace,
            ort_child_timeout_s=ort_child_timeout,
            ort_child_memory_mib=ort_child_memory,
            ort_max_growth=ort_max_growth,
        )

    with user_errors():
        if Unpack.ORT_CPU in unpack and keep_packed:
            fail("--unpack ort-cpu and --keep-packed exclude each other")
        if shared_blob is not None:
            if blob is not None:
                fail("--blob and --shared-blob exclude each other")
            with progress_bar(not quiet_, "zoo") as (update, total):
                zoo = api.convert_zoo(models, output, shared_blob, options(update, total))
            if as_json:
                print(json.dumps(zoo.to_dict(), indent=2))
            elif not quiet(False):
                render_zoo(zoo)
            return
        if any(is_model_folder(m) for m in models):
            _convert_folder(models, output, options, as_json, quiet_)
            return
        models = api._expand_inputs(models)
        if not models:
            fail("no models to convert (a glob that matched nothing)")
        if blob is not None and len(models) > 1:
            fail("--blob names one model's blob; with several models use --shared-blob or leave it out")
        with progress_bar(not quiet_, models[0].name if len(models) == 1 else f"{len(models)} models") as (
            update,
            total,
        ):
            reports = api.convert_many(models, output, options(update, total))
    if as_json:  # one document: the report, or for a batch every report and the totals
        if len(reports) == 1:
            print(json.dumps(reports[0].to_dict(), indent=2))
        else:
            print(json.dumps({"models": [r.to_dict() for r in reports], "total": _totals(reports)}, indent=2))
    elif quiet(False):
        return
    elif len(reports) == 1 or VERBOSITY["level"] > 0:
        for r in reports:
            render_report(r)
    if not as_json and len(reports) > 1:
        for r in reports:
            info(
                f"{r.model}: {r.tensors_moved} payloads moved, {_mib(r.bytes_written)} stored, "
                f"{r.unpacked} unpacked, {r.wall_time_s:.2f} s, peak RSS {r.peak_rss_mib:.0f} MiB -> {r.outputs[0]}"
            )
        t = _totals(reports)
        info(
            f"total: {t['models']} models, {t['tensors_moved']} payloads moved, {_mib(t['bytes_written'])} stored, "
            f"{t['wall_time_s']:.2f} s, peak RSS {t['peak_rss_mib']:.0f} MiB"
        )


def _convert_folder(
    inputs: list[Path], output: Path, options: Callable[..., ConvertOptions], as_json: bool, quiet_: bool
) -> None:
    if len(inputs) > 1:
        fail("a model folder is converted on its own (its tree is reproduced in OUTDIR): give it alone")
    with progress_bar(not quiet_, inputs[0].name) as (update, total):
        result = api.convert_folder(inputs[0], output, options(update, total))
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    for r in result.models if VERBOSITY["level"] > 0 else []:
        render_report(r)
    for r in result.models:
        info(f"{r.model}: {r.tensors_moved} payloads moved, {_mib(r.bytes_written)} stored -> {r.outputs[0]}")
    info(
        f"total: {len(result.models)} models converted, {len(result.copied)} other files copied "
        f"({_mib(result.copied_bytes)}), {result.wall_time_s:.2f} s, peak RSS {result.peak_rss_mib:.0f} MiB -> {output}"
    )


def _totals(reports: list[ConversionReport]) -> JsonDict:
    return {
        "models": len(reports),
        "tensors_moved": sum(r.tensors_moved for r in reports),
        "bytes_in": sum(r.bytes_in for r in reports),
        "bytes_written": sum(r.bytes_written for r in reports),
        "blob_bytes": sum(r.blob_bytes for r in reports),
        "wall_time_s": round(sum(r.wall_time_s for r in reports), 3),
        "peak_rss_mib": max((r.peak_rss_mib for r in reports), default=0.0),
    }


@app.command()
def merge(
    sources: list[Path] = typer.Argument(
        ..., help="Core ML .mlpackage files (multifunction sources contribute all their functions)."
    ),
    function_name: list[str] = typer.Option(
        [], "--function-name", "--name", help="Function name for each source, in order [default: the source's stem]."
    ),
    default_function: str | None = typer.Option(
        None, "--default-function", help="Function run by default [default: the first]."
    ),
    output: Path = typer.Option(..., "-o", "--output", help="Output .mlpackage."),
    align: int = typer.Option(LARGE_ALIGN, "--align", help="Alignment of payloads >= --align-threshold (bytes)."),
    align_threshold: int = typer.Option(
        ALIGN_THRESHOLD,
        "--align-threshold",
        help="Payload size from which --align applies; smaller payloads are 64-byte aligned.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
    quiet_: bool = typer.Option(False, "-q", "--quiet", help="No progress bar, no report: errors only."),
) -> None:
    """Merge Core ML models into one multifunction .mlpackage, storing each distinct weight once.

    Streams weight data chunk by chunk: memory does not grow with the number of functions.
    """
    quiet_ = quiet(quiet_)
    with user_errors(), progress_bar(not quiet_, output.name) as (update, total):
        opts = ConvertOptions(
            align=AlignPolicy(large=align, threshold=align_threshold), progress=update, progress_total=total
        )
        report = api.merge(sources, output, function_name, default_function, opts)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    elif not quiet_:
        render_report(report)


@app.command()
def inspect(
    model: Path = typer.Argument(..., help="An ONNX, TFLite or Core ML model."),
    as_json: bool = typer.Option(False, "--json", help="Print the inventory and findings as one JSON document."),
    no_hash: bool = typer.Option(False, "--no-hash", help="Skip hashing payloads (no duplicate or checksum info)."),
    limit: int = typer.Option(40, "--limit", help="Payload rows to show (largest first); 0 for all."),
    no_measure: bool = typer.Option(
        False, "--no-measure", help="Static per-session estimate only (do not ask onnxruntime in child processes)."
    ),
) -> None:
    """Show every weight payload: where it lives, encoding, alignment, duplicates, per-session copies.

    Per-session copies are shown per runtime setting side by side (ONNX Runtime with
    session.disable_prepacking=1 and with default options; LiteRT without delegate, with
    XNNPACK, and CompiledModel with a weight cache), followed by check's findings.
    """
    from .check import findings_for
    from .contract import inspect_document
    from .inventory import inventory

    with user_errors():
        inv = inventory(model, hash_payloads=not no_hash, measure=not no_measure)
        findings = findings_for(inv)
    if as_json:
        print(json.dumps(inspect_document(inv, findings), indent=2))
        return
    rows = sorted(inv.payloads, key=lambda p: -p.nbytes)
    t = Table(title=f"{inv.model} ({inv.format}, {_mib(inv.file_bytes)})", title_justify="left")
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
            _mib(p.nbytes),
            where,
            p.encoding,
            str(p.alignment or ""),
            *[_mib(c) if c else "0" for c in copies],
            note,
        )
    out.print(t)
    if limit and len(rows) > limit:
        out.print(f"... {len(rows) - limit} smaller payloads not shown (--limit 0 shows all)")
    moves = sum(1 for p in inv.payloads if p.would_move)
    per_setting = "; ".join(f"{s}: {_mib(inv.copied_under(s))}" for s in settings) or _mib(inv.copied_per_session)
    out.print(
        f"{len(inv.payloads)} payloads: {_mib(inv.embedded_bytes)} embedded, {_mib(inv.external_bytes)} "
        f"external, {_mib(inv.duplicate_bytes)} duplicated. Copied per session: {per_setting}. "
        f"`convert` would move {moves} payloads and unpack "
        f"{sum(1 for p in inv.payloads if p.unpacked_at_load)}."
    )
    if inv.measured:
        measured = "; ".join(f"{s}: {_mib(n)}" for s, n in inv.measured.items())
        runtime = "LiteRT" if inv.format == "tflite" else "onnxruntime"
        out.print(f"Measured, one more session costs: {measured} ({runtime}, PSS from 1 to 4 sessions).")
    for note in inv.notes + inv.measure_notes:
        out.print(f"note: {note}")
    for f in findings:
        out.print(f"{f.severity.value}: {f.code.value}: {f.message} (fix: {f.fix})")


@app.command()
def check(
    models: list[Path] = typer.Argument(..., help="Models, directories (searched recursively) or globs."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdict and findings as one JSON document."),
    inline_threshold: int = typer.Option(
        INLINE_THRESHOLD, "--inline-threshold", help="Embedded payloads below this size are fine."
    ),
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Fail on warnings too (copies that only a setting not targeted makes, 16-byte aligned inline "
        "TFLite buffers).",
    ),
    target: list[str] = typer.Option(
        [],
        "--target",
        help="Runtime setting the models will be loaded with: ort-default, ort-disable-prepacking, "
        "litert-builtin, litert-xnnpack, litert-compiled-cache, coreml. Repeatable; a format none is named "
        "for is held to its sharing setting (ort-disable-prepacking, litert-builtin).",
    ),
    threshold: int = typer.Option(
        1 << 20, "--threshold", help="Bytes per session a copy may cost before it is an error (default 1 MiB)."
    ),
    output_format: str = typer.Option(
        "text", "--format", help="text, json (same as --json) or github (workflow annotations)."
    ),
    no_measure: bool = typer.Option(
        False,
        "--no-measure",
        help="Use the static per-session estimate only (default for ONNX: ask onnxruntime, in child processes, "
        "what one more session costs under each setting).",
    ),
    quiet_: bool = typer.Option(False, "-q", "--quiet", help="Only the finding lines (no 'ok' line)."),
) -> None:
    """CI gate: exit 0 when every model is share-ready, 1 with one line per finding otherwise.

    Errors (a copy above --threshold per session under a targeted setting, or a broken
    model) fail the gate; warnings (a copy only another setting makes, named in the fix)
    fail it only with --strict; info never. A file that cannot be read is one
    unreadable-model finding, the rest are still checked, and the exit code is 2.
    docs/ci.md lists every finding code and the JSON schema.
    """
    from .check import Gate, find_models
    from .check import check as run_check
    from .contract import SETTINGS, check_document, exit_code, github_annotations

    quiet(quiet_)
    if output_format not in ("text", "json", "github"):
        fail(f"--format takes text, json or github, got {output_format!r}")
    for t in target:
        if t not in SETTINGS:
            fail(f"--target {t!r} is not a setting id ({', '.join(SETTINGS)})")
    if threshold < 0:
        fail("--threshold must not be negative")
    gate = Gate(tuple(target), threshold, inline_threshold, measure=not no_measure)
    with user_errors():
        paths = find_models(models)
        if not paths:
            fail("no models found")
        inventories, findings = run_check(paths, gate, keep_going=True)
    code = exit_code(findings, strict)
    if as_json or output_format == "json":
        print(json.dumps(check_document(inventories, findings, gate, strict), indent=2))
    elif output_format == "github":
        for line in github_annotations(findings):
            print(line)
    else:
        for f in findings:  # an unreadable file is bad input: its line goes where every command's errors go
            print(f.line(), file=sys.stderr if f.code == "unreadable-model" else sys.stdout)
        for inv in inventories:
            for note in inv.measure_notes:  # how the figures were made: on stderr, silenced by -q
                if VERBOSITY["level"] >= 0:
                    err.print(f"note: {inv.model}: {note}", markup=False, highlight=False, soft_wrap=True)
        if code == 0:
            shown = f" ({len(findings)} warnings/info)" if findings else ""
            info(f"ok: {len(inventories)} model(s) share-ready{shown}")
    raise typer.Exit(code)


def _silence_litert() -> None:
    from .runtimes.litert import silence_native_stderr_until_exit

    sys.stdout.flush()
    silence_native_stderr_until_exit()


def _pairs(items: list[str], option: str, what: str) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        name, sep, value = item.rpartition("=")
        if not sep or not name or not value:
            fail(f"{option} takes NAME={what}, got {item!r}")
        pairs.append((name, value))
    return pairs


def _verify_args(
    dim: list[str], shape: list[str], inputs: list[str]
) -> tuple[dict[str, int], dict[str, list[int]], dict[str, Any]]:
    from .verify import load_input

    dims: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    for name, value in _pairs(dim, "--dim", "VALUE"):
        if not value.isdigit():  # 0 is a valid length: past_sequence_length=0 is a prefill step
            fail(f"--dim takes NAME=VALUE with a non-negative integer, got {name}={value!r}")
        dims[name] = int(value)
    for name, value in _pairs(shape, "--shape", "D0,D1,..."):
        parts = [p.strip() for p in value.split(",")]
        if not all(p.isdigit() for p in parts):
            fail(f"--shape takes NAME=D0,D1,... with non-negative integers, got {name}={value!r}")
        shapes[name] = [int(p) for p in parts]
    given = {name: load_input(name, value) for name, value in _pairs(inputs, "--input", "FILE.npy")}
    return dims, shapes, given


@app.command()
def verify(
    original: Path = typer.Argument(..., help="The model before conversion."),
    converted: Path = typer.Argument(..., help="The converted model."),
    runs: int = typer.Option(3, "--runs", help="Runs with different seeded random inputs."),
    dim: list[str] = typer.Option(
        [],
        "--dim",
        help="Value of a symbolic input dimension, NAME=VALUE; '*=VALUE' "
        "sets every other dynamic dimension (TFLite dims have no names). Repeatable.",
    ),
    shape: list[str] = typer.Option(
        [], "--shape", help="TFLite: full shape of an input with dynamic dims, NAME=1,16000. Repeatable."
    ),
    inputs: list[str] = typer.Option(
        [],
        "--input",
        help="Use real values for an input in every run: NAME=FILE.npy (or an ONNX TensorProto .pb). Repeatable.",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the random inputs of the first run."),
    as_json: bool = typer.Option(False, "--json", help="Print the verify report as one JSON document."),
    quiet_: bool = typer.Option(False, "-q", "--quiet", help="Only the FAIL lines."),
) -> None:
    """Run both models in the real runtime on the same inputs: pass only if outputs are byte-identical.

    Compares output names, count and order, then each output's dtype, shape and raw
    bytes (sequences, maps and optionals element by element). ONNX Runtime CPU at
    default options; LiteRT without delegate and with XNNPACK (every signature), or
    CompiledModel for ExternalBuffer models. Every blob payload is re-hashed against its
    recorded checksum and the blob's name against its header; ONNX: every payload is compared byte
    for byte with the original's, and a --prepack output's portable model is run too. Core ML (no
    runtime on Linux): weights must decode to the same bytes and the programs must match op for op.
    Exit 1 on a difference, 2 when the original itself does not run.
    """
    from .verify import verify as run_verify

    quiet(quiet_)
    reported = False  # an unexpected exception is reported by main(): stderr must stay open for it
    try:
        with user_errors():
            dims, shapes, given = _verify_args(dim, shape, inputs)
            report = run_verify(original, converted, runs, dims, seed, given, shapes)
        reported = True
    except typer.Exit:
        reported = True
        raise
    finally:  # after the one error line, if any: LiteRT logs its teardown at exit
        if original.suffix == ".tflite" and reported:
            _silence_litert()
    if as_json:
        from .contract import verify_document

        print(json.dumps(verify_document(report), indent=2))
    else:
        for line in report.checksum_mismatches + report.mismatches:
            print(f"FAIL: {line}")
        for note in report.notes:
            info(f"note: {note}")
        verdict = "ok" if report.passed else "FAILED"
        ran = f" ({'; '.join(report.paths)})" if report.paths else ""
        info(
            f"{verdict}: {report.runs} runs{ran}, {report.outputs_compared} outputs compared, "
            f"{report.payloads_hashed} blob payloads re-hashed, {report.payloads_compared} compared with the original"
        )
    raise typer.Exit(0 if report.passed else 1)


@app.command()
def bench(
    model: Path = typer.Argument(..., help="An ONNX or TFLite model (it is converted into a temporary directory)."),
    sessions: str = typer.Option("1,2,4,8", "--sessions", help="Session counts to measure, comma separated."),
    plot_path: Path | None = typer.Option(
        None, "--plot", help='Write a PNG chart of PSS vs sessions (needs matplotlib: pip install "weightshare[plot]").'
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the measurements as one JSON document."),
    inputs: list[str] = typer.Option(
        [], "--input", help="TFLite: real values for an input, NAME=FILE.npy, instead of random ones. Repeatable."
    ),
) -> None:
    """Memory (PSS) of 1..N sessions of the original and the converted model, side by side.

    Each model and runtime setting runs in a fresh process; ONNX Runtime with and without
    session.disable_prepacking, plus the `convert --prepack` result at default options;
    LiteRT without delegate and with the default XNNPACK one.
    """
    from .bench import bench as run_bench
    from .bench import plot

    with user_errors():
        try:
            counts = sorted({int(x) for x in sessions.split(",") if x.strip()})
        except ValueError:
            fail(f"--sessions takes comma-separated integers, got {sessions!r}")
        if plot_path is not None:
            plot_path = plot_path.resolve()
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                fail('--plot needs matplotlib: pip install "weightshare[plot]"')
        status = err.status("measuring") if sys.stderr.isatty() and not as_json else None
        if status:
            status.start()
        try:
            result = run_bench(
                model,
                counts,
                progress=(lambda m: status.update(m)) if status else (lambda m: None),
                inputs=dict(_pairs(inputs, "--input", "FILE.npy")),
            )
        finally:
            if status:
                status.stop()
        if plot_path is not None:
            plot(result, plot_path)
            result["plot"] = str(plot_path)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    counts = result["sessions"]
    t = Table(title=f"{result['model']}: PSS (MiB) after N sessions in one process", title_justify="left")
    for col in ["variant", "setting", *[f"{n}" for n in counts], f"{counts[-1]}/1", "private", "shared"]:
        t.add_column(col, justify="left" if col in ("variant", "setting") else "right")
    groups: dict[tuple[str, str], list[JsonDict]] = {}
    for r in result["rows"]:
        groups.setdefault((r["variant"], r["mode"]), []).append(r)
    for (variant, mode), rows in groups.items():
        pss = [r["pss_mib"] for r in rows]
        t.add_row(
            variant,
            mode,
            *[f"{v:,.0f}" for v in pss],
            f"{pss[-1] / pss[0]:.2f}x",
            f"{rows[-1]['private_mib']:,.0f}",
            f"{rows[-1]['shared_mib']:,.0f}",
        )
    out.print(t)
    if plot_path is not None:
        out.print(f"plot: {plot_path}")


@app.command()
def demo(
    workdir: Path = typer.Option(
        Path("weightshare-demo"),
        "--dir",
        help="Where to put the sample models (56 MiB per layer: ~675 MiB with the default 12 layers).",
    ),
    sessions: int = typer.Option(4, "--sessions", help="ONNX Runtime sessions to open per variant."),
    layers: int = typer.Option(12, "--layers", help="MLP layers of 2048x2048 fp16 weights (8 MiB each)."),
    clean: bool = typer.Option(False, "--clean", help="Remove the demo directory (--dir) and exit."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as one JSON document."),
) -> None:
    """Build a sample fp16 ONNX model, convert it, and show the memory of N sessions before and after."""
    from .demo import clean_demo, run_demo

    with user_errors():
        if clean:
            removed = clean_demo(workdir)
            info(f"removed {workdir.resolve()}" if removed else f"nothing to remove at {workdir.resolve()}")
            return
        # the fp16 original, the fp32 blob, and the --prepack blob (fp32 payloads plus ORT's packed copies)
        size = layers * (2048 * 2048 + 2048) * (2 + 4 + 8)
        if not as_json:
            info(
                f"writing about {_mib(size)} to {workdir.resolve()} (remove it with: weightshare demo --clean"
                f"{'' if workdir == Path('weightshare-demo') else f' --dir {workdir}'})"
            )
        result = run_demo(workdir, sessions, layers, progress=lambda msg: detail(msg))
    if as_json:
        print(json.dumps(result, indent=2))
        return
    t = Table(title=f"{sessions} ONNX Runtime sessions in one process")
    for col in ("model", "file size", "PSS 1 session", f"PSS {sessions} sessions", "per extra session"):
        t.add_column(col, justify="right" if col != "model" else "left")
    for row in result["rows"]:
        t.add_row(
            row["variant"],
            _mib(row["file_bytes"]),
            f"{row['pss_1_mib']:,.1f} MiB",
            f"{row['pss_n_mib']:,.1f} MiB",
            f"{row['per_session_mib']:,.1f} MiB",
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


for _info in app.registered_commands:  # every command renders its help like the group (see _Command)
    if _info.cls in (None, TyperCommand):
        _info.cls = _Command


def main() -> None:
    # A file size limit (RLIMIT_FSIZE, quota-like) must surface as an EFBIG write error that we clean up
    # after, not as a SIGXFSZ that kills the process and leaves temporaries behind.
    if hasattr(signal, "SIGXFSZ"):  # not on Windows
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _terminate)
    # Skip the interpreter's last full garbage collection at exit, which walks every object the imports made
    # (onnx, numpy, protobuf): about 0.1 CPU s of each command. Nothing weightshare does relies on it: files
    # and temporaries are closed and cleaned by the command itself.
    atexit.register(gc.freeze)
    # The command does no linear algebra: numpy's OpenBLAS need not start (and spin up) a thread per core when
    # numpy is imported (fp16 unpacking), about 0.03-0.05 CPU s. The command's own children inherit it; none of
    # them multiplies matrices with numpy either (ONNX Runtime and LiteRT have their own thread pools).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if os.environ.get("WEIGHTSHARE_DEBUG"):
        app()
        return
    try:
        app()
    except SystemExit:
        raise
    except KeyboardInterrupt as e:  # outside a command's own handling (argument parsing, imports)
        what = "terminated" if isinstance(e, Terminated) else "interrupted"
        err.print(f"weightshare: error: {what}; no output was left behind", markup=False, highlight=False)
        sys.exit(128 + signal.SIGTERM if isinstance(e, Terminated) else 130)
    except Exception as e:  # a bug in weightshare: still one line, and how to get the traceback
        err.print(
            f"weightshare: internal error: {type(e).__name__}: {e} (set WEIGHTSHARE_DEBUG=1 for a traceback)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(2)
