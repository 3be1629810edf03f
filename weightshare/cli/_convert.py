"""The conversion commands: ``convert`` (one model, a batch, a model folder, a zoo) and ``merge``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from .. import api
from ._app import FORMAT_HELP, app, examples, output_format, user_errors
from ._help import model_kinds
from ._options import with_options
from ._progress import progress_bar
from ._render import github_conversion, quiet, render_conversion, render_report

_MODELS = typer.Argument(
    ...,
    help=f"{model_kinds()} models, or one model folder: its tree is reproduced in OUTDIR, models converted, "
    "every other file copied.",
)

_OUTPUT = typer.Option(..., "-o", "--output", help="Output directory (created if missing).")

_AS_JSON = typer.Option(False, "--json", help="Print the conversion report as one JSON document.")

_QUIET = typer.Option(False, "-q", "--quiet", help="No progress bar, no report: errors only.")


@app.command(
    epilog=examples(
        "weightshare convert model.onnx -o out/",
        "weightshare convert model.onnx -o out/ --prepack",
        "weightshare convert models/ -o out/ --shared-blob zoo",
    )
)
@with_options("convert")  # one parameter per ConvertOptions field with a flag (options.Opt), in its panel
def convert(
    models: list[Path] = _MODELS,
    output: Path = _OUTPUT,
    as_json: bool = _AS_JSON,
    format_: str = typer.Option("text", "--format", help=FORMAT_HELP),
    quiet_: bool = _QUIET,
    **keywords: Any,
) -> None:
    """Rewrite MODEL(s) into OUTDIR with every weight in a page-aligned, memory-mappable blob.

    Unpacks fp16 weights that the runtime would otherwise convert per session
    (ONNX Cast to float, TFLite DEQUANTIZE) and stores identical payloads once.
    Outputs appear all together or not at all.
    """
    how = output_format(as_json, format_)
    quiet_ = quiet(quiet_)
    desc = "zoo" if keywords.get("shared_blob") else _desc(models)
    with user_errors(), progress_bar(not quiet_ and how == "text", desc) as hooks:
        result = api.convert(  # as any user of the API would
            models, output, **keywords, progress=hooks.update, progress_total=hooks.total, stage=hooks.stage
        )
    if how == "github":
        github_conversion(result, output)
    else:
        render_conversion(result, output, how == "json")


def _desc(models: list[Path]) -> str:
    return models[0].name if len(models) == 1 else f"{len(models)} models"


@app.command(epilog=examples("weightshare merge a.mlpackage b.mlpackage --name f_a --name f_b -o mf.mlpackage"))
@with_options("merge")
def merge(
    sources: list[Path] = typer.Argument(
        ..., help="Core ML .mlpackage files (multifunction sources contribute all their functions)."
    ),
    output: Path = typer.Option(..., "-o", "--output", help="Output .mlpackage."),
    function_name: list[str] = typer.Option(
        [], "--function-name", "--name", help="Function name for each source, in order [default: the source's stem]."
    ),
    default_function: str | None = typer.Option(
        None, "--default-function", help="Function run by default [default: the first]."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON document."),
    format_: str = typer.Option("text", "--format", help=FORMAT_HELP),
    quiet_: bool = typer.Option(False, "-q", "--quiet", help="No progress bar, no report: errors only."),
    **keywords: Any,
) -> None:
    """Merge Core ML models into one multifunction .mlpackage, storing each distinct weight once.

    Streams weight data chunk by chunk: memory does not grow with the number of functions.
    """
    how = output_format(as_json, format_)
    quiet_ = quiet(quiet_)
    with user_errors(), progress_bar(not quiet_ and how == "text", output.name) as hooks:
        report = api.merge(
            sources,
            output,
            function_name,
            default_function,
            **keywords,
            progress=hooks.update,
            progress_total=hooks.total,
        )
    if how == "json":
        from .._contract import document

        print(json.dumps(document("merge", 0, [report.to_dict()]), indent=2))
    elif how == "github":
        github_conversion([report], output)
    elif not quiet_:
        render_report(report)
