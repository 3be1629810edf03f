"""The Python API; the CLI is a thin layer over these functions.

Example:
    import weightshare
    report = weightshare.convert("model.onnx", "out/")
    print(report.bytes_written, report.ops_removed)
"""

from __future__ import annotations

import json
import os
import resource
import stat
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

from .atomic import TMP_PREFIX, CommitHook, OutputTransaction, clean_stale_temporaries
from .errors import OutputError, UsageError
from .formats import Format, detect, model_suffixes
from .options import ConvertOptions
from .paths import check_no_overlap
from .pipeline import PreparedModel, blob_target, write_models
from .report import ConversionReport, ZooReport

ZOO_MARKER = ".weightshare-zoo.json"


def reset_peak_rss() -> None:
    """Start a new high-water mark, so that a report's peak is this conversion's (Linux >= 4.0; else a no-op)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    """This process's own peak RSS: VmHWM. Not getrusage's ru_maxrss, which a child inherits from the parent
    that forked it (a converter started by a 1.7 GB parent reported 1708 MiB while /proc showed 73 MiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def prepare_out_dir(out_dir: str | os.PathLike[str], tx: OutputTransaction | None = None) -> Path:
    """Create OUTDIR (removed again if the run fails and it stays empty) and remove stale temporaries in it."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError("output must be a directory", out)
    if tx is not None:
        tx.make_dirs(out)
    else:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create output directory: {e.strerror}", out) from None
    clean_stale_temporaries(out)
    return out


def check_input(src: Path) -> None:
    """Refuse what cannot be a model before opening it: a FIFO or device would block or never end."""
    try:
        st = os.stat(src)
    except OSError:
        return  # missing or unreadable: detect_format says so with the file's name
    if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
        return
    raise UsageError("is not a regular file (a FIFO, socket or device); refusing to read it", src)


_Timed = TypeVar("_Timed", ConversionReport, ZooReport)


def _finish(report: _Timed, start: float) -> _Timed:
    report.wall_time_s = round(time.perf_counter() - start, 3)
    report.peak_rss_mib = round(peak_rss_mib(), 1)
    if isinstance(report, ConversionReport):
        _add_child_peak(report)
    return report


def _add_child_peak(report: ConversionReport) -> None:
    """--prepack's ORT child runs while the converter waits for it: both count, each also named on its own."""
    child = report.prepack.get("ort_child_peak_rss_mib")
    if isinstance(child, (int, float)):
        report.prepack["converter_peak_rss_mib"] = report.peak_rss_mib
        report.peak_rss_mib = round(report.peak_rss_mib + child, 1)


def convert(
    model: str | os.PathLike[str], out_dir: str | os.PathLike[str], options: ConvertOptions | None = None
) -> ConversionReport:
    """Convert one model into ``out_dir``; outputs appear all together or not at all."""
    return convert_many([model], out_dir, options)[0]


def convert_many(
    models: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str], options: ConvertOptions | None = None
) -> list[ConversionReport]:
    """Convert several models into ``out_dir`` in one transaction: every output is committed, or none.

    Refused before anything is written: two inputs whose outputs would have the same path,
    an output onto an input, and an output inside an input (.mlpackage).
    """
    options = options or ConvertOptions()
    sources = [Path(m) for m in models]
    if not sources:
        raise UsageError("no models to convert")
    if options.blob_name is not None and len(sources) > 1:
        raise UsageError("--blob names one model's blob; with several models use --shared-blob or leave it out")
    out = Path(out_dir)
    _check_outputs(sources, [out / s.name for s in sources])
    for s in sources:
        check_input(s)
    formats = [detect(s) for s in sources]
    start = time.perf_counter()
    reset_peak_rss()
    reports = []
    with OutputTransaction() as tx:
        prepare_out_dir(out, tx)
        for src, fmt in zip(sources, formats):
            t0 = time.perf_counter()
            reports.append(_finish(_convert_one(fmt, src, out, options, tx), t0))
    if len(reports) == 1:  # the commit is part of the one model's time
        _finish(reports[0], start)
    return reports


