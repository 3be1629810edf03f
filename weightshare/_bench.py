"""`weightshare bench MODEL`: memory of 1..N sessions of the original and the converted model."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from . import api
from .errors import Unsupported, UsageError
from .formats import BenchRuntime, detect
from .options import ConvertOptions
from .report import JsonDict


def bench(
    model: str | os.PathLike[str],
    sessions: list[int],
    workdir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], object] = lambda msg: None,
    inputs: dict[str, str] | None = None,
) -> JsonDict:
    """Convert ``model`` into ``workdir`` (a temporary directory by default) and measure both.

    Each (variant, runtime setting) runs in a fresh process; rows give PSS, private
    and shared MiB after 1..N sessions and the cumulative load time. ONNX models are also
    converted with ``--prepack`` and measured at default options. ``inputs`` (TFLite): input name -> .npy file
    fed instead of random values.
    """
    model = Path(model)
    if not sessions or min(sessions) < 1:
        raise UsageError("--sessions needs positive counts, e.g. 1,2,4,8")
    fmt = detect(model)
    runtime = fmt.bench_runtime(model)
    measure = runtime.measure
    if inputs:
        if not runtime.takes_inputs:
            raise UsageError(f"bench --input is not supported for {fmt.name} models (their inputs are made in range)")
        for name, file in inputs.items():
            if not Path(file).is_file():
                raise UsageError(f"--input {name}: no such file {file}")
        given = {name: str(Path(file).resolve()) for name, file in inputs.items()}

        def measure(path: str, counts: list[int], share: bool) -> list[JsonDict]:
            return runtime.measure(path, counts, share, given)  # type: ignore[call-arg]

    with tempfile.TemporaryDirectory(prefix="weightshare-bench-", dir=workdir) as tmp:
        progress(f"converting {model.name}")
        converted = Path(api.convert(model, tmp).outputs[0])
        rows = []
        with _environ(runtime.env):  # inherited by every probe process (check's measuring child sets the same)
            for variant, path in (("original", model), ("converted", converted)):
                for mode, share in runtime.modes:
                    progress(f"{variant}, {mode}: {max(sessions)} sessions in a fresh process")
                    for row in measure(str(path), sessions, share):
                        rows.append({"variant": variant, "mode": mode, **row})
        if runtime.prepacked is not None:
            rows += _prepacked_rows(
                model, Path(tmp) / "prepack", sessions, runtime, progress, given if inputs else None
            )
    return {"model": str(model), "format": fmt.name, "sessions": sorted(sessions), "rows": rows}


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in this process's environment (for the probe processes it starts), then restored."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _prepacked_rows(
    model: Path,
    out: Path,
    sessions: list[int],
    runtime: BenchRuntime,
    progress: Callable[[str], object],
    inputs: dict[str, str] | None = None,
) -> list[JsonDict]:
    """``convert --prepack`` measured under the runtime's setting for it, in a fresh process started with the
    runtime's environment for it (ONNX: the malloc setting that returns ORT's freed validation buffers to the
    OS, which ``weightshare.ort.session`` arranges)."""

    assert runtime.prepacked is not None
    mode, share = runtime.prepacked
    progress(f"converting {model.name} with --prepack")
    prepacked = api.convert(model, out, ConvertOptions(prepack=True)).outputs[0]
    progress(f"converted --prepack, {mode}: {max(sessions)} sessions in a fresh process")
    with _environ({**runtime.env, **runtime.prepacked_env}):  # inherited by the probe process, read at its start
        measure = runtime.prepacked_measure or runtime.measure
        rows = measure(str(prepacked), sessions, share, *([inputs] if inputs else []))
    return [{"variant": "converted --prepack", "mode": mode, **row} for row in rows]


# One look per series: overlapping lines (two flat ones at the same PSS) stay distinguishable by marker, dash
# and a hollow marker on top of a filled one; drawn largest-first so a small marker is never hidden.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
_DASHES = ("-", "--", "-.", ":")


def plot(result: JsonDict, path: str | os.PathLike[str], caption: str | None = None) -> None:
    """A PNG of PSS against the number of sessions, one line per (variant, runtime setting) of ``result``.

    Args:
        result: what ``bench`` returned.
        path: the PNG to write.
        caption: what was measured, printed under the chart (default: the model, the format and the method).

    Raises:
        Unsupported: matplotlib is not installed (the ``plot`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise Unsupported("--plot needs matplotlib: pip install 'weightshare[plot]'") from None
    fig, ax = plt.subplots(figsize=(7.5, 5.4))
    keys = sorted({(r["variant"], r["mode"]) for r in result["rows"]})
    for i, (variant, mode) in enumerate(keys):
        rows = [r for r in result["rows"] if r["variant"] == variant and r["mode"] == mode]
        ax.plot(
            [r["sessions"] for r in rows],
            [r["pss_mib"] for r in rows],
            marker=_MARKERS[i % len(_MARKERS)],
            markersize=11 - 1.5 * (i % 4),
            markerfacecolor="none" if i % 2 else None,
            markeredgewidth=1.6,
            linewidth=1.6,
            linestyle=_DASHES[i % len(_DASHES)],
            label=f"{variant}, {mode}",
            zorder=2 + i,
        )
    ax.set_xticks(sorted(result["sessions"]))  # session counts are integers: no 1.5 sessions
    ax.set_xlabel("sessions in one process")
    ax.set_ylabel("PSS (MiB)")
    ax.set_title(f"{Path(result['model']).name}: memory vs sessions")
    ax.grid(alpha=0.3)
    ax.legend()
    if caption is None:
        caption = (
            f"PSS (/proc/<pid>/smaps_rollup) of one process after N {result['format']} sessions of "
            f"{Path(result['model']).name}, each line measured in a fresh process (weightshare bench)."
        )
    fig.text(0.01, 0.01, caption, fontsize=8, wrap=True, va="bottom")
    fig.tight_layout(rect=(0, 0.1, 1, 1))  # room for the caption below the axis label
    fig.savefig(path, dpi=110)
    plt.close(fig)
