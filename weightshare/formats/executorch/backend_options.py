"""ExecuTorch backend options from Python: ``executorch::runtime::set_option`` called through ctypes.

ExecuTorch's Python runtime (``executorch.runtime``, pybindings.cpp) exposes no backend option, so its XNNPACK
backend packs every weight into private memory per loaded program. The C++ runtime has the switch: the XNNPACK
backend's ``weight_cache_enabled`` option (XnnpackBackendOptions.cpp ``set_option``; off unless the library was
built with ``ENABLE_XNNPACK_WEIGHTS_CACHE``, which the pip wheel is not) makes every later delegate init pack
through one ``XNNWeightsCache``, which looks packed weights up by their named-data key (the SHA-256 of the
weight's bytes, written by the XNNPACK partitioner, node_visitor.py) and packs each once per process.

The wheel's ``libexecutorch.so``, which the pybindings load, exports
``executorch::runtime::set_option(const char*, Span<BackendOption>)`` (``nm -D``). ``BackendOption`` is
``{char key[64]; std::variant<bool, int, std::array<char, 256>> value;}`` (runtime/backend/options.h): the variant
stores its alternative in 256 bytes and its index in the byte after them (libstdc++), 324 bytes in all. ``Span`` is
``{T* data; size_t size;}``, trivially copyable, so the x86-64 / AArch64 calling conventions pass it in two
registers, as two arguments. ``Error`` is a ``uint32_t`` enum, 0 = Ok.
"""

from __future__ import annotations

import ctypes
import importlib
import os
from pathlib import Path

from ...errors import Unsupported

KEY_LENGTH = 64
VALUE_LENGTH = 256
XNNPACK = b"XnnpackBackend"
WEIGHT_CACHE = b"weight_cache_enabled"
_MANGLED = "_ZN10executorch7runtime10set_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"
_BOOL, _INT, _STRING = 0, 1, 2  # the variant's alternatives, in declaration order


class BackendOption(ctypes.Structure):
    _fields_ = [
        ("key", ctypes.c_char * KEY_LENGTH),
        ("value", ctypes.c_char * VALUE_LENGTH),
        ("index", ctypes.c_uint8),
        ("_pad", ctypes.c_uint8 * 3),
    ]


assert ctypes.sizeof(BackendOption) == 324  # key[64] + variant (256 bytes of storage, index byte, padding to 4)


def _library() -> ctypes.CDLL:
    """The libexecutorch.so the pybindings loaded (imports them first, so it is the one in this process)."""
    try:
        bindings = importlib.import_module("executorch.extension.pybindings._C")  # loads libexecutorch.so
    except ImportError as e:
        raise Unsupported(f"ExecuTorch's Python runtime is not installed ({e})") from None
    lib = Path(str(bindings.__file__)).resolve().parent.parent.parent / "lib" / "libexecutorch.so"
    if not lib.exists():
        raise Unsupported(f"no {lib} beside ExecuTorch's pybindings (a build without the shared runtime)")
    handle = ctypes.CDLL(os.fspath(lib), mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    return handle


def set_bool(backend: bytes, key: bytes, value: bool) -> None:
    """``set_option(backend, {key: value})``; ``Unsupported`` when the runtime refuses it."""
    _set(backend, key, bytes([1 if value else 0]), _BOOL)


def set_string(backend: bytes, key: bytes, value: bytes) -> None:
    """``set_option(backend, {key: "value"})`` (at most 255 bytes)."""
    if len(value) >= VALUE_LENGTH or b"\0" in value:
        raise Unsupported(f"backend option value too long or not a C string ({len(value)} bytes)")
    _set(backend, key, value, _STRING)


def _set(backend: bytes, key: bytes, value: bytes, index: int) -> None:
    try:
        fn = getattr(_library(), _MANGLED)
    except AttributeError:
        raise Unsupported("this ExecuTorch runtime does not export executorch::runtime::set_option") from None
    fn.restype = ctypes.c_uint32
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    opt = BackendOption()
    opt.key = key
    opt.value = value
    opt.index = index
    err = fn(backend, ctypes.addressof(opt), 1)
    if err:
        raise Unsupported(f"ExecuTorch refused backend option {key.decode()} for {backend.decode()}: error {err}")


def enable_xnnpack_weight_cache() -> None:
    """Every XNNPACK delegate loaded from now on in this process packs through the backend's weights cache."""
    set_bool(XNNPACK, WEIGHT_CACHE, True)
