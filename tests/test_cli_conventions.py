"""CLI conventions: help rendered as written, `-h` everywhere, shell completion.

Before: nothing (help and completion need no model).
Under test: `weightshare ... --help` / `-h` and the completion protocol of the installed `weightshare` script.
After: the blob name reads NAME.<digest12>.safetensors, no flag shows a `<bool>` placeholder, every command takes
`-h`, and `--install-completion` / `--show-completion` exist and complete commands and options.
"""

from __future__ import annotations

import os
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
