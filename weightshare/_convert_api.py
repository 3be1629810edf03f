"""The conversion functions: ``convert``, ``convert_folder``, ``convert_many`` (one transaction per call), the
keyword options they share, and ``merge`` (models into one multifunction model, through the format's ``merge``).

Re-exported by ``weightshare.api``, their public home (import them from there).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ._atomic import TMP_PREFIX, OutputTransaction
from ._outputs_record import DroppedCompanions, dropped_companions
from ._paths import check_no_overlap
from ._placement import ALIGN_THRESHOLD, LARGE_ALIGN, AlignPolicy, Progress
from ._run import (
    check_input,
    check_options,
    check_outputs,
    expand_inputs,
    finish,
    prepare_out_dir,
    reset_peak_rss,
)
from ._zoo_api import convert_zoo
from .errors import OutputError, Unsupported, UsageError
from .formats import Format, detect, model_suffixes
from .options import BLOB_GRACE_S, INLINE_THRESHOLD, ConvertOptions
from .report import ConversionReport, ZooReport

if TYPE_CHECKING:  # imported where used: `convert` needs none of them (start-up time)
    from ._folder import FolderReport


def convert(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    *,
    prepack: bool = False,
    unpack: str | Iterable[str] = (),
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
    unpack: str | Iterable[str] = (),
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
    check_options(opts)
    from ._folder import convert_folder as run

    return run(Path(src), Path(out), opts)


@dataclass(frozen=True)
class _Keywords:
    """The keyword options of ``convert`` / ``convert_folder`` (the CLI's), in their order there."""

    prepack: bool
    unpack: str | Iterable[str]
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
            unpack=frozenset([self.unpack] if isinstance(self.unpack, str) else self.unpack),
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


def convert_inputs(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    options: ConvertOptions,
    shared_blob: str | None = None,
) -> ZooReport | FolderReport | list[ConversionReport]:
    """What ``weightshare convert INPUTS -o OUT [--shared-blob NAME]`` does: a zoo with ``shared_blob``, else a model
    folder's tree (given alone), else the models (files, folders' models, globs) as one batch."""
    check_options(options, shared_blob)
    if shared_blob is not None:
        return convert_zoo(inputs, out_dir, shared_blob, options)
    from ._folder import convert_folder as run_folder
    from ._folder import is_model_folder

    if any(is_model_folder(Path(i)) for i in inputs):
        if len(inputs) > 1:
            raise UsageError("a model folder is converted on its own (its tree is reproduced in OUTDIR): give it alone")
        return run_folder(Path(inputs[0]), Path(out_dir), options)
    return convert_many(expand_inputs(inputs), out_dir, options)


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
    check_options(options)
    sources = [Path(m) for m in models]
    if not sources:
        raise UsageError("no models to convert (none given, or a glob that matched nothing)")
    if options.blob_name is not None and len(sources) > 1:
        raise UsageError("--blob names one model's blob; with several models use --shared-blob or leave it out")
    out = Path(out_dir)
    check_outputs(sources, [out / s.name for s in sources])
    for s in sources:
        check_input(s)
        if s.is_dir() and s.suffix not in model_suffixes():
            raise UsageError("is a folder of models, not a model: convert it with convert_folder (tree kept)", s)
    formats = [detect(s) for s in sources]
    check_outputs(*_every_output(sources, formats, out, options))  # companions too (--prepack: .portable.onnx)
    start = time.perf_counter()
    reset_peak_rss()
    reports = []
    with OutputTransaction() as tx:
        prepare_out_dir(out, tx)
        for src, fmt in zip(sources, formats):  # before the blob collectors (hooks run in order)
            dropped = dropped_companions(fmt, src, out, options)
            if dropped:
                tx.add_hook(DroppedCompanions(out / src.name, dropped, options.blob_grace_s))
        for src, fmt in zip(sources, formats):
            t0 = time.perf_counter()
            reports.append(finish(convert_one(fmt, src, out, options, tx), t0))
    if len(reports) == 1:  # the commit is part of the one model's time
        finish(reports[0], start)
    return reports


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
        check_input(s)
    if not paths:
        raise UsageError("no models to merge")
    fmt = detect(paths[0])
    merge_models = getattr(fmt, "merge", None)  # a format with multifunction models
    if merge_models is None:
        raise Unsupported(f"{fmt.name} models cannot be merged into one multifunction model", paths[0])
    start = time.perf_counter()
    reset_peak_rss()
    with OutputTransaction() as tx:
        prepare_out_dir(out.parent if str(out.parent) else Path("."), tx)
        report: ConversionReport = merge_models(paths, list(function_names or []), default_function, out, options, tx)
    return finish(report, start)
