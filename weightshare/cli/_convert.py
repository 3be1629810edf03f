"""The conversion commands: ``convert`` (one model, a batch, a model folder, a zoo) and ``merge``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from .. import api
from .._convert_api import convert_inputs
from .._format_options import unpack_help
from .._placement import ALIGN_THRESHOLD, LARGE_ALIGN, AlignPolicy
from ..formats import registered
from ..options import INLINE_THRESHOLD, ConvertOptions
from ._app import app, examples, user_errors
from ._render import progress_bar, quiet, render_conversion, render_report

_MODELS = typer.Argument(
    ...,
    help="ONNX (.onnx), TFLite (.tflite) or Core ML (.mlpackage) models, or one model folder: its tree is "
    "reproduced in OUTDIR, models converted, every other file copied.",
)

_OUTPUT = typer.Option(..., "-o", "--output", help="Output directory (created if missing).")

_BLOB = typer.Option(
    None,
    "--blob",
    help="Blob name inside OUTDIR: the blob is written as "
    "`NAME.<digest12>.safetensors`, digest of its content (default NAME: "
    "MODEL.weights).",
    rich_help_panel="Blob layout",
)

_BLOB_GRACE = typer.Option(
    600.0,
    "--blob-grace",
    help="Seconds an earlier blob that no model in "
    "OUTDIR references any more, or an output of an earlier run of the same inputs that this run no longer writes "
    "(a portable twin, a model gone from the folder), is kept, for readers that opened the old model.",
    rich_help_panel="Blob layout",
)

_KEEP_PACKED = typer.Option(
    False,
    "--keep-packed",
    help="Do not unpack: keep fp16 + Cast/DEQUANTIZE and typed protobuf fields as they are.",
    rich_help_panel="Unpacking",
)

_, _UNPACK_HELP = unpack_help(registered())  # what the formats declare (Format.options)
# The metavar names the option's kind; the values and what each does are in the help text (a metavar of every
# value widened the option column until help cells were cut at 80 columns).
_UNPACK = typer.Option([], "--unpack", metavar="<value>", help=_UNPACK_HELP, rich_help_panel="Unpacking")

_EXTERNAL = typer.Option(
    False,
    "--external",
    help="TFLite: write weights to a safetensors blob referenced "
    "by ExternalBuffer groups. Only LiteRT CompiledModel loads these, the classic "
    "Interpreter does not.",
    rich_help_panel="Runtime",
)

_PREPACK = typer.Option(
    False,
    "--prepack",
    help="Share the runtime's packed weights too. ONNX: store "
    "ONNX Runtime's pre-packed MatMul/Gemm weights and NCHWc Conv weights (this CPU, "
    "this onnxruntime) in the blob, so plain default-option sessions share every byte; "
    "MODEL.portable.onnx is written as well for other CPUs (use weightshare.ort.session)."
    " Needs onnxruntime. TFLite: also write the XNNPACK weight cache of the converted "
    "model (its name carries a digest of the model, its blob and the LiteRT version); "
    "load with weightshare.litert.compiled_model.",
    rich_help_panel="Runtime",
)

_ALIGN = typer.Option(
    LARGE_ALIGN, "--align", help="Alignment of payloads >= --align-threshold (bytes).", rich_help_panel="Blob layout"
)

_ALIGN_THRESHOLD = typer.Option(
    ALIGN_THRESHOLD,
    "--align-threshold",
    help="Payload size from which --align applies; smaller payloads are 64-byte aligned.",
    rich_help_panel="Blob layout",
)

_INLINE_THRESHOLD = typer.Option(
    INLINE_THRESHOLD,
    "--inline-threshold",
    help="Payloads smaller than this stay inside the model file.",
    rich_help_panel="Blob layout",
)

_SHARED_BLOB = typer.Option(
    None,
    "--shared-blob",
    help="Zoo mode: every model in OUTDIR "
    "references this one blob (`NAME.<digest12>.safetensors`); identical "
    "payloads are stored once. Models are swapped in one by one, each "
    "with its blob. TFLite models join with --external.",
    rich_help_panel="Blob layout",
)

_ORT_CHILD_TIMEOUT = typer.Option(
    None,
    "--ort-child-timeout",
    help="Seconds the onnxruntime child of --prepack / --unpack ort-cpu may run (CPU time follows); "
    "default: 30 plus 600 per GiB of model.",
    rich_help_panel="ONNX Runtime child",
)

_ORT_CHILD_MEMORY = typer.Option(
    None,
    "--ort-child-memory",
    help="Address space (MiB) of that child; default: 4096 plus 8x the model.",
    rich_help_panel="ONNX Runtime child",
)

_ORT_MAX_GROWTH = typer.Option(
    None,
    "--ort-max-growth",
    help="What that child may write (optimized and packed copies) as a multiple of the model's size; "
    "default 4 (at least 16 MiB).",
    rich_help_panel="ONNX Runtime child",
)

_AS_JSON = typer.Option(False, "--json", help="Print the conversion report as one JSON document.")

_QUIET = typer.Option(False, "-q", "--quiet", help="No progress bar, no report: errors only.")


@app.command(
    epilog=examples(
        "weightshare convert model.onnx -o out/",
        "weightshare convert model.onnx -o out/ --prepack",
        "weightshare convert models/ -o out/ --shared-blob zoo",
    )
)
def convert(
    models: list[Path] = _MODELS,
    output: Path = _OUTPUT,
    blob: str | None = _BLOB,
    blob_grace: float = _BLOB_GRACE,
    keep_packed: bool = _KEEP_PACKED,
    unpack: list[str] = _UNPACK,
    external: bool = _EXTERNAL,
    prepack: bool = _PREPACK,
    align: int = _ALIGN,
    align_threshold: int = _ALIGN_THRESHOLD,
    inline_threshold: int = _INLINE_THRESHOLD,
    shared_blob: str | None = _SHARED_BLOB,
    ort_child_timeout: float | None = _ORT_CHILD_TIMEOUT,
    ort_child_memory: int | None = _ORT_CHILD_MEMORY,
    ort_max_growth: float | None = _ORT_MAX_GROWTH,
    as_json: bool = _AS_JSON,
    quiet_: bool = _QUIET,
) -> None:
    """Rewrite MODEL(s) into OUTDIR with every weight in a page-aligned, memory-mappable blob.

    Unpacks fp16 weights that the runtime would otherwise convert per session
    (ONNX Cast to float, TFLite DEQUANTIZE) and stores identical payloads once.
    Outputs appear all together or not at all.
    """
    quiet_ = quiet(quiet_)
    with user_errors(), progress_bar(not quiet_, "zoo" if shared_blob else _desc(models)) as hooks:
        options = ConvertOptions(
            align=AlignPolicy(large=align, threshold=align_threshold),
            inline_threshold=inline_threshold,
            keep_packed=keep_packed,
            unpack=frozenset(unpack),
            blob_name=blob,
            external=external,
            prepack=prepack,
            progress=hooks.update,
            progress_total=hooks.total,
            stage=hooks.stage,
            blob_grace_s=blob_grace,
            ort_child_timeout_s=ort_child_timeout,
            ort_child_memory_mib=ort_child_memory,
            ort_max_growth=ort_max_growth,
        )
        result = convert_inputs(models, output, options, shared_blob)
    render_conversion(result, output, as_json)


def _desc(models: list[Path]) -> str:
    return models[0].name if len(models) == 1 else f"{len(models)} models"


@app.command(epilog=examples("weightshare merge a.mlpackage b.mlpackage --name f_a --name f_b -o mf.mlpackage"))
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
    with user_errors(), progress_bar(not quiet_, output.name) as hooks:
        opts = ConvertOptions(
            align=AlignPolicy(large=align, threshold=align_threshold),
            progress=hooks.update,
            progress_total=hooks.total,
        )
        report = api.merge(sources, output, function_name, default_function, opts)
    if as_json:
        from .._contract import envelope

        print(json.dumps(envelope("merge", 0, reports=[report.to_dict()]), indent=2))
    elif not quiet_:
        render_report(report)
