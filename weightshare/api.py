"""The Python API; the CLI is a thin layer over these functions (re-exported by ``weightshare``).

Example:
    import weightshare
    report = weightshare.convert("model.onnx", "out/")
    print(report.bytes_written, report.ops_removed)
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ._atomic import TMP_PREFIX, CommitHook, OutputTransaction, clean_stale_temporaries
from ._disk import DiskPeak
from ._paths import check_no_overlap, plain_file_name
from ._pipeline import PreparedModel, blob_target, write_models
from ._placement import ALIGN_THRESHOLD, LARGE_ALIGN, AlignPolicy, Progress
from .errors import OutputError, Unsupported, UsageError
from .formats import Format, detect, model_suffixes
from .options import BLOB_GRACE_S, INLINE_THRESHOLD, ConvertOptions, Unpack
from .report import ConversionReport, ZooReport

if TYPE_CHECKING:  # imported where used: `convert` needs none of them (start-up time)
    from ._findings import Finding
    from ._folder import FolderReport
    from ._inventory import ModelInventory
    from ._verify import VerifyReport
    from .formats.base import BlobContainer

__all__ = [
    "CheckReport",
    "check",
    "convert",
    "convert_folder",
    "convert_many",
    "convert_zoo",
    "inspect",
    "merge",
    "verify",
]

_ZOO_MARKER = ".weightshare-zoo.json"


def _reset_peak_rss() -> None:
    """Start a new high-water mark, so that a report's peak is this conversion's (Linux >= 4.0; else a no-op)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss_mib() -> float:
    """This process's own peak RSS: VmHWM. Not getrusage's ru_maxrss, which a child inherits from the parent
    that forked it (a converter started by a 1.7 GB parent reported 1708 MiB while /proc showed 73 MiB)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # not on Windows, where nothing gets this far (require_posix)

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _prepare_out_dir(out_dir: str | os.PathLike[str], tx: OutputTransaction | None = None) -> Path:
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


def _check_input(src: Path) -> None:
    """Refuse what cannot be a model before opening it: a FIFO or device would block or never end."""
    try:
        st = os.stat(src)
    except OSError:
        return  # missing or unreadable: detect_format says so with the file's name
    if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
        return
    raise UsageError("is not a regular file (a FIFO, socket or device); refusing to read it", src)


_Timed = TypeVar("_Timed", ConversionReport, ZooReport, "FolderReport")  # _folder.py times its report too


def _finish(report: _Timed, start: float) -> _Timed:
    report.wall_time_s = round(time.perf_counter() - start, 3)
    report.peak_rss_mib = round(_peak_rss_mib(), 1)
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
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    *,
    prepack: bool = False,
    unpack: Iterable[str] = (),
    keep_packed: bool = False,
    external: bool = False,
    blob: str | None = None,
    blob_grace: float = BLOB_GRACE_S,
    align: int = LARGE_ALIGN,
    align_threshold: int = ALIGN_THRESHOLD,
    inline_threshold: int = INLINE_THRESHOLD,
    ort_child_timeout: float | None = None,
    ort_child_memory: int | None = None,
    ort_max_growth: float | None = None,
    progress: Progress | None = None,
) -> ConversionReport:
    """Convert one model into the directory ``out``; its outputs appear all together or not at all.

    The keyword options are those of ``weightshare convert``; a ``ConvertOptions`` may be passed instead.

    Args:
        src: an ONNX (.onnx), TFLite (.tflite) or Core ML (.mlpackage) model; the format is told from its content.
        out: output directory, created if missing.
        options: all options as one ``ConvertOptions``; the keywords must then keep their defaults.
        prepack: also store the runtime's pre-packed weights (``--prepack``; ONNX needs onnxruntime).
        unpack: opt-in unpackings, ``Unpack`` values: ``"sparse"`` (TFLite), ``"ort-cpu"`` (ONNX).
        keep_packed: do not unpack fp16 + Cast / DEQUANTIZE or typed protobuf fields (``--keep-packed``).
        external: TFLite: write an external safetensors blob (``--external``).
        blob: the blob's NAME, written as ``NAME.<digest12>.safetensors`` (default ``MODEL.weights``).
        blob_grace: seconds an earlier blob no model references any more is kept for readers (``--blob-grace``).
        align: alignment in bytes of payloads of at least ``align_threshold`` bytes (``--align``).
        align_threshold: payload size from which ``align`` applies; smaller payloads are 64-byte aligned.
        inline_threshold: payloads smaller than this many bytes stay inside the model file.
        ort_child_timeout: wall-time limit in seconds of the onnxruntime child of ``prepack`` / ``unpack=("ort-cpu",)``
            (``--ort-child-timeout``); None: derived from the model's size.
        ort_child_memory: that child's address-space limit in MiB (``--ort-child-memory``); None: derived.
        ort_max_growth: what that child may write, as a multiple of the model's bytes (``--ort-max-growth``);
            None: 4x, at least 16 MiB.
        progress: called with a byte count as payload bytes are written.

    Returns:
        What was written and moved (``ConversionReport.outputs``, byte counts, time, peak RSS).

    Raises:
        InvalidModel: ``src`` is not a well-formed model.
        UnsafePath: a path in the model leads outside its directory.
        Unsupported: the model uses something weightshare does not handle.
        UsageError: contradicting options, an output onto the input, a folder (see ``convert_folder``).
        OutputError: writing failed (disk full, permissions); nothing was left behind.

    Example:
        >>> report = weightshare.convert("model.onnx", "out/", prepack=True)
        >>> report.outputs
        ['out/model.onnx', 'out/model.weights.1f2e3d4c5b6a.safetensors']
    """
    keywords = _Keywords(
        prepack,
        unpack,
        keep_packed,
        external,
        blob,
        blob_grace,
        align,
        align_threshold,
        inline_threshold,
        ort_child_timeout,
        ort_child_memory,
        ort_max_growth,
    )
    opts = _options(options, keywords.options(progress))
    return convert_many([src], out, opts)[0]


def convert_folder(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    *,
    prepack: bool = False,
    unpack: Iterable[str] = (),
    keep_packed: bool = False,
    external: bool = False,
    blob: str | None = None,
    blob_grace: float = BLOB_GRACE_S,
    align: int = LARGE_ALIGN,
    align_threshold: int = ALIGN_THRESHOLD,
    inline_threshold: int = INLINE_THRESHOLD,
    ort_child_timeout: float | None = None,
    ort_child_memory: int | None = None,
    ort_max_growth: float | None = None,
    progress: Progress | None = None,
) -> FolderReport:
    """Convert a model folder (Hugging Face, optimum, onnxruntime-genai, ...) into ``out``, keeping its tree.

    Every model (``.onnx``, ``.tflite``, ``.mlpackage``) is converted at its relative path, ``onnx/`` and other
    subfolders included; every other file is copied unchanged (byte-identical, permission bits kept); the files a
    model references for its weights (``model.onnx_data``) are not copied: the model's blob replaces them. All of
    it is committed in one transaction: everything appears, or nothing.

    Args:
        src: the folder.
        out: output directory, created if missing; neither inside ``src`` nor containing it.
        options: all options as one ``ConvertOptions``; the keywords must then keep their defaults.
        prepack: as in ``convert``.
        unpack: as in ``convert``.
        keep_packed: as in ``convert``.
        external: as in ``convert``.
        blob: as in ``convert``; only for a folder with one model.
        blob_grace: as in ``convert``.
        align: as in ``convert``.
        align_threshold: as in ``convert``.
        inline_threshold: as in ``convert``.
        ort_child_timeout: as in ``convert``.
        ort_child_memory: as in ``convert``.
        ort_max_growth: as in ``convert``.
        progress: as in ``convert``.

    Returns:
        A ``FolderReport``: each model's ``ConversionReport`` and the copied files.

    Raises:
        UsageError: ``src`` is not a folder (or is a model package), holds no model, overlaps ``out``, or holds a
            FIFO or device.
        Unsupported: a symlink to a directory in ``src``; a model weightshare cannot convert.
        WeightshareError: any of ``convert``'s errors; nothing is written.

    Example:
        >>> report = weightshare.convert_folder("phi-3-mini-onnx/", "out/")
        >>> [m.model for m in report.models], report.copied[:2]
        (['phi-3-mini-onnx/model.onnx'], ['out/config.json', 'out/genai_config.json'])
    """
    keywords = _Keywords(
        prepack,
        unpack,
        keep_packed,
        external,
        blob,
        blob_grace,
        align,
        align_threshold,
        inline_threshold,
        ort_child_timeout,
        ort_child_memory,
        ort_max_growth,
    )
    opts = _options(options, keywords.options(progress))
    _check_options(opts)
    from ._folder import convert_folder as run

    return run(Path(src), Path(out), opts)


@dataclass(frozen=True)
class _Keywords:
    """The keyword options of ``convert`` / ``convert_folder`` (the CLI's), in their order there."""

    prepack: bool
    unpack: Iterable[str]
    keep_packed: bool
    external: bool
    blob: str | None
    blob_grace: float
    align: int
    align_threshold: int
    inline_threshold: int
    ort_child_timeout: float | None
    ort_child_memory: int | None
    ort_max_growth: float | None

    def options(self, progress: Progress | None) -> ConvertOptions:
        return ConvertOptions(
            align=AlignPolicy(large=self.align, threshold=self.align_threshold),
            inline_threshold=self.inline_threshold,
            keep_packed=self.keep_packed,
            unpack=frozenset(u.value if isinstance(u, Unpack) else str(u) for u in self.unpack),
            blob_name=self.blob,
            blob_grace_s=self.blob_grace,
            external=self.external,
            prepack=self.prepack,
            progress=progress,
            ort_child_timeout_s=self.ort_child_timeout,
            ort_child_memory_mib=self.ort_child_memory,
            ort_max_growth=self.ort_max_growth,
        )


def _options(options: ConvertOptions | None, from_keywords: ConvertOptions) -> ConvertOptions:
    if options is None:
        return from_keywords
    if from_keywords != ConvertOptions():
        raise UsageError("pass the options either as a ConvertOptions or as keywords, not both")
    return options


def _check_options(options: ConvertOptions, shared_blob: str | None = None) -> None:
    """Options that exclude each other, refused before anything is read (the one place that checks them)."""
    if Unpack.ORT_CPU.value in options.unpack and options.keep_packed:
        raise UsageError("--unpack ort-cpu and --keep-packed exclude each other")
    if shared_blob is not None and options.blob_name is not None:
        raise UsageError("--blob and --shared-blob exclude each other")


def _convert_inputs(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    options: ConvertOptions,
    shared_blob: str | None = None,
) -> ZooReport | FolderReport | list[ConversionReport]:
    """What ``weightshare convert INPUTS -o OUT [--shared-blob NAME]`` does: a zoo with ``shared_blob``, else a model
    folder's tree (given alone), else the models (files, folders' models, globs) as one batch."""
    _check_options(options, shared_blob)
    if shared_blob is not None:
        return convert_zoo(inputs, out_dir, shared_blob, options)
    from ._folder import convert_folder as run_folder
    from ._folder import is_model_folder

    if any(is_model_folder(Path(i)) for i in inputs):
        if len(inputs) > 1:
            raise UsageError("a model folder is converted on its own (its tree is reproduced in OUTDIR): give it alone")
        return run_folder(Path(inputs[0]), Path(out_dir), options)
    return convert_many(_expand_inputs(inputs), out_dir, options)


def convert_many(
    models: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str], options: ConvertOptions | None = None
) -> list[ConversionReport]:
    """Convert several models into ``out_dir`` in one transaction: every output is committed, or none.

    Refused before anything is written: two inputs whose outputs would have the same path,
    an output onto an input, and an output inside an input (.mlpackage).

    Args:
        models: model files or .mlpackage directories (each as ``convert``'s ``src``).
        out_dir: output directory, created if missing; every model is written into it by its file name.
        options: the options, as ``convert`` takes them (``ConvertOptions.blob_name`` needs a single model).

    Returns:
        One ``ConversionReport`` per model, in order.

    Raises:
        WeightshareError: any of ``convert``'s errors, for the first model that has one; nothing is written.

    Example:
        >>> reports = weightshare.convert_many(["a.onnx", "b.tflite"], "out/")
        >>> [r.outputs[0] for r in reports]
        ['out/a.onnx', 'out/b.tflite']
    """
    options = options or ConvertOptions()
    _check_options(options)
    sources = [Path(m) for m in models]
    if not sources:
        raise UsageError("no models to convert (none given, or a glob that matched nothing)")
    if options.blob_name is not None and len(sources) > 1:
        raise UsageError("--blob names one model's blob; with several models use --shared-blob or leave it out")
    out = Path(out_dir)
    _check_outputs(sources, [out / s.name for s in sources])
    for s in sources:
        _check_input(s)
        if s.is_dir() and s.suffix not in model_suffixes():
            raise UsageError("is a folder of models, not a model: convert it with convert_folder (tree kept)", s)
    formats = [detect(s) for s in sources]
    _check_outputs(*_every_output(sources, formats, out, options))  # companions too (--prepack: .portable.onnx)
    start = time.perf_counter()
    _reset_peak_rss()
    reports = []
    with OutputTransaction() as tx:
        _prepare_out_dir(out, tx)
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


