"""The conversion driver and the public conversion functions.

Every run goes the same way: its options settled (a ``ConvertOptions``, or the keywords derived from it) and
checked once (``check_options``); its inputs planned (``plan``: one batch of model files, one model folder, or a
zoo); the plan run by its runner (``run_batch`` here, ``_folder.run_folder``, ``_zoo_api.run_zoo``), which
commits everything in one transaction. ``weightshare convert`` calls ``convert`` as any user would.

Re-exported by ``weightshare.api``, their public home (import them from there).
"""

from __future__ import annotations

import inspect
import os
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Unpack, overload

from . import _inputs
from ._atomic import OutputTransaction
from ._outputs_record import named_key, run_key
from ._paths import check_no_overlap
from ._replacement import attach
from ._run import (
    check_input,
    check_options,
    check_outputs,
    convert_one,
    expand_inputs,
    finish,
    peak_window,
    prepare_out_dir,
    stages_named,
)
from .errors import Unsupported, UsageError
from .formats import Format, detect, model_suffixes
from .options import ConvertOptions, keywords_of
from .report import ConversionReport, ZooReport

if TYPE_CHECKING:  # imported where used: `convert` needs none of them (start-up time)
    from ._folder import FolderReport
    from ._option_keywords import ConvertKeywords, MergeKeywords, ZooKeywords

_F = TypeVar("_F", bound=Callable[..., Any])


def _with_keywords(command: Literal["convert", "zoo", "merge"]) -> Callable[[_F], _F]:
    """Give ``**keywords`` its keywords at run time too: the signature (``help()``, IDEs, typer) and the Args of
    the docstring list every option ``ConvertOptions`` declares, its default and its help."""

    def wrap(func: _F) -> _F:
        sig = inspect.signature(func)
        fixed = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        derived = [
            inspect.Parameter(k.name, inspect.Parameter.KEYWORD_ONLY, default=k.default, annotation=k.annotation)
            for k in keywords_of(command)
        ]
        func.__signature__ = sig.replace(parameters=fixed + derived)  # type: ignore[attr-defined]
        lines = []
        for k in keywords_of(command):
            flag = f" (``{k.opt.flag}``)" if k.opt.flag else ""
            lines += textwrap.wrap(
                f"{k.name}: {k.opt.help}{flag}",
                112,
                initial_indent=" " * 8,
                subsequent_indent=" " * 12,
                break_on_hyphens=False,  # a flag stays whole
            )
        func.__doc__ = (func.__doc__ or "").replace(" " * 8 + "<keywords>", "\n".join(lines))
        return func

    return wrap


def _settle(
    options: ConvertOptions | None,
    keywords: Mapping[str, object],
    command: Literal["convert", "zoo", "merge"] = "convert",
) -> ConvertOptions:
    """The run's options: the ``ConvertOptions`` given, or the one its keywords make (not both)."""
    if options is None:
        return ConvertOptions.from_keywords(keywords, command)
    if keywords:
        raise UsageError("pass the options either as a ConvertOptions or as keywords, not both")
    return options


@dataclass(frozen=True)
class Plan:
    """What a run converts: a batch of models into OUTDIR, one model folder's tree, or a zoo (one shared blob)."""

    kind: Literal["batch", "folder", "zoo"]
    sources: list[Path]


def plan(inputs: Sequence[str | os.PathLike[str]], options: ConvertOptions) -> Plan:
    """A zoo with ``options.shared_blob`` (a model folder given alone: its tree kept, one blob per directory of
    models); else a model folder's tree (given alone); else the models (files, globs) as one batch."""
    from ._folder import is_model_folder

    if options.shared_blob is not None:
        return Plan("zoo", _zoo_sources(inputs))

    if any(is_model_folder(Path(i)) for i in inputs):
        if len(inputs) > 1:
            raise UsageError("a model folder is converted on its own (its tree is reproduced in OUTDIR): give it alone")
        return Plan("folder", [Path(inputs[0])])
    return Plan("batch", expand_inputs(inputs))


