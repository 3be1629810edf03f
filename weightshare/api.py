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
from .formats import converter, detect_format
from .options import ConvertOptions
from .report import ConversionReport


def peak_rss_mib() -> float:
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
    fmt = detect_format(src)
    out = prepare_out_dir(out_dir)
    if (out / src.name).resolve() == src.resolve():
        raise UsageError("output would overwrite the input; choose another output directory", src)
    start = time.perf_counter()
    with OutputTransaction() as tx:
        report = converter(fmt)(src, out, options, tx)
    report.wall_time_s = round(time.perf_counter() - start, 3)
    report.peak_rss_mib = round(peak_rss_mib(), 1)
    return report


def merge(sources: list[str | os.PathLike], out: str | os.PathLike, function_names: list[str] | None = None,
          default_function: str | None = None, options: ConvertOptions | None = None) -> ConversionReport:
    """Merge Core ML packages into one multifunction .mlpackage, streaming the weights."""
    from .formats.coreml import merge as coreml_merge

    options = options or ConvertOptions()
    out = Path(out)
    prepare_out_dir(out.parent if str(out.parent) else Path("."))
    start = time.perf_counter()
    with OutputTransaction() as tx:
        report = coreml_merge.merge_packages([Path(s) for s in sources], list(function_names or []),
                                             default_function, out, options, tx)
    report.wall_time_s = round(time.perf_counter() - start, 3)
    report.peak_rss_mib = round(peak_rss_mib(), 1)
    return report
