"""The conversion commands: ``convert`` (one model, a batch, a model folder, a zoo) and ``merge``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import typer

from .. import api
from .._folder import is_model_folder
from .._placement import ALIGN_THRESHOLD, LARGE_ALIGN, AlignPolicy, Progress
from ..options import INLINE_THRESHOLD, ConvertOptions, Unpack
from ..report import ConversionReport, JsonDict
from ._app import app, fail, user_errors
from ._render import VERBOSITY, _mib, info, progress_bar, quiet, render_report, render_zoo


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
