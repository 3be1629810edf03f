"""The format registry: every dispatch on a model's format goes through ``detect`` / ``get``.

A format is a folder here whose ``__init__.py`` defines ``FORMAT`` (see ``base.Format``);
to add one, add the folder and its name to ``_BUILTIN`` (or call ``register`` at run time).

Public: this module and ``formats.base`` (the extension point). The format folders themselves (the names in
``_BUILTIN``: ``formats/onnx/``, ``formats/tflite/``, ...) are internal as a whole, whatever their modules are
called, and may change without notice; ``tests/test_layering.py`` holds every other public module to an ``__all__``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path

from .._findings import register_codes
from .._inputs import open_fd
from .._paths import check_utf8_path, provide_model_suffixes
from ..errors import InvalidModel, Unsupported
from .base import BenchRuntime, BlobContainer, BlobFile, Format, FormatOptions

__all__ = [
    "BenchRuntime",
    "BlobContainer",
    "BlobFile",
    "Format",
    "FormatOptions",
    "converter",
    "detect",
    "detect_format",
    "get",
    "model_suffixes",
    "register",
    "registered",
    "safetensors_container",
    "unregister",
]

# Asked in this order: a format that recognises its content by a magic number comes before one that
# also accepts files by suffix.
_BUILTIN = ("tflite", "executorch", "coreml", "mediapipe", "onnx")
_registry: list[Format] = []


def registered() -> list[Format]:
    """The formats ``detect`` asks, in order (the built-in ones are imported on first use).

    Returns:
        The registry itself: a list of ``Format`` objects.

    Example:
        >>> [f.name for f in registered()]
        ['tflite', 'executorch', 'coreml', 'mediapipe', 'onnx']
    """
    if not _registry:
        _registry.extend(_builtin())
        for fmt in _registry:
            register_codes(fmt.findings)
    return _registry


def _builtin() -> list[Format]:
    """The built-in formats, whatever is registered (``Unpack`` and the CLI's help are built from them)."""
    return [importlib.import_module(f"{__name__}.{name}").FORMAT for name in _BUILTIN]


def register(fmt: Format, first: bool = False) -> None:
    """Add a format (e.g. a plug-in or a test's toy format), replacing a registered one of the same name.

    Args:
        fmt: an object satisfying ``Format``.
        first: ask it before the built-in formats (for a format that claims files by content).

    Example:
        >>> register(ToyFormat(), first=True)
    """
    formats = registered()
    register_codes(fmt.findings)
    formats[:] = [f for f in formats if f.name != fmt.name]
    formats.insert(0 if first else len(formats), fmt)


def unregister(name: str) -> None:
    """Remove the format called ``name`` (nothing happens when none is registered).

    Args:
        name: the format's ``name``.
    """
    registered()[:] = [f for f in registered() if f.name != name]


def get(name: str) -> Format:
    """The registered format called ``name``.

    Args:
        name: e.g. ``"onnx"``.

    Returns:
        The ``Format``.

    Raises:
        Unsupported: no format has that name.
    """
    for fmt in registered():
        if fmt.name == name:
            return fmt
    raise Unsupported(f"unknown format {name!r}")


def model_suffixes() -> tuple[str, ...]:
    """What a directory walk picks up as models.

    Returns:
        Every registered format's model suffixes, e.g. ``(".tflite", ".mlpackage", ".onnx")``.
    """
    return tuple(s for fmt in registered() for s in fmt.suffixes)


provide_model_suffixes(model_suffixes)


def safetensors_container() -> BlobContainer:
    """The safetensors container, which ONNX and TFLite declare as their ``blob_container``.

    Returns:
        A ``BlobContainer`` (suffix ``.safetensors``): a valid safetensors file whose payloads sit at
        page-aligned absolute offsets.

    Example:
        >>> safetensors_container().suffix
        '.safetensors'
    """
    from .._safetensors import CONTAINER

    return CONTAINER


def _head(path: Path) -> bytes:
    if path.is_dir():
        return b""
    if not path.exists():
        raise InvalidModel("no such file", path)
    if not path.is_file():
        raise InvalidModel("not a regular file", path)
    fd = open_fd(path)  # a planned input: checked against the plan, or the held descriptor
    try:
        return os.pread(fd, 8, 0)
    finally:
        os.close(fd)


def detect(path: Path) -> Format:
    """Tell the format from the file itself, falling back to the suffix; never trust only the name.

    Args:
        path: a model file or package directory.

    Returns:
        The first registered ``Format`` that claims it.

    Raises:
        InvalidModel: no such file, not a regular file, or a directory that is not a model package.
        Unsupported: no format claims it.
    """
    path = Path(path)
    check_utf8_path(path)
    head = _head(path)
    for fmt in registered():
        if fmt.claims(path, head):
            return fmt
    if path.is_dir():
        raise InvalidModel("is a directory but not a model package (e.g. an .mlpackage with Manifest.json)", path)
    known = ", ".join(model_suffixes())
    raise Unsupported(f"unknown model format (expected one of {known})", path)


def detect_format(path: Path) -> str:
    """``detect(path).name``.

    Args:
        path: a model file or package directory.

    Returns:
        The format's name.

    Raises:
        InvalidModel: as ``detect``.
        Unsupported: as ``detect``.
    """
    return detect(path).name


def converter(name: str) -> Callable[..., object]:
    """``get(name).convert``.

    Args:
        name: a format's name.

    Returns:
        The format's ``convert`` method.

    Raises:
        Unsupported: no format has that name.
    """
    return get(name).convert
