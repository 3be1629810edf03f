"""Path containment for names that come from model files or from users.

ONNX Runtime and onnx refuse external data outside the model directory
(onnx external_data_helper and ORT's ValidateExternalDataPath); so do we, and
before anything is opened: a hostile ``location`` such as ``/etc/shadow`` or
``../../secret`` must not even be stat-ed as a payload source.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import UnsafePath, UsageError


def model_dir(model: str | os.PathLike[str]) -> Path:
    """The directory a runtime resolves a model's relative names against: the parent of the path it was given,
    made absolute, NOT the parent of a symlink's target (ONNX Runtime opens ``dirname(given)/location``; a
    symlinked model whose target has a file of the same name beside it must not be read with that file's bytes)."""
    return Path(model).absolute().parent


def external_data_roots(model: str | os.PathLike[str]) -> tuple[Path, ...]:
    """Where ONNX Runtime (1.32, ``ValidateExternalDataPath``) lets a model's external data resolve to: inside the
    model's directory (resolved), or inside the directory of the model file's own real path. The second is the
    Hugging Face hub cache: ``snapshots/REV/model.onnx -> ../../blobs/A`` and ``model.onnx_data -> ../../blobs/B``
    (both physical files side by side in ``blobs/``)."""
    roots = [model_dir(model).resolve()]
    real = Path(model).resolve().parent
    if real not in roots:
        roots.append(real)
    return tuple(roots)


def resolve_inside(
    base_dir: Path,
    name: str,
    what: str,
    origin: str | os.PathLike[str] | None = None,
    roots: tuple[Path, ...] | None = None,
) -> Path:
    """Return ``base_dir/name`` (resolved) after checking it cannot leave ``base_dir``.

    Refused: empty names, absolute paths (POSIX or Windows, drive letters, UNC),
    any ``..`` component, NUL bytes, and names that resolve (through symlinks)
    outside ``base_dir`` (or outside each of ``roots``, when given: ``external_data_roots``).
    ``origin`` is the file the name was read from, for the message.
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
    if not any(_inside(target, r) for r in (roots or (base,))):
        raise UnsafePath(f"{what} path {name!r} resolves outside the model directory (symlink?)", where)
    return target


def printable(path: str | os.PathLike[str]) -> str:
    """``path`` for a message: bytes that are not UTF-8 (kept by Python as surrogates) shown as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def check_utf8_path(path: str | os.PathLike[str]) -> None:
    """Refuse a path whose bytes are not UTF-8: ONNX Runtime's and LiteRT's Python APIs cannot even be given it,
    and model formats store names (blob locations) as UTF-8 strings."""
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(
            "the name is not valid UTF-8; the runtimes cannot open it: rename it", printable(path)
        ) from None


def plain_file_name(name: object) -> bool:
    """A bare, visible file name: no directory part (POSIX or Windows), no NUL, not ``.``/``..``, no leading dot
    (weightshare's temporaries and markers start with one)."""
    return (
        isinstance(name, str)
        and bool(name)
        and "\x00" not in name
        and PurePosixPath(name).name == name
        and PureWindowsPath(name).name == name
        and not name.startswith(".")
    )


def _inside(a: Path, b: Path) -> bool:
    """``a`` is ``b`` or lies under it (both resolved)."""
    return a == b or b in a.parents


def check_no_overlap(inputs: list[Path], outputs: list[Path]) -> None:
    """Refuse an output that is an input, lies inside one (an .mlpackage), or contains one.

    Checked on resolved paths before anything is created, so ``-o A.mlpackage/Data`` or
    ``merge A B -o A/inner.mlpackage`` never modify (or recurse into) an input.
    """
    for o in outputs:
        ro = Path(o).resolve()
        for i in inputs:
            ri = Path(i).resolve()
            if ro == ri:
                raise UsageError("output would overwrite the input; choose another output", i)
            if _inside(ro, ri):
                raise UsageError(f"output {o} would be written inside the input; choose an output outside it", i)
            if _inside(ri, ro):
                raise UsageError(f"output {o} would replace a directory that holds the input", i)


# What a directory walk takes as a model file, told by the format registry when it is imported (every format's
# code imports it first, as its parent package): the shared machinery that looks for models beside a blob
# (``_pipeline``, ``_outputs_record``) sits below the registry and never imports it.
_model_suffixes: list[Callable[[], tuple[str, ...]]] = []


def provide_model_suffixes(provider: Callable[[], tuple[str, ...]]) -> None:
    """Called once by ``formats``: ``provider()`` is every registered format's model suffixes."""
    _model_suffixes[:] = [provider]


def model_file_suffixes() -> tuple[str, ...] | None:
    """Every registered format's model suffixes, or None when no format was ever imported: then every file counts
    as a model that may reference a blob (the careful side: an old blob is kept, never removed early)."""
    return _model_suffixes[0]() if _model_suffixes else None


def no_link_below(root: Path, path: Path) -> None:
    """``UsageError`` naming the first component of ``path`` below ``root`` that is a link or not a directory: a
    link would put the outputs, and overwrite files, outside OUTDIR (``root`` itself may be one, followed once)."""
    p = root
    for part in path.relative_to(root).parts:
        p = p / part
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return  # made here, as a directory
        if not stat.S_ISDIR(st.st_mode):
            what = "a link" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise UsageError(f"is {what}: outputs are written only in directories below OUTDIR itself", p)
