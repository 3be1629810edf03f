"""The measuring commands: ``bench`` (PSS of N sessions) and ``demo``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from ._app import FORMAT_HELP, _pairs, app, examples, fail, output_format, user_errors
from ._help import model_kinds
from ._progress import stages
from ._render import github, info, render_bench, render_demo, size


@app.command(
    epilog=examples("weightshare bench model.onnx --sessions 1,2,4,8", "weightshare bench model.onnx --plot mem.png")
)
def bench(
    model: Path = typer.Argument(
        ...,
        help=f"A model: {model_kinds()}, whose runtime runs on this machine (it is converted into a temporary "
        "directory).",
    ),
    sessions: str = typer.Option("1,2,4,8", "--sessions", help="Session counts to measure, comma separated."),
    plot_path: Path | None = typer.Option(
        None, "--plot", help='Write a PNG chart of PSS vs sessions (needs matplotlib: pip install "weightshare[plot]").'
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the measurements as one JSON document."),
    inputs: list[str] = typer.Option(
        [], "--input", help="TFLite: real values for an input, NAME=FILE.npy, instead of random ones. Repeatable."
    ),
    format_: str = typer.Option("text", "--format", help=FORMAT_HELP),
) -> None:
    """Memory (PSS) of 1..N sessions of the original and the converted model, side by side.

    Each model and runtime setting its format measures runs in a fresh process (ONNX Runtime
    with and without session.disable_prepacking, plus the `convert --prepack` result at
    default options; LiteRT without delegate and with the default XNNPACK one; ExecuTorch's
    runtime and weightshare's loader).
    """
    from .._bench import bench as run_bench
    from .._bench import plot

    how = output_format(as_json, format_)
    as_json = how != "text"  # no spinner under machine output
    with user_errors():
        try:
            counts = sorted({int(x) for x in sessions.split(",") if x.strip()})
        except ValueError:
            fail(f"--sessions takes comma-separated integers, got {sessions!r}")
        if plot_path is not None:
            plot_path = plot_path.resolve()
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                fail('--plot needs matplotlib: pip install "weightshare[plot]"')
        given = dict(_pairs(inputs, "--input", "FILE.npy"))
        with stages(live=not as_json) as stage:
            result = run_bench(model, counts, progress=stage, inputs=given)
        if plot_path is not None:
            plot(result, plot_path)
            result["plot"] = str(plot_path)
    if how == "json":
        from .._contract import document

        print(json.dumps(document("bench", 0, [result]), indent=2))
    elif how == "github":
        github(bench_notices(result))
    else:
        render_bench(result, plot_path)


def bench_notices(result: dict[str, Any]) -> list[str]:
    """One notice per variant and setting: PSS of the most sessions against one session."""
    from .._contract import annotation

    groups: dict[tuple[str, str], list[float]] = {}
    for r in result["rows"]:
        groups.setdefault((r["variant"], r["mode"]), []).append(r["pss_mib"])
    return [
        annotation(
            "notice",
            f"{variant} {mode}: {pss[-1]:.1f} MiB PSS after {result['sessions'][-1]} sessions, "
            f"{pss[-1] / pss[0]:.2f}x one session",
            str(result["model"]),
            "weightshare bench",
        )
        for (variant, mode), pss in groups.items()
    ]


@app.command(epilog=examples("weightshare demo", "weightshare demo --clean"))
def demo(
    workdir: Path = typer.Option(
        Path("weightshare-demo"),
        "--dir",
        help="Where to put the sample models (56 MiB per layer: ~675 MiB with the default 12 layers).",
    ),
    sessions: int = typer.Option(4, "--sessions", min=1, help="ONNX Runtime sessions to open per variant."),
    layers: int = typer.Option(12, "--layers", min=1, help="MLP layers of 2048x2048 fp16 weights (8 MiB each)."),
    clean: bool = typer.Option(False, "--clean", help="Remove the demo directory (--dir) and exit."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as one JSON document."),
    format_: str = typer.Option("text", "--format", help=FORMAT_HELP),
) -> None:
    """Build a sample fp16 ONNX model, convert it, and show the memory of N sessions before and after."""
    from .._demo import clean_demo, run_demo

    how = output_format(as_json, format_)
    as_json = how != "text"
    with user_errors():
        if clean:
            removed, kept = clean_demo(workdir)
            where = workdir.resolve()
            info(
                f"removed {where}"
                if not workdir.exists()
                else f"removed the demo's files in {where}"
                if removed
                else f"nothing the demo wrote to remove at {where}"
            )
            for note in kept:
                info(note)
            return
        # the fp16 original, the fp32 blob, and the --prepack blob (fp32 payloads plus ORT's packed copies)
        nbytes = layers * (2048 * 2048 + 2048) * (2 + 4 + 8)
        if not as_json:
            info(
                f"writing about {size(nbytes)} to {workdir.resolve()} (remove it with: weightshare demo --clean"
                f"{'' if workdir == Path('weightshare-demo') else f' --dir {workdir}'})"
            )
        with stages(live=not as_json) as stage:
            result = run_demo(workdir, sessions, layers, progress=stage)
    if how == "json":
        from .._contract import document

        print(json.dumps(document("demo", 0, [{"model": result["report"]["model"], **result}]), indent=2))
    elif how == "github":
        github(demo_notices(result, sessions))
    else:
        render_demo(result, sessions)


def demo_notices(result: dict[str, Any], sessions: int) -> list[str]:
    """``demo --format github``: one notice with the ratios."""
    from .._contract import annotation

    message = (
        f"{sessions} sessions: original {result['ratio_original']:.2f}x one session, converted "
        f"{result['ratio_converted']:.2f}x; outputs equal: {result['outputs_equal']}"
    )
    return [annotation("notice", message, str(result["converted"]), "weightshare demo")]
