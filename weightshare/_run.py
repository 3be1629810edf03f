"""What every conversion run does around its work: its inputs and outputs checked before anything is read,
the option conflicts refused (the one place that checks them), the output directory prepared, time and peak RSS.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, TypeVar

from ._atomic import TMP_PREFIX, OutputTransaction, clean_stale_temporaries
from ._format_options import check_unpack
from ._paths import check_no_overlap
from ._platform import TreePeak, own_peak_mib
from .errors import OutputError, UsageError
from .formats import Format, model_suffixes, registered
from .options import ConvertOptions
from .report import ConversionReport

_tree: TreePeak | None = None  # the running conversion's process-tree sampler (one run at a time per process)


def reset_peak_rss() -> None:
    """Start a new high-water mark, so that a report's peak is this conversion's: this process's VmHWM (Linux >=
    4.0; else a no-op) and the process tree's sampled peak (``TreePeak``; stopped by ``finish_run``)."""
    global _tree
    if _tree is not None:
        _tree.close()
    _tree = TreePeak()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


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


class _Report(Protocol):
    wall_time_s: float
    peak_rss_mib: float


_Timed = TypeVar("_Timed", bound=_Report)  # a model's, a zoo's, a folder's report


def finish(report: _Timed, start: float) -> _Timed:
    """Time and peak since ``start``: the process tree's (the converter and every child it ran, summed at each
    sample), never below this process's own high-water mark or a child's own peak."""
    report.wall_time_s = round(time.perf_counter() - start, 3)
    own = own_peak_mib()
    tree = _tree.peak_since(start) / 2**20 if _tree is not None else 0.0
    report.peak_rss_mib = round(max(own, tree), 1)
    if isinstance(report, ConversionReport):
        add_child_peak(report, own)
    return report


@contextmanager
def peak_window() -> Iterator[None]:
    """A run's memory window: ``reset_peak_rss`` on entry; on exit the tree sampler's thread stops, its samples
    stay for the ``finish`` that follows."""
    reset_peak_rss()
    try:
        yield
    finally:
        if _tree is not None:
            _tree.close()


@contextmanager
def stages_named(options: ConvertOptions, label: str | os.PathLike[str], several: bool) -> Iterator[None]:
    """While one model of several is worked on, each stage line names it: a batch's or zoo's line is labelled with
    the run ("3 models", "zoo"), which does not say which model the runtime's child is working on."""
    stage = options.stage
    if stage is None or not several:
        yield
        return
    options.stage = lambda message: stage(f"{os.fspath(label)}: {message}")
    try:
        yield
    finally:
        options.stage = stage


def add_child_peak(report: ConversionReport, own_mib: float) -> None:
    """--prepack's ORT child runs while the converter waits for it: the tree's peak counts both; each is also
    named on its own (the child's from its own ``ru_maxrss``, which a 50 ms sample can miss)."""
    child = report.prepack.get("ort_child_peak_rss_mib")
    if isinstance(child, (int, float)):
        report.prepack["converter_peak_rss_mib"] = round(own_mib, 1)
        report.peak_rss_mib = round(max(report.peak_rss_mib, child), 1)


def check_options(options: ConvertOptions) -> None:
    """Options that exclude each other, refused before anything is read (the one place that checks them; the
    public functions call it once per run, the runners they call never again)."""
    check_unpack(options.unpack, options.keep_packed, registered())  # what the formats declare (Format.options)
    if options.shared_blob is not None and options.blob_name is not None:
        raise UsageError("--blob and --shared-blob exclude each other")


def convert_one(fmt: Format, src: Path, out: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
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


def check_outputs(sources: list[Path], outputs: list[Path]) -> None:
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
    """Files as given; directories by their models (sorted); unexpanded globs expanded.

    A zoo puts every model in OUTDIR itself: a folder with models in subfolders (``onnx/``) is refused rather
    than silently flattened or cut short; ``convert_folder`` keeps a tree.
    """
    import glob

    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir() and path.suffix not in model_suffixes():
            found += sorted(
                p for p in path.iterdir() if p.suffix in model_suffixes() and not p.name.startswith(TMP_PREFIX)
            )
            nested = next((p for p in sorted(path.rglob("*/*")) if p.suffix in model_suffixes()), None)
            if nested is not None:
                raise UsageError(
                    f"{nested} is in a subfolder: --shared-blob puts every model in OUTDIR itself; name the models, "
                    "or convert the folder without --shared-blob (its tree is kept)",
                    path,
                )
        elif not path.exists() and glob.has_magic(str(item)):
            found += sorted(Path(p) for p in glob.glob(str(item)))
        else:
            found.append(path)
    return found
