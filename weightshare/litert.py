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

from ._litert_interpreter import SharedInterpreter, interpreter
from .errors import UsageError
from .formats.tflite import cache_record, xnnpack_cache

if TYPE_CHECKING:
    from ai_edge_litert.compiled_model import CompiledModel

__all__ = ["SharedInterpreter", "compiled_model", "find_cache", "interpreter"]

log = logging.getLogger("weightshare.litert")
_RETRIES = 3  # the model replaced between hashing and loading (a re-conversion committing): hash again


def find_cache(model: str | os.PathLike[str]) -> tuple[Path | None, str]:
    """The XNNPACK weight cache that matches ``model``'s current content and its own record.

    Args:
        model: a ``.tflite`` model written by ``weightshare convert --prepack``.

    Returns:
        (cache path, "") when one matches; (None, why none is used) otherwise."""
    cache, fd, why = open_cache(model)
    if fd is not None:
        os.close(fd)
    return cache, why


def open_cache(model: str | os.PathLike[str]) -> tuple[Path | None, int | None, str]:
    """(cache, an fd of it checked against its record, "matches"), or (None, None, why none is used)."""
    model = Path(model)
    if not xnnpack_cache.candidate_caches(model):  # nothing to match: spare the hash of the model
        return None, None, "no XNNPACK weight cache beside the model (`weightshare convert --prepack` writes one)"
    digest = xnnpack_cache.content_digest(model)
    expected = model.parent / xnnpack_cache.cache_name(model.name, digest)
    if os.path.lexists(expected):
        fd, why = cache_record.open_verified(expected, digest)
        if fd is None:
            return None, None, f"{expected.name} is not used: {why}"
        return expected, fd, "matches"
    others = [s for s in xnnpack_cache.cache_status(model) if not s.matches]
    if others:
        return None, None, f"{others[0].path.name} does not match the model ({others[0].reason})"
    return None, None, f"no XNNPACK weight cache beside the model (expected {expected.name})"


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
