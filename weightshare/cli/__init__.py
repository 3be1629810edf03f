"""The `weightshare` command: a thin Typer layer over ``weightshare.api``.

``_app``: the app, its global options and the exit mapping (0 ok, 1 a check or verify found a problem, 2 bad
input or usage); ``_render``: every table and line printed; ``_progress``: what stderr shows while work runs;
``_options``: the conversion options' parameters, derived from ``ConvertOptions``; ``_help``: the help texts that
name formats and settings, built from the registry; one module per command group: ``_convert`` (convert, merge),
``_inspect`` (inspect, check), ``_verify`` (verify), ``_bench`` (bench, demo); ``_commands`` registers them.

This module imports nothing heavy: the entry point ``main`` loads the app (typer, rich, every command) inside its
own Ctrl-C handling, so an interrupt during those imports is one line and exit 130, not a traceback.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._commands import app

__all__ = ["app", "main"]


def main() -> None:
    """``weightshare``'s entry point."""
    try:
        from ._commands import main as run
    except KeyboardInterrupt:  # Ctrl-C while the commands are imported, before run() has its own handling
        sys.stderr.write("weightshare: error: interrupted; no output was left behind\n")
        sys.exit(130)
    run()


def __getattr__(name: str) -> Any:
    if name == "app":
        from ._commands import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
