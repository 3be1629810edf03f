"""Errors a user can act on.

Every failure caused by the input (a corrupt file, a hostile path, an unsupported
construct) is raised as a ``WeightshareError`` subclass whose message is one line
naming the file and the problem. The CLI turns these into exit code 2; anything
else reaching the CLI is a bug in weightshare.
"""

from __future__ import annotations

import os

__all__ = ["InvalidModel", "OutputError", "UnsafePath", "Unsupported", "UsageError", "WeightshareError"]


class WeightshareError(Exception):
    """Base class. ``path`` names the file the problem is in (may be None)."""

    kind = "error"

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None):
        self.path = os.fspath(path) if path is not None else None
        self.message = " ".join(str(message).split())  # always one line
        super().__init__(self.line())

    def line(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class InvalidModel(WeightshareError):
    """The file is not a well-formed model of its format (truncated, lying lengths, ...)."""

    kind = "invalid-model"


class UnsafePath(WeightshareError):
    """A path in or for a model points outside the directory it must stay in."""

    kind = "unsafe-path"


class Unsupported(WeightshareError):
    """A valid model uses something weightshare does not handle (yet)."""

    kind = "unsupported"


class UsageError(WeightshareError):
    """Options that contradict each other or name impossible outputs."""

    kind = "usage"


class OutputError(WeightshareError):
    """Writing the output failed (disk full, permissions); nothing was left behind."""

    kind = "output"