def _convert_one(fmt: Format, src: Path, out: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
    """One model's conversion; a write error (EFBIG, ENOSPC) names the output it was writing."""
    try:
        return fmt.convert(src, out, options, tx)
    except OutputError as e:
        if e.path is None or Path(e.path).name.startswith(TMP_PREFIX):
            raise OutputError(e.message, out / src.name) from None
        raise
    except OSError as e:
        if e.filename is None or Path(str(e.filename)).name.startswith(TMP_PREFIX):
            raise OutputError(f"cannot write the output: {e.strerror or e}", out / src.name) from None
        raise


def _check_outputs(sources: list[Path], outputs: list[Path]) -> None:
    seen: dict[Path, Path] = {}
    for src, o in zip(sources, outputs):
        key = o.resolve()
        if key in seen:
            raise UsageError(
                f"{seen[key]} and {src} would both be written to {o}; convert them into different output directories",
                src,
            )
        seen[key] = src
    check_no_overlap(sources, outputs)


def expand_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files as given; directories by their models (sorted); unexpanded globs expanded."""
    import glob

    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir() and path.suffix not in model_suffixes():
            found += sorted(
                p for p in path.iterdir() if p.suffix in model_suffixes() and not p.name.startswith(TMP_PREFIX)
            )
        elif not path.exists() and glob.has_magic(str(item)):
            found += sorted(Path(p) for p in glob.glob(str(item)))
        else:
            found.append(path)
    return found


class _DropRemovedModels(CommitHook):
    """After a zoo commit: remove the models the previous zoo listed and this one does not."""

    def __init__(self, out: Path, keep: list[str]) -> None:
        self.out, self.keep = out, set(keep)
        self.old: list[str] = []

    def before(self) -> None:
        try:
            self.old = list(json.loads((self.out / ZOO_MARKER).read_text()).get("models", []))
        except (OSError, ValueError, AttributeError):
            self.old = []

    def after(self) -> None:
        for name in self.old:
            if isinstance(name, str) and name not in self.keep and "/" not in name and name not in ("", ".", ".."):
                try:
                    (self.out / name).unlink()
                except OSError:
                    pass


def convert_zoo(
    models: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    shared_blob: str,
    options: ConvertOptions | None = None,
) -> ZooReport:
    """Convert many models into ``out_dir`` so that all of them reference one blob, ``shared_blob``.

    Each distinct payload (same bytes after unpacking) is stored once, in
    ``<shared_blob>.<digest12>.safetensors`` (``.safetensors`` stripped from the name first). The new blob
    and every model are committed in one transaction, each model by one rename: a reader opening
    a model sees the old one with the old blob or the new one with the new blob. Models of the
    previous zoo that are not in this one are removed; the old blob stays for the grace period.
    """
    options = options or ConvertOptions()
    sources = expand_inputs(models)
    if not sources:
        raise UsageError("no models to convert")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError("output must be a directory", out)
    if out.exists() and any(out.iterdir()) and not (out / ZOO_MARKER).exists():
        raise UsageError(
            "output directory is not empty and was not written by --shared-blob; choose an empty or new directory", out
        )
    for s in sources:
        if s.resolve().parent == out.resolve():
            raise UsageError("an input lies in the output directory, which is rewritten as a whole", s)
    _check_outputs(sources, [out / s.name for s in sources])
    for s in sources:
        check_input(s)
    target = blob_target(None, out, shared_blob)
    start = time.perf_counter()
    reset_peak_rss()
    with OutputTransaction() as tx, ExitStack() as stages:
        prepare_out_dir(out, tx)
        prepared = [_prepare_zoo_model(src, out, options, stages) for src in sources]
        for p, src in zip(prepared, sources):
            p.name_prefix = f"{src.stem}/" if len(prepared) > 1 else ""
        if options.prepack:
            from .formats.onnx.prepack import share_metadata

            share_metadata(prepared)
        write_models(prepared, out, target, options, tx)
        blob = next((o for p in prepared for o in p.report.outputs if o.endswith(".safetensors")), "")
        report = ZooReport(blob=blob, models=[p.report for p in prepared], blob_bytes=prepared[0].report.blob_bytes)
        names = [s.name for s in sources]
        written = [Path(o).name for p in prepared for o in p.report.outputs if not o.endswith(".safetensors")]
        marker = tx.new_file(out / ZOO_MARKER)
        marker.write_text(json.dumps({"blob": Path(blob).name, "models": names}, indent=1) + "\n")
        tx.add_hook(_DropRemovedModels(out, list(dict.fromkeys(names + written))))
    _finish(report, start)
    children = [m.prepack.get("ort_child_peak_rss_mib", 0.0) for m in report.models]
    report.peak_rss_mib = round(report.peak_rss_mib + max(children, default=0.0), 1)  # one ORT child at a time
    for m in report.models:
        m.wall_time_s, m.peak_rss_mib = report.wall_time_s, report.peak_rss_mib
    return report


def _prepare_zoo_model(src: Path, out: Path, options: ConvertOptions, stages: ExitStack) -> PreparedModel:
    """One zoo model's payloads; with --prepack read from a staging directory that ``stages`` removes."""
    if options.prepack and detect(src).name == "onnx":
        from .formats.onnx.prepack import prepare_prepacked, staging

        return prepare_prepacked(src, out, options, stages.enter_context(staging(out)))
    return prepare_for_blob(src, out, options)


def prepare_for_blob(src: Path, out_dir: Path, options: ConvertOptions) -> PreparedModel:
    """A format's prepare step for a shared blob (ONNX; TFLite with --external)."""
    return detect(src).prepare(src, out_dir, options)


def merge(
    sources: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    function_names: list[str] | None = None,
    default_function: str | None = None,
    options: ConvertOptions | None = None,
) -> ConversionReport:
    """Merge Core ML packages into one multifunction .mlpackage, streaming the weights."""
    from .formats.coreml import merge as coreml_merge

    options = options or ConvertOptions()
    out = Path(out)
    paths = [Path(s) for s in sources]
    check_no_overlap(paths, [out])
    for s in paths:
        check_input(s)
    start = time.perf_counter()
    reset_peak_rss()
    with OutputTransaction() as tx:
        prepare_out_dir(out.parent if str(out.parent) else Path("."), tx)
        report = coreml_merge.merge_packages(paths, list(function_names or []), default_function, out, options, tx)
    return _finish(report, start)
