"""The ``verify`` command: both models run in the real runtime on the same inputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from ..errors import WeightshareError
from ._app import (
    FORMAT_HELP,
    _pairs,
    app,
    child_memory_option,
    dim_args,
    dim_option,
    examples,
    fail,
    input_args,
    input_option,
    output_format,
    set_child_memory,
    user_errors,
)
from ._render import github, info, quiet

# Each run is a full inference of both models in every runtime leg; beyond this a typo (--runs 30000) would run
# for hours rather than check more.
MAX_RUNS = 1000


def _quiet_runtime_exit(model: Path) -> None:
    """After verify's result: a format whose runtime logs its teardown at exit silences it (``quiet_exit``)."""
    from ..formats import detect
    from ..formats.base import QuietExit

    try:
        fmt = detect(model)
    except WeightshareError:
        return
    if isinstance(fmt, QuietExit):
        sys.stdout.flush()
        fmt.quiet_exit()


def _verify_args(
    dim: list[str], shape: list[str], inputs: list[str]
) -> tuple[dict[str, int], dict[str, list[int]], dict[str, Any]]:
    from .._dispatch import load_input

    dims = dim_args(dim)
    shapes: dict[str, list[int]] = {}
    for name, value in _pairs(shape, "--shape", "D0,D1,..."):
        parts = [p.strip() for p in value.split(",")]
        if not all(p.isdigit() for p in parts):
            fail(f"--shape takes NAME=D0,D1,... with non-negative integers, got {name}={value!r}")
        shapes[name] = [int(p) for p in parts]
    given = {name: load_input(name, value) for name, value in input_args(inputs).items()}
    return dims, shapes, given


@app.command(
    epilog=examples(
        "weightshare verify model.onnx out/model.onnx", "weightshare verify model.onnx out/model.onnx --dim batch=8"
    )
)
def verify(
    original: Path = typer.Argument(..., help="The model before conversion."),
    converted: Path = typer.Argument(..., help="The converted model."),
    runs: int = typer.Option(3, "--runs", min=1, max=MAX_RUNS, help="Runs with different seeded random inputs."),
    dim: list[str] = dim_option(),
    shape: list[str] = typer.Option(
        [], "--shape", help="TFLite: full shape of an input with dynamic dims, NAME=1,16000. Repeatable."
    ),
    inputs: list[str] = input_option(),
    seed: int = typer.Option(0, "--seed", help="Seed of the random inputs of the first run."),
    decode_steps: int = typer.Option(
        0,
        "--decode-steps",
        min=0,
        help="ONNX decoders: a prefill step, then N steps feeding each present* output back as its past* input; "
        "TFLite LMs: the prefill signature, then N runs of the decode signature fed its KV cache outputs.",
    ),
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Exit 1 when a planned run did not run (a partial comparison), not only on a difference.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the verify report as one JSON document."),
    format_: str = typer.Option("text", "--format", help=FORMAT_HELP),
    quiet_: bool = typer.Option(False, "-q", "--quiet", help="Only the FAIL lines."),
    child_memory: int | None = child_memory_option(),
) -> None:
    """Run both models in the real runtime on the same inputs: pass only if outputs are byte-identical.

    Compares output names, count and order, then each output's dtype, shape and raw
    bytes (sequences, maps and optionals element by element). ONNX Runtime CPU at
    default options; LiteRT without delegate and with XNNPACK (every signature), or
    CompiledModel for ExternalBuffer models. Every blob payload is re-hashed against its
    recorded checksum and the blob's name against its header; ONNX: every payload is compared byte
    for byte with the original's, and a --prepack output's portable model is run too. Core ML (no
    runtime on Linux): weights must decode to the same bytes and the programs must match op for op.
    A run verify planned but could not make (the original refuses the sizes it chose, or the run is over its
    memory budget) makes the verdict "ok (partial: 2 of 3 runs; ...)", saying why; --strict makes it exit 1.
    Exit 1 on a difference, 2 when the original itself does not run.
    """
    from .._dispatch import verify as run_verify

    how = output_format(as_json, format_)
    quiet(quiet_)
    set_child_memory(child_memory)
    reported = False  # an unexpected exception is reported by main(): stderr must stay open for it
    try:
        with user_errors():
            dims, shapes, given = _verify_args(dim, shape, inputs)
            report = run_verify(original, converted, runs, dims, seed, given, shapes, decode_steps)
        reported = True
    except typer.Exit:
        reported = True
        raise
    finally:  # after the one error line, if any: LiteRT logs its teardown at exit
        if reported:
            _quiet_runtime_exit(original)
    if how == "json":
        from .._contract import verify_document

        print(json.dumps(verify_document(report, strict), indent=2))
    elif how == "github":
        from .._contract import annotation

        title = "weightshare verify"
        lines = [annotation("error", m, str(converted), title) for m in report.checksum_mismatches + report.mismatches]
        lines += [annotation("notice", note, str(converted), title) for note in report.notes]
        level = "error" if report.exit_code(strict) else "warning" if report.partial else "notice"
        lines.append(
            annotation(
                level,
                f"{report.verdict(strict)}: {report.runs} runs, {report.outputs_compared} outputs compared",
                str(converted),
                title,
            )
        )
        github(lines)
    else:
        for line in report.checksum_mismatches + report.mismatches:
            print(f"FAIL: {line}")
        for note in report.notes:
            info(f"note: {note}")
        verdict = report.verdict(strict)
        ran = f" ({'; '.join(report.paths)})" if report.paths else ""
        steps = f", prefill + {report.decode_steps} decode steps" if decode_steps else ""
        # payloads are compared with the original's only where the format's verify does it (ONNX): a 0 there
        # would read as "nothing was compared" next to the outputs that were
        compared = f", {report.payloads_compared} compared with the original" if report.payloads_compared else ""
        info(
            f"{verdict}: {report.runs} runs{steps}{ran}, {report.outputs_compared} outputs compared, "
            f"{report.payloads_hashed} blob payloads re-hashed{compared}"
        )
    raise typer.Exit(report.exit_code(strict))
