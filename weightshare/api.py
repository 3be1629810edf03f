"""The Python API; the CLI is a thin layer over these functions.

Example:
    import weightshare
    report = weightshare.convert("model.onnx", "out/")
    print(report.bytes_written, report.ops_removed)
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

from .atomic import OutputTransaction, clean_stale_temporaries
from .errors import OutputError, UsageError
from .formats import detect, model_suffixes
from .options import ConvertOptions
from .paths import resolve_inside
from .pipeline import write_models
from .report import ConversionReport, ZooReport


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


def prepare_out_dir(out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError("output must be a directory", out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create output directory: {e.strerror}", out) from None
    clean_stale_temporaries(out)
    return out


def convert(model: str | os.PathLike, out_dir: str | os.PathLike, options: ConvertOptions | None = None
            ) -> ConversionReport:
    """Convert one model into ``out_dir``; outputs appear all together or not at all."""
    options = options or ConvertOptions()
    src = Path(model)
    fmt = detect(src)
    out = prepare_out_dir(out_dir)
    if (out / src.name).resolve() == src.resolve():
        raise UsageError("output would overwrite the input; choose another output directory", src)
    start = time.perf_counter()
    reset_peak_rss()
    with OutputTransaction() as tx:
        report = fmt.convert(src, out, options, tx)
    report.wall_time_s = round(time.perf_counter() - start, 3)
    report.peak_rss_mib = round(peak_rss_mib(), 1)
    return report


ZOO_MARKER = ".weightshare-zoo.json"


def expand_inputs(inputs: list[str | os.PathLike]) -> list[Path]:
    """Files as given; directories by their models (sorted); unexpanded globs expanded."""
    import glob

    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir() and path.suffix not in model_suffixes():
            found += sorted(p for p in path.iterdir() if p.suffix in model_suffixes())
        elif not path.exists() and glob.has_magic(str(item)):
            found += sorted(Path(p) for p in glob.glob(str(item)))
        else:
            found.append(path)
    return found


def convert_zoo(models: list[str | os.PathLike], out_dir: str | os.PathLike, shared_blob: str,
                options: ConvertOptions | None = None) -> ZooReport:
    """Convert many models into ``out_dir`` so that all of them reference one blob, ``out_dir/shared_blob``.

    Each distinct payload (same bytes after unpacking) is stored once. The whole
    OUTDIR is built beside the old one and swapped in atomically, so re-running over a
    changed zoo rewrites the blob and every model, and readers see either the old
    complete OUTDIR or the new one.
    """
    import json

    options = options or ConvertOptions()
    sources = expand_inputs(models)
    if not sources:
        raise UsageError("no models to convert")
    names = [s.name for s in sources]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise UsageError(f"two inputs share the file name {dupes[0]!r}; their outputs would collide")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / ZOO_MARKER).exists():
        raise UsageError("output directory is not empty and was not written by --shared-blob; "
                         "choose an empty or new directory", out)
    for s in sources:
        if s.resolve().parent == out.resolve():
            raise UsageError("an input lies in the output directory, which is replaced as a whole", s)
    prepare_out_dir(out.parent if str(out.parent) else Path("."))
    start = time.perf_counter()
    reset_peak_rss()
    with OutputTransaction() as tx:
        stage = tx.new_dir(out)
        blob_path = resolve_inside(stage, shared_blob, "shared blob")
        prepared = [prepare_for_blob(src, stage, options) for src in sources]
        stems = [src.stem for src in sources]
        for p, stem in zip(prepared, stems):
            p.name_prefix = f"{stem}/" if len(prepared) > 1 else ""
        write_models(prepared, stage, shared_blob, blob_path, options, tx)
        report = ZooReport(blob=str(out / shared_blob), models=[p.report for p in prepared],
                           blob_bytes=prepared[0].report.blob_bytes)
        for m in report.models:
            m.outputs = [str(out / Path(o).resolve().relative_to(stage.resolve())) for o in m.outputs]
        (stage / ZOO_MARKER).write_text(json.dumps({"blob": shared_blob, "models": names}, indent=1) + "\n")
    report.wall_time_s = round(time.perf_counter() - start, 3)
    report.peak_rss_mib = round(peak_rss_mib(), 1)
    for m in report.models:
        m.wall_time_s, m.peak_rss_mib = report.wall_time_s, report.peak_rss_mib
    return report


def prepare_for_blob(src: Path, out_dir: Path, options: ConvertOptions):
    """A format's prepare step for a shared blob (ONNX; TFLite with --external)."""
    return detect(src).prepare(src, out_dir, options)


def merge(sources: list[str | os.PathLike], out: str | os.PathLike, function_names: list[str] | None = None,
          default_function: str | None = None, options: ConvertOptions | None = None) -> ConversionReport:
    """Merge Core ML packages into one multifunction .mlpackage, streaming the weights."""
    from .formats.coreml import merge as coreml_merge

    options = options or ConvertOptions()
    out = Path(out)
    prepare_out_dir(out.parent if str(out.parent) else Path("."))
    start = time.perf_counter()
    reset_peak_rss()
    with OutputTransaction() as tx:
        report = coreml_merge.merge_packages([Path(s) for s in sources], list(function_names or []),
                                             default_function, out, options, tx)
    report.wall_time_s = round(time.perf_counter() - start, 3)
    report.peak_rss_mib = round(peak_rss_mib(), 1)
    return report
