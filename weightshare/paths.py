"""Path containment for names that come from model files or from users.

ONNX Runtime and onnx refuse external data outside the model directory
(onnx external_data_helper and ORT's ValidateExternalDataPath); so do we, and
before anything is opened: a hostile ``location`` such as ``/etc/shadow`` or
``../../secret`` must not even be stat-ed as a payload source.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import UnsafePath


def resolve_inside(base_dir: Path, name: str, what: str, origin: str | os.PathLike | None = None) -> Path:
    """Return ``base_dir/name`` after checking it cannot leave ``base_dir``.

    Refused: empty names, absolute paths (POSIX or Windows, drive letters, UNC),
    any ``..`` component, NUL bytes, and names that resolve (through symlinks)
    outside ``base_dir``. ``origin`` is the file the name was read from, for the message.
    """
    where = origin if origin is not None else base_dir
    if not name or "\x00" in name:
        raise UnsafePath(f"{what} has an empty or invalid path {name!r}", where)
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or name.startswith(("/", "\\")):
        raise UnsafePath(f"{what} path {name!r} is absolute; it must be relative to the model directory", where)
    if ".." in posix.parts or ".." in windows.parts:
        raise UnsafePath(f"{what} path {name!r} contains '..'; it must stay inside the model directory", where)
    base = Path(base_dir).resolve()
    target = (base / name).resolve()
    if target != base and base not in target.parents:
        raise UnsafePath(f"{what} path {name!r} resolves outside the model directory (symlink?)", where)
    return target
