"""Open a converted TFLite model with LiteRT's ``CompiledModel`` and the XNNPACK weight cache that matches it.

Example:
    from weightshare.litert import interpreter
    it = interpreter("out/model.tflite")        # the Interpreter API; XNNPACK weights shared by every instance
    it.allocate_tensors(); it.set_tensor(...); it.invoke(); it.get_tensor(...)

    from weightshare.litert import compiled_model
    cm = compiled_model("out/model.tflite")   # uses out/model.tflite.litert-<v>.<digest>.xnnpack-cache
    print(cm.weightshare_cache)                # the cache used, or None

``weightshare convert MODEL.tflite -o OUT --prepack`` writes the cache. XNNPACK itself cannot tell a cache built
for another model of the same structure: it would silently compute with that model's weights. This helper
only passes LiteRT a cache whose name carries the digest of the model's current content (model file, blob,
LiteRT version, CPU flags); otherwise it opens the model without a cache (every instance then packs its own
weights) and logs one warning on the ``weightshare.litert`` logger.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._litert_interpreter import SharedInterpreter
from .errors import UsageError
from .formats.tflite import cache_record
from .formats.tflite.xnnpack_cache import find_cache, open_cache

if TYPE_CHECKING:
    from ai_edge_litert.compiled_model import CompiledModel

__all__ = ["SharedInterpreter", "compiled_model", "find_cache", "interpreter"]

log = logging.getLogger("weightshare.litert")
_RETRIES = 3  # the model replaced between hashing and loading (a re-conversion committing): hash again


def _with_cache(kwargs: dict[str, Any], cache: str) -> dict[str, Any]:
    """``from_file`` keyword arguments with the cache path set on (a copy of) the CPU options."""
    from ai_edge_litert.cpu_options import CpuOptions
    from ai_edge_litert.options import Options

    kwargs = dict(kwargs)
    options = kwargs.pop("options", None)
    accel = kwargs.pop("hardware_accel", None)
    if options is None:  # what CompiledModel.from_file uses when given no options
        options = (
            Options(cpu_options=CpuOptions(num_threads=1))
            if accel is None
            else Options(hardware_accelerators=accel, cpu_options=CpuOptions(num_threads=1))
        )
    elif accel is not None:
        raise UsageError("pass either options or hardware_accel, not both")
    options = copy.copy(options)
    cpu = copy.copy(options._cpu_options) if options._cpu_options is not None else CpuOptions()
    cpu.xnnpack_weight_cache_path = str(cache)
    options._cpu_options = cpu  # Options keeps its groups in private fields and has no setter
    kwargs["options"] = options
    return kwargs


def _file_state(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def compiled_model(path: str | os.PathLike[str], **kwargs: Any) -> CompiledModel:
    """``CompiledModel.from_file(path, **kwargs)`` with the model's own XNNPACK weight cache when there is one.

    Args:
        path: a ``.tflite`` model (a ``convert --prepack`` output shares its packed weights).
        **kwargs: passed on to ``CompiledModel.from_file`` (``options`` must not name a weight cache).

    Returns:
        The CompiledModel; its ``weightshare_cache`` attribute is the cache file used, or None.

    Raises:
        UsageError: ``options`` already names an XNNPACK weight cache.
    """
    from ai_edge_litert.compiled_model import CompiledModel

    options = kwargs.get("options")
    if options is not None and options._cpu_options is not None and options._cpu_options.xnnpack_weight_cache_path:
        raise UsageError(
            "compiled_model chooses the XNNPACK weight cache; pass options without xnnpack_weight_cache_path", path
        )
    model = Path(path)
    for _attempt in range(_RETRIES):
        before = _file_state(model)
        cache, fd, why = open_cache(model)
        if cache is None or fd is None:
            log.warning(
                "weightshare: %s: %s; running without a cache (each instance packs its own weights)", model, why
            )
            cm = CompiledModel.from_file(str(model), **kwargs)
            cm.weightshare_cache = None
            return cm
        held = cache_record.HeldFd(fd)  # LiteRT maps the file this fd holds, the one that was checked
        cm = CompiledModel.from_file(str(model), **_with_cache(kwargs, cache_record.fd_path(fd, cache)))
        if _file_state(model) == before:  # LiteRT read the model whose digest named the cache
            cm.weightshare_cache = cache
            cm.weightshare_cache_fd = held
            return cm
        cm.close()  # the model was replaced while it loaded (a re-conversion committing): load again
        held.close()
    raise UsageError(f"the model kept changing while it was being loaded ({_RETRIES} attempts)", model)


def interpreter(model_path: str | os.PathLike[str], num_threads: int | None = None) -> SharedInterpreter:
    """An ``Interpreter``-like object for ``model_path`` whose instances share the XNNPACK-packed weights.

    Convert with ``weightshare convert MODEL.tflite -o OUT --prepack`` and open ``OUT/MODEL.tflite``. Without a
    matching cache it still runs (one warning, each instance packing its own weights).

    Args:
        model_path: a ``.tflite`` model.
        num_threads: CPU threads of the interpreter (default 1).

    Returns:
        A SharedInterpreter with the Interpreter API (allocate_tensors, set_tensor, invoke, get_tensor, ...).

    Raises:
        UsageError: ``num_threads`` is not an int >= 1.
    """
    from ai_edge_litert.cpu_options import CpuOptions
    from ai_edge_litert.interpreter import Interpreter, OpResolverType
    from ai_edge_litert.options import Options

    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise UsageError(f"num_threads must be an int >= 1, not {num_threads!r}")
    classic = Interpreter(
        model_path=str(model_path), experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    )
    cm = compiled_model(model_path, options=Options(cpu_options=CpuOptions(num_threads=num_threads or 1)))
    shared = SharedInterpreter(cm, classic)
    del classic  # details copied; it never allocated, so it held no weights
    return shared
