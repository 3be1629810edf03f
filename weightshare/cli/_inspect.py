"""The inspection commands: ``inspect`` (one model's payloads) and ``check`` (the CI gate)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ._app import (
    FORMAT_HELP,
    app,
    child_memory_option,
    dim_args,
    dim_option,
    examples,
    input_args,
    input_option,
    output_format,
    set_child_memory,
    user_errors,
)
from ._help import format_titles, model_kinds, setting_ids
from ._options import shared_option
from ._progress import measuring
from ._render import VERBOSITY, err, github, info, quiet, render_findings, render_inventory


@app.command(
    epilog=examples("weightshare inspect model.onnx", "weightshare inspect out/model.onnx --json"),
    help="Show every weight payload: where it lives, encoding, alignment, duplicates, per-session copies.\n\n"
    "Per-session copies are shown under each runtime setting of the model's format side by side "
    f"({setting_ids()}), followed by check's findings.",
)
def inspect(
    model: Path = typer.Argument(..., help=f"A model: {model_kinds()}."),
    as_json: bool = typer.Option(False, "--json", help="Print the inventory and findings as one JSON document."),
    no_hash: bool = typer.Option(False, "--no-hash", help="Skip hashing payloads (no duplicate or checksum info)."),
    limit: int = typer.Option(40, "--limit", min=0, help="Payload rows to show (largest first); 0 for all."),
    no_measure: bool = typer.Option(
        False, "--no-measure", help="Static per-session estimate only (do not ask the runtime, in child processes)."
    ),
    format_: str = typer.Option("text", "--format", help=FORMAT_HELP),
    child_memory: int | None = child_memory_option(),
) -> None:
    """``weightshare inspect`` (its help is built from the registered formats, above)."""
    from .._check import findings_for, inspected
    from .._contract import github_annotations, inspect_document

    how = output_format(as_json, format_)
    set_child_memory(child_memory)
    with user_errors(), measuring(not no_measure, f"inspect: measuring {model.name} in runtime child processes"):
        inv = inspected(model, hash_payloads=not no_hash, measure=not no_measure)  # check's cached verdict reused
        findings = findings_for(inv)
    if how == "json":
        print(json.dumps(inspect_document(inv, findings), indent=2))
    elif how == "github":
        github(github_annotations(findings))
    else:
        render_inventory(inv, findings, limit)


@app.command(
    epilog=examples(
        "weightshare check out/",
        "weightshare check out/model.onnx --target ort-disable-prepacking",
        "weightshare check models/ --json",
    )
)
def check(
    models: list[Path] = typer.Argument(
        ...,
        help=f"Models ({format_titles('or')}), directories (searched recursively for their suffixes) or globs.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the verdict and findings as one JSON document."),
    inline_threshold: int = shared_option(  # convert's --inline-threshold: its default and range
        "inline_threshold", help="Embedded payloads below this size are fine.", rich_help_panel=None
    ),
    strict: bool = typer.Option(
        False,
        "--strict",
        help="Fail on warnings too (copies that only a setting not targeted makes, 16-byte aligned inline "
        "TFLite buffers).",
    ),
    target: list[str] = typer.Option(
        [],
        "--target",
        help=f"Runtime setting the models will be loaded with: {setting_ids()}. Repeatable; a model whose format has "
        "none named is held to what its runtime does by default (ort-default, or genai_config.json's session "
        "options; litert-xnnpack; a --prepack output as weightshare's loader opens it).",
    ),
    threshold: int = typer.Option(
        1 << 20, "--threshold", min=0, help="Bytes per session a copy may cost before it is an error (default 1 MiB)."
    ),
    format_: str = typer.Option(
        "text",
        "--format",
        help="text, json (same as --json), github (workflow annotations) or sarif (SARIF 2.1.0, for code scanning).",
    ),
    no_measure: bool = typer.Option(
        False,
        "--no-measure",
        help="Use the static per-session estimate only (default for ONNX: ask onnxruntime, in child processes, "
        "what one more session costs under each setting).",
    ),
    no_cache: bool = typer.Option(
        False,
        "--no-cache",
        help="Measure every model again (default: a verdict measured earlier is reused while the model's content, "
        "the runtime's version, the CPU kind and these options are unchanged; kept in the user's cache directory).",
    ),
    dim: list[str] = dim_option("For the measuring runs: "),
    inputs: list[str] = input_option("For the measuring runs: "),
    runtime: str = typer.Option(
        "",
        "--runtime",
        help="The serving machine's runtime, VERSION[/CPU_KIND] (1.32.0/avx512): a --prepack output is judged for "
        "it (default: the onnxruntime and CPU kind of the machine running check).",
    ),
    instances: int = typer.Option(
        4, "--instances", min=1, help="What a user pays: this many instances in one process (default 4)."
    ),
    processes: int = typer.Option(
        2, "--processes", min=1, help="What a user pays: this many processes, one instance each (default 2)."
    ),
    quiet_: bool = typer.Option(False, "-q", "--quiet", help="Only the finding lines (no 'ok' line)."),
    child_memory: int | None = child_memory_option(),
) -> None:
    """CI gate: exit 0 when every model is share-ready, 1 with one line per finding otherwise.

    Errors (a copy above --threshold per session under a targeted setting, or a broken
    model) fail the gate; warnings (a copy only another setting makes, named in the fix)
    fail it only with --strict; info never. A file that cannot be read is one
    unreadable-model finding, the rest are still checked, and the exit code is 2.
    docs/ci.md lists every finding code and the JSON schema.
    """
    from .._check import Gate
    from .._contract import check_document, github_annotations, sarif_document, unreadable_lines
    from .._gate import run_gate
    from .._inventory import MeasureInputs

    quiet(quiet_)
    set_child_memory(child_memory)
    how = output_format(as_json, format_, ("text", "json", "github", "sarif"))
    with user_errors():
        feeds = MeasureInputs(tuple(dim_args(dim).items()), tuple(input_args(inputs).items()))
    gate = Gate(
        tuple(target),
        threshold,
        inline_threshold,
        measure=not no_measure,
        feeds=feeds,
        runtime=runtime,
        instances=instances,
        processes=processes,
        cache=not no_cache,
    )
    with user_errors(), measuring(not no_measure, "check: measuring each model in runtime child processes") as stage:
        result = run_gate(
            models, gate, strict, lambda path, i, n: stage(f"check: measuring {path} ({i}/{n}) in runtime children")
        )
    inventories, findings, code = result.inventories, result.findings, result.exit_code
    if how != "text":  # exit 2 says why on stderr in every format (text: render_findings, in finding order)
        for line in unreadable_lines(findings):
            err.print(f"weightshare: error: {line}", markup=False, highlight=False, soft_wrap=True)
    if how == "json":
        print(json.dumps(check_document(inventories, findings, gate, strict), indent=2))
    elif how == "sarif":
        print(json.dumps(sarif_document(findings), indent=2))
    elif how == "github":
        github(github_annotations(findings))
    else:
        render_findings(findings)
        for inv in inventories:
            for note in inv.measure_notes:  # how the figures were made: on stderr, silenced by -q
                if VERBOSITY["level"] >= 0:
                    err.print(f"note: {inv.model}: {note}", markup=False, highlight=False, soft_wrap=True)
        if code == 0:
            shown = f" ({len(findings)} warnings/info)" if findings else ""
            info(f"ok: {len(inventories)} model(s) share-ready{shown}")
    raise typer.Exit(code)
