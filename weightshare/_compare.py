"""Byte-exact comparison of runtime outputs, and a one-line account of where two outputs differ.

Outputs are tensors (numpy arrays), sequences (lists), maps (dicts) or optionals
(``None`` when empty), nested as ONNX allows (ZipMap: a sequence of maps).
"Equal" means same kind, same dtype and shape, and the same bytes: ``-0.0`` and
``0.0`` differ, two NaNs are equal only when their bit patterns are.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _kind(value: Any) -> str:
    if value is None:
        return "empty optional"
    if isinstance(value, dict):
        return "map"
    if isinstance(value, (list, tuple)):
        return "sequence"
    return "tensor"


def _describe(a: np.ndarray) -> str:
    return f"{a.dtype}{list(a.shape)}"


def _as_array(value: Any) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else np.asarray(value)


def _differing(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Boolean mask of elements whose bytes differ (same dtype and shape assumed)."""
    if a.dtype.kind in "OUS":  # strings: compare values
        values: np.ndarray = a != b
        return values
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    item = a.dtype.itemsize
    if item in (1, 2, 4, 8) and a.dtype.kind != "c":
        view = np.dtype(f"u{item}")
        bits: np.ndarray = a.view(view) != b.view(view)
        return bits
    raw = a.view(np.uint8).reshape(a.shape + (item,)) != b.view(np.uint8).reshape(b.shape + (item,))
    anywhere: np.ndarray = raw.any(axis=-1)
    return anywhere


def _ordered(x: np.ndarray) -> np.ndarray:
    """Floats as integers that are ordered like the floats (adjacent floats differ by 1): ULP distance."""
    signed = x.view(np.dtype(f"i{x.dtype.itemsize}")).astype(np.float64)
    low = float(np.iinfo(np.dtype(f"i{x.dtype.itemsize}")).min)
    return np.where(signed < 0, low - signed, signed)


def tensor_difference(a: np.ndarray, b: np.ndarray) -> str:
    """'' when byte-identical, else where and by how much they differ, in one line."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{_describe(a)} vs {_describe(b)}"
    mask = _differing(a, b)
    count = int(np.count_nonzero(mask))
    if not count:
        return ""
    flat = mask.reshape(-1)
    first = [int(i) for i in np.unravel_index(int(np.argmax(flat)), mask.shape)] if mask.ndim else []
    parts = [f"{count} of {a.size} elements differ, first at {first}"]
    if a.dtype.kind in "iuf":
        xa, xb = np.ascontiguousarray(a).reshape(-1)[flat], np.ascontiguousarray(b).reshape(-1)[flat]
        with np.errstate(all="ignore"):
            diff = np.abs(xa.astype(np.float64) - xb.astype(np.float64))
            finite = diff[np.isfinite(diff)]
            if finite.size:
                parts.append(f"max abs diff {float(finite.max()):.6g}")
            if a.dtype.kind == "f":
                parts.append(f"max ULP diff {int(np.abs(_ordered(xa) - _ordered(xb)).max())}")
    return ", ".join(parts)


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Every place where ``a`` and ``b`` differ, one line each; [] when equal byte for byte."""
    ka, kb = _kind(a), _kind(b)
    if ka != kb:
        return [f"{where or 'value'}: {ka} vs {kb}"]
    if ka == "empty optional":
        return []
    if ka == "sequence":
        if len(a) != len(b):
            return [f"{where}: sequence of {len(a)} vs {len(b)} elements"]
        out: list[str] = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f"{where}[{i}]")
        return out
    if ka == "map":
        if list(a) != list(b):
            return [f"{where}: map keys differ ({len(a)} vs {len(b)} keys)"]
        out = []
        for key in a:
            out += differences(a[key], b[key], f"{where}[{key!r}]")
        return out
    line = tensor_difference(_as_array(a), _as_array(b))
    return [f"{where}: {line}"] if line else []


def count_leaves(value: Any) -> int:
    """Tensors compared inside a (possibly nested) output."""
    if isinstance(value, dict):
        return sum(count_leaves(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(count_leaves(v) for v in value)
    return 0 if value is None else 1
