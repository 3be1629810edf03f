"""`weightshare bench MODEL`: memory of 1..N sessions of the original and the converted model."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from . import api
from .errors import Unsupported, UsageError
from .formats import detect_format

MALLOC_ENV = "MALLOC_MMAP_THRESHOLD_"


def bench(model: str | os.PathLike, sessions: list[int], workdir: str | os.PathLike | None = None,
          progress=lambda msg: None) -> dict:
    """Convert ``model`` into ``workdir`` (a temporary directory by default) and measure both.

    Each (variant, runtime setting) runs in a fresh process; rows give PSS, private
    and shared MiB after 1..N sessions and the cumulative load time. ONNX models are also
    converted with ``--prepack`` and measured at default options.
    """
    model = Path(model)
    if not sessions or min(sessions) < 1:
        raise UsageError("--sessions needs positive counts, e.g. 1,2,4,8")
    fmt = detect_format(model)
    if fmt == "coreml":
        raise Unsupported("Core ML models cannot be loaded on this platform; use `inspect` for their structure",
                          model)
    with tempfile.TemporaryDirectory(prefix="weightshare-bench-", dir=workdir) as tmp:
        progress(f"converting {model.name}")
        converted = Path(api.convert(model, tmp).outputs[0])
        rows = []
        if fmt == "onnx":
            from .runtimes.ort import measure_sessions as measure

            modes = (("prepack off", True), ("default", False))
        else:
            from .runtimes.litert import measure_interpreters as measure

            modes = (("no delegate", True), ("XNNPACK", False))
        for variant, path in (("original", model), ("converted", converted)):
            for mode, share in modes:
                progress(f"{variant}, {mode}: {max(sessions)} sessions in a fresh process")
                for row in measure(str(path), sessions, share):
                    rows.append({"variant": variant, "mode": mode, **row})
        if fmt == "onnx":
            rows += _prepacked_rows(model, Path(tmp) / "prepack", sessions, progress)
    return {"model": str(model), "format": fmt, "sessions": sorted(sessions), "rows": rows}


def _prepacked_rows(model: Path, out: Path, sessions: list[int], progress) -> list[dict]:
    """``convert --prepack`` measured at default options, in a process started with the malloc setting
    that returns ORT's freed validation buffers to the OS (what ``weightshare.ort.session`` arranges)."""
    from .options import ConvertOptions
    from .runtimes.ort import measure_sessions

    progress(f"converting {model.name} with --prepack")
    prepacked = api.convert(model, out, ConvertOptions(prepack=True)).outputs[0]
    progress(f"converted --prepack, default: {max(sessions)} sessions in a fresh process")
    saved = os.environ.get(MALLOC_ENV)
    os.environ[MALLOC_ENV] = "1048576"  # inherited by the probe process; it only works from process start
    try:
        rows = measure_sessions(str(prepacked), sessions, share=False)
    finally:
        if saved is None:
            del os.environ[MALLOC_ENV]
        else:
            os.environ[MALLOC_ENV] = saved
    return [{"variant": "converted --prepack", "mode": "default", **row} for row in rows]


def plot(result: dict, path: str | os.PathLike) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise Unsupported("--plot needs matplotlib: pip install 'weightshare[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r["variant"], r["mode"]) for r in result["rows"]})
    for variant, mode in keys:
        rows = [r for r in result["rows"] if r["variant"] == variant and r["mode"] == mode]
        ax.plot([r["sessions"] for r in rows], [r["pss_mib"] for r in rows], marker="o",
                linestyle="-" if variant == "converted" else "--", label=f"{variant}, {mode}")
    ax.set_xlabel("sessions in one process")
    ax.set_ylabel("PSS (MiB)")
    ax.set_title(f"{Path(result['model']).name}: memory vs sessions")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
