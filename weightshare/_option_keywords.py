"""The keyword options of the public conversion functions, as TypedDicts (PEP 692 ``Unpack``).

Generated from ``ConvertOptions``' field metadata by ``scripts/gen_option_keywords.py``: do not edit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypedDict

__all__ = ["ConvertKeywords", "MergeKeywords", "ZooKeywords"]


class MergeKeywords(TypedDict, total=False):
    align: int
    align_threshold: int
    small_align: int
    progress: Callable[[int], object] | None
    progress_total: Callable[[int], None] | None


class ZooKeywords(MergeKeywords, total=False):
    inline_threshold: int
    keep_packed: bool
    unpack: str | Iterable[str]
    blob: str | None
    blob_grace: float
    external: bool
    prepack: bool
    stage: Callable[[str], None] | None
    ort_child_timeout: float | None
    ort_child_memory: int | None
    ort_max_growth: float | None


class ConvertKeywords(ZooKeywords, total=False):
    shared_blob: str | None
