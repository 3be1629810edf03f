"""What the commands print for a machine: `--format github` workflow annotations on every command, and the
refusals of out-of-range numbers, in one line.

Before: small models built in code (an ONNX MLP, its conversion, two Core ML packages), shared by the module.
Under test: `weightshare CMD ... --format github` run in-process (``cli._app.run``: the command line as ``main`` runs
it), and the entry point interrupted while it imports its commands (one child process).
After: every stdout line of a github run is a well-formed workflow command (``::error``/``::warning``/``::notice``,
properties escaped); a bad number is one `weightshare: error:` line and exit 2; Ctrl-C during start-up is one line
and exit 130, no traceback.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import coreml_fixtures as F
import pytest

from weightshare._samples import mlp_onnx
from weightshare.cli._commands import run

# GitHub Actions workflow commands: ::LEVEL[ key=value[,key=value...]]::message, with `%`, CR and LF escaped in the
# message and `:` and `,` too in property values.
_PROPERTY = r"(file|title|line|endLine|col|endColumn)=[^,:\r\n]*"
ANNOTATION = re.compile(rf"^::(error|warning|notice)( {_PROPERTY}(,{_PROPERTY})*)?::[^\r\n]+$")


def _run(args: list) -> int:
    return run([str(a) for a in args])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("github")
    a = mlp_onnx(d / "a.onnx", layers=1, dim=64)
    big = mlp_onnx(d / "big, with: comma.onnx", layers=1, dim=1024)  # 4 MiB embedded: findings; a hostile name
    return d, a, big


def _github(capsys, *args) -> tuple[int, list[str]]:
    code = _run([*map(str, args), "--format", "github"])
    lines = capsys.readouterr().out.splitlines()
    assert lines, args
    bad = [line for line in lines if not ANNOTATION.match(line)]
    assert not bad, bad
    return code, lines


@pytest.mark.covers("onnx", "convert", "inspect", "verify")
def test_every_command_prints_workflow_annotations(models, capsys, tmp_path):
    d, a, big = models
    code, lines = _github(capsys, "convert", a, big, "-o", tmp_path / "out")
    assert code == 0 and len(lines) == 2 and all(line.startswith("::notice file=") for line in lines)
    code, lines = _github(capsys, "inspect", big, "--no-measure")
    assert code == 0 and any(line.startswith("::error file=") for line in lines)
    assert "%2C with%3A comma.onnx" in lines[0]  # the path's `,` and `:` escaped: still one property
    code, lines = _github(capsys, "check", big, "--no-measure")
    assert code == 1 and lines[0].startswith("::error file=")
    code, lines = _github(capsys, "verify", a, tmp_path / "out" / a.name, "--runs", "1")
    assert code == 0 and lines[-1].startswith("::notice") and "ok: 1 runs" in lines[-1]
    first, second = (
        F.mlp(tmp_path / "x.mlpackage", seed=0, hidden=32),
        F.mlp(tmp_path / "y.mlpackage", seed=1, hidden=32),
    )
    code, lines = _github(capsys, "merge", first, second, "-o", tmp_path / "xy.mlpackage")
    assert code == 0 and lines[0].startswith("::notice")
    # a failure is an ::error annotation on stdout (the one line stays on stderr): bench and demo fail here early
    for args in (["bench", d / "missing.onnx"], ["demo", "--sessions", "0"], ["convert", d / "missing.onnx", "-o", d]):
        code, lines = _github(capsys, *args)
        assert code == 2 and len(lines) == 1 and lines[0].startswith("::error"), lines


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["verify", "a.onnx", "b.onnx", "--runs", "5000"], "'--runs': 5000 is not in the range 1<=x<=1000"),
        (["verify", "a.onnx", "b.onnx", "--runs", "0"], "'--runs': 0 is not in the range 1<=x<=1000"),
        (["inspect", "a.onnx", "--limit", "-5"], "'--limit': -5 is not in the range x>=0"),
        (["check", "a.onnx", "--inline-threshold", "-1"], "'--inline-threshold': must be a finite number >= 0"),
        (["convert", "a.onnx", "-o", "o", "--ort-child-timeout", "nan"], "'--ort-child-timeout': must be a finite"),
        (["check", "a.onnx", "--format", "yaml"], "--format takes text, json, github or sarif, got 'yaml'"),
    ],
)
def test_a_number_out_of_range_is_one_line_and_exit_2(capsys, args, message):
    assert run(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightshare: error: ") and message in lines[0], captured.err
    assert captured.out == ""


def test_ctrl_c_while_the_commands_are_imported_is_one_line_and_exit_130():
    """SIGINT arrives while `weightshare` imports typer (before the command's own handler exists)."""
    code = (
        "import os, signal, sys\n"
        # as in a terminal: a worker that inherited SIGINT ignored would hand that on to this child
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'typer':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "sys.argv = ['weightshare', '--version']\n"
        "from weightshare.cli import main\n"
        "main()\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 130, res.stderr
    assert res.stderr == "weightshare: error: interrupted; no output was left behind\n"


def test_finding_lines_carry_no_fix_and_each_code_fix_is_printed_once(models, capsys):
    d, a, big = models
    assert _run(["check", a, big, "--no-measure"]) == 1
    out = capsys.readouterr().out.splitlines()
    findings = [line for line in out if not line.startswith("fix: ")]
    fixes = [line for line in out if line.startswith("fix: ")]
    assert findings and all("(fix:" not in line for line in findings)
    codes = [line.removeprefix(f"{a}: ").removeprefix(f"{big}: ").split(": ")[1] for line in findings]
    # each code that occurs has one fix line, however many models' lines carry it
    assert sorted(line.split(": ")[1] for line in fixes) == sorted(set(codes))
    assert len(fixes) < len(findings)


def test_a_missing_path_is_no_such_file(models, capsys):
    d, a, _ = models
    missing = d / "missing.onnx"
    assert _run(["check", missing, a, "--no-measure", "-q"]) == 2  # the other model is still checked
    err = capsys.readouterr().err
    assert f"weightshare: error: no such file: {missing}\n" in err and "intact copy" not in err
    assert _run(["inspect", missing]) == 2
    assert capsys.readouterr().err == f"weightshare: error: no such file: {missing}\n"


@pytest.mark.covers("coreml", "inspect", "check")
def test_check_and_inspect_name_their_measuring_stage_on_stderr_only(tmp_path, capsys):
    """Not a terminal here: the stage line is shown with -v only, on stderr; stdout's JSON stays one document."""
    import json

    package = F.mlp(tmp_path / "m.mlpackage", seed=0, hidden=32)  # Core ML: no runtime child on Linux, cheap
    for command in ("inspect", "check"):
        assert _run([command, package, "--json"]) in (0, 1)
        quiet = capsys.readouterr()
        assert "measuring" not in quiet.err
        assert _run(["-v", command, package, "--json"]) in (0, 1)
        loud = capsys.readouterr()
        assert f"{command}: measuring" in loud.err and json.loads(loud.out)["command"] == command
    second = F.mlp(tmp_path / "n.mlpackage", seed=1, hidden=32)
    assert _run(["-v", "check", package, second, "--json"]) in (0, 1)
    lines = capsys.readouterr().err.splitlines()
    for i, model in enumerate((package, second), 1):  # each model named as its turn comes
        assert any(f"check: measuring {model} ({i}/2)" in line for line in lines), lines


@pytest.fixture(scope="module")
def three_formats(tmp_path_factory):
    """An fp16 ONNX MLP, a TFLite model with fp16 DEQUANTIZE, an XNNPACK ExecuTorch program (64-character names)."""
    import executorch_fixtures as E
    from tflite_fixtures import sample_model

    d = tmp_path_factory.mktemp("narrow")
    return [
        mlp_onnx(d / "fp16.onnx", layers=2, dim=128),
        sample_model(d / "s.tflite"),
        E.xnnpack_program(d / "x.pte", dim=64),
    ]


def _readable_at_80(text: str, model) -> None:
    from weightshare._check import findings_for
    from weightshare._dispatch import inventory

    lines = text.splitlines()
    assert lines and "…" not in text
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    # every note, name and finding is there whole: wrapped at spaces as full lines, never cut
    words = " ".join(text.split())
    inv = inventory(model, hash_payloads=True)
    for p in inv.payloads:
        assert p.name in words
    for note in inv.notes:
        assert " ".join(note.split()) in words
    for f in findings_for(inv):
        assert " ".join(f.message.split()) in words


@pytest.mark.covers("onnx", "inspect")
@pytest.mark.covers("tflite", "inspect")
@pytest.mark.covers("executorch", "inspect")
def test_inspect_fits_80_columns_in_a_pipe(three_formats, capsys, monkeypatch):
    """At 80 columns the payload table had 27 cells cut to `copie…`/`tiny.…` and notes one word per line."""
    monkeypatch.setenv("COLUMNS", "80")
    for model in three_formats:
        assert _run(["inspect", model, "--no-measure"]) == 0
        _readable_at_80(capsys.readouterr().out, model)


def test_inspect_fits_an_80_column_terminal(three_formats):
    from terminal import ESCAPES, run_in_terminal

    model = three_formats[0]
    code, shown = run_in_terminal(["inspect", str(model), "--no-measure"], {"NO_COLOR": "1"}, columns=80)
    assert code == 0, shown
    _readable_at_80(ESCAPES.sub("", shown), model)
    # wide enough, the table is back: one row per payload, each note once under it
    code, wide = run_in_terminal(["inspect", str(model), "--no-measure"], {"NO_COLOR": "1"}, columns=160)
    assert code == 0 and "┃ payload" in wide and "[1] Cast float16->float" in wide, wide
    assert max(len(line) for line in ESCAPES.sub("", wide).splitlines()) <= 160


def test_each_child_stage_is_named_with_a_clock_on_a_terminal(tmp_path):
    """`convert --prepack` showed a frozen `(child process): 0.00B [00:00, ?B/s]` for most of its run."""
    from terminal import ESCAPES, run_in_terminal

    src = mlp_onnx(tmp_path / "m.onnx", layers=2, dim=256, weights="float32")
    code, shown = run_in_terminal(["convert", str(src), "-o", str(tmp_path / "out"), "--prepack"], {}, columns=120)
    assert code == 0, shown
    frames = [ESCAPES.sub("", f).strip() for f in shown.split("\r")]
    assert any(
        re.fullmatch(r"m\.onnx: onnxruntime optimizes and packs the weights \(child process\) \[00:\d\d\]", f)
        for f in frames
    ), frames
    assert not any("0.00B [00:00, ?B/s]" in f for f in frames), frames  # the frozen byte count of a child phase
    assert not any(f.endswith(" ...") for f in frames)  # the lines are -v's


def test_the_stage_clock_counts_while_no_bytes_are_written(monkeypatch):
    import io
    import time

    from tqdm import tqdm

    from weightshare.cli._progress import _StageClock

    screen = io.StringIO()
    bar = tqdm(desc="m.onnx", bar_format="{desc}", file=screen)
    clock = _StageClock(bar)
    try:
        clock.name("m.onnx: onnxruntime optimizes (child process)")
        assert screen.getvalue().endswith("m.onnx: onnxruntime optimizes (child process) [00:00]")
        start = time.monotonic()
        monkeypatch.setattr(time, "monotonic", lambda: start + 65)  # what the ticking thread reads next
        waited = time.perf_counter()
        while "[01:05]" not in screen.getvalue() and time.perf_counter() - waited < 10:
            time.sleep(0.05)  # the clock redraws twice a second, on its own thread
        assert screen.getvalue().endswith("m.onnx: onnxruntime optimizes (child process) [01:05]")
        clock.bytes_follow()
        assert bar.bar_format is None  # the byte bar again
    finally:
        clock.close()
        bar.close()


@pytest.mark.parametrize("verbose", [False, True])
def test_stage_lines_with_v_only_on_stderr_and_json_stays_clean(tmp_path, capsys, verbose):
    """Not a terminal: nothing on stderr without -v; with -v one line per stage (each child process named, then
    the payloads written), stderr only, so stdout is still one JSON document."""
    from tflite_fixtures import sample_model

    onnx_model = mlp_onnx(tmp_path / "m.onnx", layers=2, dim=128, weights="float32")
    tflite_model = sample_model(tmp_path / "s.tflite")
    for model, child in (
        (onnx_model, "m.onnx: onnxruntime optimizes and packs the weights (child process) ..."),
        (tflite_model, "s.tflite: LiteRT builds the XNNPACK weight cache (child process) ..."),
    ):
        args = ["convert", model, "-o", tmp_path / f"out-{model.suffix[1:]}", "--prepack", "--json"]
        assert _run(["-v", *args] if verbose else args) == 0
        captured = capsys.readouterr()
        assert json.loads(captured.out)["command"] == "convert"
        if not verbose:
            assert captured.err == ""
            continue
        lines = captured.err.splitlines()
        assert child in lines, lines
        assert any(
            re.fullmatch(rf"{re.escape(model.name)}: writing [\d.]+ [KM]iB of payloads \.\.\.", x) for x in lines
        )
        assert all(x.startswith(f"{model.name}: ") and x.endswith(" ...") for x in lines), lines


def test_a_batch_names_the_model_each_child_stage_works_on(tmp_path, capsys):
    """A batch's stage lines were labelled with the run only (`2 models: onnxruntime optimizes ...`), which does not
    say which model the child is packing; a folder's name each model by its path in the folder."""
    a = mlp_onnx(tmp_path / "a.onnx", layers=2, dim=64, weights="float32")
    b = mlp_onnx(tmp_path / "b.onnx", layers=2, dim=96, weights="float32")
    assert _run(["-v", "convert", a, b, "-o", tmp_path / "out", "--prepack"]) == 0
    lines = capsys.readouterr().err.splitlines()
    for name in ("a.onnx", "b.onnx"):
        assert f"2 models: {name}: onnxruntime optimizes and packs the weights (child process) ..." in lines, lines
    folder = tmp_path / "repo"
    (folder / "onnx").mkdir(parents=True)
    for m in (a, b):
        (folder / "onnx" / m.name).write_bytes(m.read_bytes())
    assert _run(["-v", "convert", folder, "-o", tmp_path / "out-repo", "--prepack"]) == 0
    lines = capsys.readouterr().err.splitlines()
    packs = "onnx/b.onnx: onnxruntime optimizes and packs the weights (child process) ..."
    assert any(x.endswith(packs) for x in lines), lines


def test_bytes_with_no_total_announced_end_the_phase_clock(monkeypatch):
    """Core ML announces no total before writing: the first bytes switch the bar from `reading [mm:ss]` to them."""
    import io

    import tqdm

    from weightshare.cli._progress import progress_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    bars = []

    class Recorded(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setattr(tqdm, "tqdm", Recorded)
    with progress_bar(True, "c.mlpackage") as hooks:
        (bar,) = bars
        assert bar.bar_format == "{desc}" and bar.desc.startswith("c.mlpackage: reading [00:0")
        assert hooks.update is not None
        hooks.update(512 << 10)
        assert bar.bar_format is None and bar.desc == "c.mlpackage" and bar.n == 512 << 10
