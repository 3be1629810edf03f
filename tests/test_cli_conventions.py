"""CLI conventions: help rendered as written, `-h` everywhere, shell completion.

Before: nothing (help and completion need no model).
Under test: `weightshare ... --help` / `-h` and the completion protocol of the installed `weightshare` script.
After: the blob name reads NAME.<digest12>.safetensors, no flag shows a `<bool>` placeholder, every command takes
`-h`, and `--install-completion` / `--show-completion` exist and complete commands and options.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

COMMANDS = ["convert", "merge", "inspect", "check", "verify", "bench", "demo"]
WIDE = {"COLUMNS": "200", "NO_COLOR": "1"}


def test_convert_help_shows_the_blob_name_as_written(cli):
    res = cli("convert", "--help", env=WIDE)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("NAME.<digest12>.safetensors") == 2  # --blob and --shared-blob
    assert "NAME..safetensors" not in res.stdout


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_short_help_and_no_bool_placeholders(cli, command):
    args = [command] if command else []
    short, long = cli(*args, "-h", env=WIDE), cli(*args, "--help", env=WIDE)
    assert short.returncode == 0 and long.returncode == 0, short.stderr
    assert "Usage:" in short.stdout and short.stdout == long.stdout
    assert "<bool>" not in short.stdout


def test_shell_completion(cli):
    top = cli("--help", env=WIDE).stdout
    assert "--install-completion" in top and "--show-completion" in top
    script = Path(sys.executable).parent / "weightshare"  # the console script: completion is keyed by its name
    env = {**os.environ, "_WEIGHTSHARE_COMPLETE": "complete_bash"}
    done = subprocess.run(
        [str(script)], env={**env, "COMP_WORDS": "weightshare con", "COMP_CWORD": "1"}, capture_output=True, text=True
    )
    assert done.stdout.split() == ["convert"], done.stderr
    done = subprocess.run(
        [str(script)],
        env={**env, "COMP_WORDS": "weightshare convert --pre", "COMP_CWORD": "2"},
        capture_output=True,
        text=True,
    )
    assert done.stdout.split() == ["--prepack"], done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["convert", "--bogus"], "No such option: --bogus (Possible options: --blob)"),
        (["convert"], "Missing argument 'models'"),
        (["convert", "m.onnx", "-o", "out", "--align", "abc"], "Invalid value for '--align': 'abc' is not a valid int"),
        (["nosuch"], "No such command 'nosuch'"),
        (["check", "m.onnx", "--threshold"], "Option '--threshold' requires an argument"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_2(cli, tmp_path, args, message):
    """Typer draws usage errors as a 5-line box; the README promises one `weightshare: error:` line, exit 2."""
    res = cli(*args, cwd=tmp_path, env={"COLUMNS": "80"})
    assert res.returncode == 2 and res.stdout == ""
    command = "weightshare" if args[0] == "nosuch" else f"weightshare {args[0]}"
    assert res.stderr == f"weightshare: error: {message} (see '{command} -h')\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_fits_80_columns_with_examples(cli, command):
    """No help cell is cut with an ellipsis at 80 columns; every command shows how it is typically run."""
    args = [command] if command else []
    res = cli(*args, "--help", env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stdout
    assert max(len(line) for line in res.stdout.splitlines()) <= 80
    if command:
        examples = res.stdout.split("Examples:", 1)[1].split()
        assert examples.count("weightshare") >= 1 and command in examples


def test_commands_are_listed_in_workflow_order(cli):
    text = cli("--help", env=WIDE).stdout
    listed = [line.split()[1] for line in text.splitlines() if line.startswith("│ ") and line.split()[1] in COMMANDS]
    assert listed == COMMANDS


@pytest.mark.parametrize(
    "args",
    [
        ["--json", "inspect", "{m}", "--no-measure"],
        ["inspect", "{m}", "--no-measure", "--json"],
        ["--format", "json", "inspect", "{m}", "--no-measure"],
        ["--format=json", "-q", "inspect", "{m}", "--no-measure"],
        ["-v", "--json", "check", "{m}", "--no-measure"],
        ["check", "{m}", "--no-measure", "--format", "json", "-v"],
        ["--json", "convert", "{m}", "-o", "{out}"],
        ["-q", "--format", "json", "convert", "{m}", "-o", "{out}", "-v"],
    ],
)
def test_global_options_go_before_or_after_the_command(tmp_path, capsys, args):
    """`weightshare --json convert ...` was "No such option: --json", exit 2: -q, -v, --json and --format are
    accepted on either side of the command, and mean the same there."""
    import json

    from weightshare._samples import mlp_onnx
    from weightshare.cli._commands import run

    model = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=64)
    line = [a.format(m=model, out=tmp_path / "out") for a in args]
    code = run(line)
    captured = capsys.readouterr()
    assert code in (0, 1), captured.err
    document = json.loads(captured.out)
    assert document["command"] == next(a for a in line if a in COMMANDS)


def test_an_output_option_with_no_command_is_still_a_usage_error(capsys):
    from weightshare.cli._commands import run

    assert run(["--json"]) == 2
    assert "No such option: --json" in capsys.readouterr().err


def _flat(help_text: str) -> str:
    """The help's words in order, without the boxes rich draws (a name wrapped over two lines reads as one)."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", help_text).split())


@pytest.mark.parametrize("command", [None, "convert", "inspect", "check", "bench"])
def test_help_names_every_registered_format(cli, command):
    """The help texts named ONNX, TFLite and Core ML, written by hand beside the registry; ExecuTorch nowhere."""
    from weightshare.formats import registered

    text = _flat(cli(*([command] if command else []), "--help", env=WIDE).stdout)
    missing = [fmt.title for fmt in registered() if fmt.title not in text]
    assert missing == [], (command, text)
    if command in ("convert", "inspect", "bench"):  # the ones that take one model name its suffixes too
        assert all(s in text for fmt in registered() for s in fmt.suffixes), text


def test_check_target_lists_every_setting_id_it_accepts(cli):
    from weightshare._gate import setting_ids

    text = _flat(cli("check", "--help", env=WIDE).stdout)
    target = text.split("--target", 1)[1]
    assert len(setting_ids()) >= 10  # ONNX Runtime's, LiteRT's, Core ML's, ExecuTorch's and MediaPipe's settings
    assert [s for s in setting_ids() if s not in target] == []


REGISTERED_FIRST = """
import sys
import toyformat
from weightshare import formats
formats.register(toyformat.FORMAT)
from weightshare.cli._commands import main
sys.argv = ["weightshare", *sys.argv[1:]]
main()
"""


def test_a_format_registered_before_the_cli_loads_is_in_every_help(tmp_path):
    """A fifth format (here the tests' toy format) appears in the help by registering it, no help text edited."""
    for command in ([], ["convert"], ["inspect"], ["check"], ["bench"]):
        res = subprocess.run(
            [sys.executable, "-c", REGISTERED_FIRST, *command, "--help"],
            capture_output=True,
            text=True,
            env={**os.environ, **WIDE},
        )
        assert res.returncode == 0, res.stderr
        assert "Toy" in _flat(res.stdout), (command, res.stdout)
        if command in (["convert"], ["inspect"]):
            assert "Toy (.toymodel)" in _flat(res.stdout)