def _every_output(
    sources: list[Path], formats: list[Format], out: Path, options: ConvertOptions
) -> tuple[list[Path], list[Path]]:
    """(source, output) pairs of every file a run names in advance: each model and its companions.

    A format lists its companions with an optional ``outputs(src, out_dir, options)``; blobs are named by their
    content digest and checked again at commit (``OutputTransaction`` refuses two outputs on one path)."""
    pairs = []
    for src, fmt in zip(sources, formats):
        listed = getattr(fmt, "outputs", None)
        for o in listed(src, out, options) if listed is not None else [out / src.name]:
            pairs.append((src, o))
    return [s for s, _ in pairs], [o for _, o in pairs]


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


def _expand_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
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


class _DropRemovedModels(CommitHook):
    """After a zoo commit: remove the models the previous zoo listed and this one does not."""

    def __init__(self, out: Path, keep: list[str]) -> None:
        self.out, self.keep = out, set(keep)
        self.old: list[str] = []

    def before(self) -> None:
        try:
            self.old = list(json.loads((self.out / _ZOO_MARKER).read_text()).get("models", []))
        except (OSError, ValueError, AttributeError):
            self.old = []

    def after(self) -> None:
        for name in self.old:
            # The marker is a file anyone can edit: only plain, visible model file names of an earlier zoo
            # (never the marker itself, a temporary, a path, or a name with a NUL byte).
            if not plain_file_name(name) or name in self.keep or not str(name).endswith(model_suffixes()):
                continue
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

    Args:
        models: model files, folders (their models, not their subfolders) or globs; ONNX, or TFLite with
            ``ConvertOptions(external=True)``.
        out_dir: the zoo directory: new, empty, or written by an earlier ``convert_zoo``.
        shared_blob: the blob's NAME (``--shared-blob``).
        options: the options, as ``convert`` takes them; ``prepack`` is refused (a prepacked model needs its
            own blob).

    Returns:
        A ``ZooReport``: the blob, each model's report, and the totals that show the deduplication.

    Raises:
        UsageError: no models, ``out_dir`` not a zoo, an input inside ``out_dir``, ``prepack``, a folder with
            models in subfolders.
        WeightshareError: any of ``convert``'s errors; nothing is written.

    Example:
        >>> zoo = weightshare.convert_zoo(["a.onnx", "b.onnx"], "zoo/", "shared")
        >>> zoo.blob
        'zoo/shared.0a1b2c3d4e5f.safetensors'
    """
    options = options or ConvertOptions()
    _check_options(options, shared_blob)
    sources = _expand_inputs(models)
    if not sources:
        raise UsageError("no models to convert")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError("output must be a directory", out)
    if out.exists() and any(out.iterdir()) and not (out / _ZOO_MARKER).exists():
        raise UsageError(
            "output directory is not empty and was not written by --shared-blob; choose an empty or new directory", out
        )
    for s in sources:
        if s.resolve().parent == out.resolve():
            raise UsageError("an input lies in the output directory, which is rewritten as a whole", s)
    _check_outputs(sources, [out / s.name for s in sources])
    for s in sources:
        _check_input(s)
    formats = [detect(s) for s in sources]
    target = blob_target(None, out, shared_blob, _shared_container(sources, formats))
    start = time.perf_counter()
    _reset_peak_rss()
    with OutputTransaction() as tx, ExitStack() as stages:
        _prepare_out_dir(out, tx)
        disk = stages.enter_context(DiskPeak(out)) if options.prepack else None  # zoo-wide; entered first: exits last
        prepared = [_prepare_zoo_model(fmt, src, out, options, stages) for fmt, src in zip(formats, sources)]
        for p, src in zip(prepared, sources):
            p.name_prefix = f"{src.stem}/" if len(prepared) > 1 else ""
        for fmt in {id(f): f for f in formats}.values():  # what models sharing one blob record together
            join = getattr(fmt, "join_shared", None)
            if join is not None:
                join([p for p, f in zip(prepared, formats) if f is fmt], options)
        write_models(prepared, out, target, options, tx)
        blob = next((o for p in prepared for o in p.report.outputs if o.endswith(".safetensors")), "")
        report = ZooReport(blob=blob, models=[p.report for p in prepared], blob_bytes=prepared[0].report.blob_bytes)
        names = [s.name for s in sources]
        written = [Path(o).name for p in prepared for o in p.report.outputs if not o.endswith(".safetensors")]
        marker = tx.new_file(out / _ZOO_MARKER)
        marker.write_text(json.dumps({"blob": Path(blob).name, "models": names}, indent=1) + "\n")
        tx.add_hook(_DropRemovedModels(out, list(dict.fromkeys(names + written))))
    if disk is not None:
        for fmt, m in zip(formats, report.models):
            note = getattr(fmt, "report_disk", None)  # the format says what its temporary disk was for
            if note is not None and m.prepack:
                note(m, disk.peak)
    _finish(report, start)
    children = [m.prepack.get("ort_child_peak_rss_mib", 0.0) for m in report.models]
    report.peak_rss_mib = round(report.peak_rss_mib + max(children, default=0.0), 1)  # one ORT child at a time
    for m in report.models:
        m.wall_time_s, m.peak_rss_mib = report.wall_time_s, report.peak_rss_mib
    return report


def _shared_container(sources: list[Path], formats: list[Format]) -> BlobContainer:
    """The container of a zoo's one blob: the one every model's format declares (``Format.blob_container``)."""
    first = formats[0].blob_container
    for src, fmt in zip(sources, formats):
        container = fmt.blob_container
        if container is None:
            raise Unsupported(f"{fmt.name} models keep their weights in their own files: they cannot share a blob", src)
        if first is None or container != first:
            raise Unsupported("these models' formats keep a shared blob in different containers", src)
    assert first is not None
    return first


def _prepare_zoo_model(fmt: Format, src: Path, out: Path, options: ConvertOptions, stages: ExitStack) -> PreparedModel:
    """One zoo model's payloads: the format's ``prepare_shared`` when it has one (it may stage files that ``stages``
    removes, e.g. ONNX --prepack), else its ``prepare``."""
    prepare_shared = getattr(fmt, "prepare_shared", None)
    if prepare_shared is not None:
        prepared: PreparedModel = prepare_shared(src, out, options, stages)
        return prepared
    return fmt.prepare(src, out, options)


def merge(
    sources: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    function_names: list[str] | None = None,
    default_function: str | None = None,
    options: ConvertOptions | None = None,
) -> ConversionReport:
    """Merge Core ML packages into one multifunction .mlpackage, storing each distinct weight once.

    Args:
        sources: Core ML .mlpackage directories (a multifunction source contributes all its functions).
        out: the output .mlpackage.
        function_names: a function name for each source, in order (default: each source's stem).
        default_function: the function run by default (default: the first).
        options: ``ConvertOptions``; only ``align`` and the progress callbacks apply.

    Returns:
        The ``ConversionReport`` of the merged package.

    Raises:
        InvalidModel: a source is not a well-formed Core ML package.
        UsageError: duplicate or unknown function names, an output onto or inside a source.
        OutputError: writing failed; nothing was left behind.

    Example:
        >>> weightshare.merge(["small.mlpackage", "large.mlpackage"], "both.mlpackage", ["small", "large"])
    """
    options = options or ConvertOptions()
    out = Path(out)
    paths = [Path(s) for s in sources]
    check_no_overlap(paths, [out])
    for s in paths:
        _check_input(s)
    if not paths:
        raise UsageError("no models to merge")
    fmt = detect(paths[0])
    merge_models = getattr(fmt, "merge", None)  # a format with multifunction models
    if merge_models is None:
        raise Unsupported(f"{fmt.name} models cannot be merged into one multifunction model", paths[0])
    start = time.perf_counter()
    _reset_peak_rss()
    with OutputTransaction() as tx:
        _prepare_out_dir(out.parent if str(out.parent) else Path("."), tx)
        report: ConversionReport = merge_models(paths, list(function_names or []), default_function, out, options, tx)
    return _finish(report, start)


@dataclass
class CheckReport:
    """The verdict of ``check``: ``ok`` when no finding fails the gate."""

    ok: bool
    models: list[ModelInventory] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


def inspect(model: str | os.PathLike[str], *, hash_payloads: bool = True) -> ModelInventory:
    """Every weight payload of a model: where it lives, its encoding and alignment, what each runtime copies.

    Args:
        model: an ONNX, TFLite or Core ML model.
        hash_payloads: hash every payload (duplicates, and checks against the digests a blob records).

    Returns:
        The ``ModelInventory``; ``check`` turns it into findings.

    Raises:
        InvalidModel: the model cannot be read.
        Unsupported: not a model of a known format.

    Example:
        >>> inv = weightshare.inspect("out/model.onnx")
        >>> inv.copied_per_session, inv.external_files
        (0, ['model.weights.1f2e3d4c5b6a.safetensors'])
    """
    from ._inventory import inventory

    return inventory(model, hash_payloads=hash_payloads)


def check(
    models: Sequence[str | os.PathLike[str]],
    *,
    target: Sequence[str] = (),
    threshold: int = 1 << 20,
    measure: bool = True,
    inline_threshold: int = INLINE_THRESHOLD,
    strict: bool = False,
) -> CheckReport:
    """The CI gate: whether every model is share-ready (``weightshare check``).

    Args:
        models: model files, folders (searched recursively) or globs.
        target: runtime setting ids the models will be loaded with (``--target``: ``ort-default``,
            ``ort-disable-prepacking``, ``litert-builtin``, ``litert-xnnpack``, ``litert-compiled-cache``,
            ``coreml``); a format none is named for is held to its sharing setting.
        threshold: bytes per session a copy may cost before it is an error (``--threshold``, default 1 MiB).
        measure: ONNX: ask onnxruntime, in child processes, what one more session costs (``--no-measure``: False).
        inline_threshold: embedded payloads below this many bytes are fine.
        strict: warnings fail the gate too (copies that only a runtime's default setting makes).

    Returns:
        A ``CheckReport``: ``ok``, each model's inventory and every finding (``Finding.line()`` for one line).

    Raises:
        UsageError: no model found.

    Example:
        >>> result = weightshare.check(["out/"])
        >>> result.ok, [f.line() for f in result.findings]
        (True, [])
    """
    from ._check import Gate, find_models
    from ._check import check as run_check
    from ._findings import Severity

    paths = find_models(models)
    if not paths:
        raise UsageError("no models found")
    inventories, findings = run_check(paths, Gate(tuple(target), threshold, inline_threshold, measure=measure))
    ok = not any(strict or f.severity == Severity.ERROR for f in findings)
    return CheckReport(ok, inventories, findings)


def verify(
    original: str | os.PathLike[str],
    converted: str | os.PathLike[str],
    *,
    runs: int = 3,
    dims: dict[str, int] | None = None,
    shapes: dict[str, list[int]] | None = None,
    inputs: dict[str, Any] | None = None,
    seed: int = 0,
    decode_steps: int = 0,
) -> VerifyReport:
    """Run both models in the real runtime on the same inputs; pass only if every output is byte-identical.

    Also re-hashes every blob payload against its recorded digest. Core ML (no runtime on Linux): the weights
    must decode to the same bytes and the programs must match op for op.

    Args:
        original: the model before conversion.
        converted: the converted model.
        runs: runs with different seeded random inputs.
        dims: value of a symbolic input dimension by name; ``"*"`` sets every other dynamic dimension.
        shapes: TFLite: the full shape of an input with dynamic dims, by input name.
        inputs: real values (numpy arrays) for inputs, by name, used in every run.
        seed: seed of the random inputs of the first run.
        decode_steps: ONNX decoders: after the runs, a prefill step then this many steps feeding each
            ``present*`` output back as its ``past*`` input (next token: the argmax of the logits).

    Returns:
        A ``VerifyReport``; ``passed`` is the verdict, ``mismatches`` and ``checksum_mismatches`` say why not.

    Raises:
        OriginalFails: the original itself does not run with these inputs.
        UsageError: the two models are not of the same format, ``runs`` < 1.

    Example:
        >>> weightshare.verify("model.onnx", "out/model.onnx", runs=2).passed
        True
    """
    from ._verify import verify as run_verify

    return run_verify(original, converted, runs, dims, seed, inputs, shapes, decode_steps)
