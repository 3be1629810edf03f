"""The app with every command registered, in workflow order (what ``weightshare.cli`` loads on first use)."""

from __future__ import annotations

from typer.core import TyperCommand

from . import _bench, _convert, _inspect, _verify  # noqa: F401  (each registers its commands on ``app``)
from ._app import _Command, app, main, run

__all__ = ["app", "main", "run"]

# `weightshare --help` lists the commands in the order of the work: convert, then look, gate, verify, measure.
_WORKFLOW = ("convert", "merge", "inspect", "check", "verify", "bench", "demo")
app.registered_commands.sort(key=lambda info: _WORKFLOW.index(info.name or info.callback.__name__))  # type: ignore[union-attr]

for _info in app.registered_commands:  # every command renders its help like the group (see _Command)
    if _info.cls in (None, TyperCommand):
        _info.cls = _Command