def run(p: Plan, out: Path, options: ConvertOptions) -> list[ConversionReport] | FolderReport | ZooReport:
    """Run a plan whose options ``check_options`` accepted; every output is committed, or none."""
    if p.kind == "zoo":
        from ._zoo_api import run_zoo

        return run_zoo(p.sources, out, options)
    if p.kind == "folder":
        from ._folder import run_folder

        return run_folder(p.sources[0], out, options)
    return run_batch(p.sources, out, options)


@overload
def convert(  # type: ignore[overload-overlap]  # a str is a Sequence too: this first form wins for it
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> ConversionReport: ...


@overload
def convert(
    src: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> list[ConversionReport] | FolderReport | ZooReport: ...


@_with_keywords("convert")
def convert(
    src: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> ConversionReport | list[ConversionReport] | FolderReport | ZooReport:
    """Convert models into the directory ``out``; the outputs of one call appear all together or not at all.

    One model (a path) gives its ``ConversionReport``. A list of inputs is planned as ``weightshare convert`` plans
    its arguments: with ``shared_blob`` a zoo (``ZooReport``), else one model folder given alone (its tree kept,
    ``FolderReport``), else the models and globs as one batch (a list of ``ConversionReport``).

    The options are those of ``weightshare convert``, as keywords or as one ``ConvertOptions``; each is declared
    once, in ``ConvertOptions``.

    Args:
        src: an ONNX (.onnx), TFLite (.tflite) or Core ML (.mlpackage) model (the format is told from its
            content), or a list of models, globs or one model folder.
        out: output directory, created if missing.
        options: all options as one ``ConvertOptions``; then no keyword may be given.
        <keywords>

    Returns:
        What was written and moved (``ConversionReport.outputs``, byte counts, time, peak RSS); for a list of
        inputs, the batch's reports, the folder's or the zoo's report.

    Raises:
        InvalidModel: ``src`` is not a well-formed model.
        UnsafePath: a path in the model leads outside its directory.
        Unsupported: the model uses something weightshare does not handle.
        UsageError: contradicting options, an output onto the input, a folder given as one path (see
            ``convert_folder``).
        OutputError: writing failed (disk full, permissions); nothing was left behind.

    Example:
        >>> report = weightshare.convert("model.onnx", "out/", prepack=True)
        >>> report.outputs
        ['out/model.onnx', 'out/model.weights.1f2e3d4c5b6a.safetensors']
        >>> zoo = weightshare.convert(["a.onnx", "b.onnx"], "zoo/", shared_blob="shared")
    """
    opts = _settle(options, keywords)
    check_options(opts)
    if isinstance(src, (str, os.PathLike)):
        if opts.shared_blob is not None:
            raise UsageError("shared_blob makes a zoo: give the models as a list (or use convert_zoo)")
        return run_batch([Path(src)], Path(out), opts)[0]
    return run(plan(src, opts), Path(out), opts)


@_with_keywords("convert")
def convert_folder(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> FolderReport:
    """Convert a model folder (Hugging Face, optimum, onnxruntime-genai, ...) into ``out``, keeping its tree.

    Every model (``.onnx``, ``.tflite``, ``.mlpackage``) is converted at its relative path, ``onnx/`` and other
    subfolders included; every other file is copied unchanged (byte-identical, permission bits kept); the files a
    model references for its weights (``model.onnx_data``) are not copied: the model's blob replaces them. All of
    it is committed in one transaction: everything appears, or nothing.

    Args:
        src: the folder.
        out: output directory, created if missing; neither inside ``src`` nor containing it.
        options: all options as one ``ConvertOptions``; then no keyword may be given.
        <keywords>

    Returns:
        A ``FolderReport``: each model's ``ConversionReport`` and the copied files.

    Raises:
        UsageError: ``src`` is not a folder (or is a model package), holds no model, overlaps ``out``, or holds a
            FIFO or device; ``blob`` with several models.
        Unsupported: a symlink to a directory in ``src``; a model weightshare cannot convert.
        WeightshareError: any of ``convert``'s errors; nothing is written.

    Example:
        >>> report = weightshare.convert_folder("phi-3-mini-onnx/", "out/")
        >>> [m.model for m in report.models], report.copied[:2]
        (['phi-3-mini-onnx/model.onnx'], ['out/config.json', 'out/genai_config.json'])
    """
    opts = _settle(options, keywords)
    check_options(opts)
    if opts.shared_blob is not None:  # it would be ignored here: say where it applies
        raise UsageError(
            "shared_blob makes a zoo: use convert_zoo([folder], ...) or convert([folder], ...), which keep the "
            "folder's tree with one blob per directory of models"
        )
    from ._folder import run_folder

    return run_folder(Path(src), Path(out), opts)


@_with_keywords("convert")
def convert_many(
    models: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    **keywords: Unpack[ConvertKeywords],
) -> list[ConversionReport]:
    """Convert several models into ``out_dir`` in one transaction: every output is committed, or none.

    Refused before anything is written: two inputs whose outputs would have the same path,
    an output onto an input, and an output inside an input (.mlpackage).

    Args:
        models: model files or .mlpackage directories (each as ``convert``'s ``src``).
        out_dir: output directory, created if missing; every model is written into it by its file name.
        options: all options as one ``ConvertOptions``; then no keyword may be given.
        <keywords>

    Returns:
        One ``ConversionReport`` per model, in order.

    Raises:
        WeightshareError: any of ``convert``'s errors, for the first model that has one; nothing is written.

    Example:
        >>> reports = weightshare.convert_many(["a.onnx", "b.tflite"], "out/")
        >>> [r.outputs[0] for r in reports]
        ['out/a.onnx', 'out/b.tflite']
    """
    opts = _settle(options, keywords)
    check_options(opts)
    if opts.shared_blob is not None:
        raise UsageError("shared_blob makes a zoo: use convert_zoo (or convert with a list)")
    return run_batch([Path(m) for m in models], Path(out_dir), opts)


@_with_keywords("zoo")
def convert_zoo(
    models: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    shared_blob: str,
    options: ConvertOptions | None = None,
    **keywords: Unpack[ZooKeywords],
) -> ZooReport:
    """Convert many models into ``out_dir`` so that all of them reference one blob, ``shared_blob``.

    Each distinct payload (same bytes after unpacking) is stored once, in
    ``<shared_blob>.<digest12>.safetensors`` (``.safetensors`` stripped from the name first). The new blob
    and every model are committed in one transaction, each model by one rename: a reader opening
    a model sees the old one with the old blob or the new one with the new blob. Models of the
    previous zoo that are not in this one, and the old blob, go after the grace period if still as written
    (the removal rule, docs/reliability.md). One model folder given alone keeps its tree and side files, one blob
    in each directory holding models (ONNX Runtime reads external data only from the model's directory or below).

    Args:
        models: model files, folders (their models, not their subfolders) or globs; ONNX, or TFLite with
            ``external=True``; or one model folder alone (its tree kept).
        out_dir: the zoo directory: new, empty, or written by an earlier ``convert_zoo``.
        shared_blob: the blob's NAME (``--shared-blob``).
        options: all options as one ``ConvertOptions``; then no keyword may be given.
        <keywords>

    Returns:
        A ``ZooReport``: the blob, each model's report, and the totals that show the deduplication.

    Raises:
        UsageError: no models, ``out_dir`` not a zoo, an input inside ``out_dir``, ``blob``, a folder with
            models in subfolders among other inputs.
        WeightshareError: any of ``convert``'s errors; nothing is written.

    Example:
        >>> zoo = weightshare.convert_zoo(["a.onnx", "b.onnx"], "zoo/", "shared")
        >>> zoo.blob
        'zoo/shared.0a1b2c3d4e5f.safetensors'
    """
    opts = replace(_settle(options, keywords, "zoo"), shared_blob=shared_blob)
    check_options(opts)
    from ._zoo_api import run_zoo

    return run_zoo(_zoo_sources(models), Path(out_dir), opts)


def _zoo_sources(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """A zoo's models; one model folder given alone stays a folder (its tree is kept, ``run_family_folder``)."""
    from ._folder import is_model_folder

    if len(inputs) == 1 and is_model_folder(Path(inputs[0])):
        return [Path(inputs[0])]
    return expand_inputs(inputs)


def run_batch(sources: list[Path], out: Path, options: ConvertOptions) -> list[ConversionReport]:
    """Models into ``out`` in one transaction (``convert_many``, documented there), options checked."""
    if not sources:
        raise UsageError("no models to convert (none given, or a glob that matched nothing)")
    if options.blob_name is not None and len(sources) > 1:
        raise UsageError("--blob names one model's blob; with several models use --shared-blob or leave it out")
    check_outputs(sources, [out / s.name for s in sources])
    for s in sources:
        check_input(s)
        if s.is_dir() and s.suffix not in model_suffixes():
            raise UsageError("is a folder of models, not a model: convert it with convert_folder (tree kept)", s)
    # every later open of a source is checked against its identity now (a link: its target's)
    with _inputs.planned_inputs(_inputs.plan_inputs(sources), named=True):
        formats = [detect(s) for s in sources]
        check_outputs(*_every_output(sources, formats, out, options))  # companions too (--prepack: .portable.onnx)
        return _run_planned(sources, formats, out, options)


def _run_planned(
    sources: list[Path], formats: list[Format], out: Path, options: ConvertOptions
) -> list[ConversionReport]:
    start = time.perf_counter()
    reports = []
    notes: list[str] = []  # what the outputs record kept, and why
    with peak_window(), OutputTransaction() as tx:
        prepare_out_dir(out, tx)
        record = attach(tx, out, options.blob_grace_s, notes)
        for src, fmt in zip(sources, formats):
            t0 = time.perf_counter()
            staged = len(tx.finals())
            # opened once, checked against the plan; every read of it goes through that
            with _inputs.hold(src), stages_named(options, src.name, len(sources) > 1):
                reports.append(finish(convert_one(fmt, src, out, options, tx), t0))
            # one key per model: its companions (a --prepack twin) go when a later run of it no longer writes them
            record.add(run_key("model", [src]), tx.finals()[staged:], [src])
    reports[-1].notes += notes
    if len(reports) == 1:  # the commit is part of the one model's time
        finish(reports[0], start)
    return reports


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


@_with_keywords("merge")
def merge(
    sources: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    function_names: list[str] | None = None,
    default_function: str | None = None,
    options: ConvertOptions | None = None,
    **keywords: Unpack[MergeKeywords],
) -> ConversionReport:
    """Merge Core ML packages into one multifunction .mlpackage, storing each distinct weight once.

    Args:
        sources: Core ML .mlpackage directories (a multifunction source contributes all its functions).
        out: the output .mlpackage.
        function_names: a function name for each source, in order (default: each source's stem).
        default_function: the function run by default (default: the first).
        options: ``ConvertOptions``; only ``align`` and the progress callbacks apply; then no keyword may be given.
        <keywords>

    Returns:
        The ``ConversionReport`` of the merged package.

    Raises:
        InvalidModel: a source is not a well-formed Core ML package.
        UsageError: duplicate or unknown function names, an output onto or inside a source.
        OutputError: writing failed; nothing was left behind.

    Example:
        >>> weightshare.merge(["small.mlpackage", "large.mlpackage"], "both.mlpackage", ["small", "large"])
    """
    options = _settle(options, keywords, "merge")
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
    notes: list[str] = []
    with peak_window(), OutputTransaction() as tx:
        parent = prepare_out_dir(out.parent if str(out.parent) else Path("."), tx)
        # recorded in its directory like any output: a later merge replaces it, and only it, never a user's tree
        record = attach(tx, parent, options.blob_grace_s, notes)
        report: ConversionReport = merge_models(paths, list(function_names or []), default_function, out, options, tx)
        record.add(named_key("merge", out.name), tx.finals(), paths)
    report.notes += notes
    return finish(report, start)
