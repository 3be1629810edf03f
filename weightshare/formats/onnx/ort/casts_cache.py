"""What ONNX Runtime's CPU provider casts per session (``cpu.inventory_notes``), remembered between runs.

``inspect`` and ``check`` of a model with fp16 weights ask a child onnxruntime which Casts it inserts
(``cpu.run_probe``: python and onnxruntime started, the graph optimized: most of a warm `check`'s time once its
measured verdicts are reused). ORT's answer depends only on the probe model it is given (the skeleton, the small
payloads' bytes, the large ones' sizes: ``cpu.write_probe_model``), onnxruntime's version, the CPU kind and
weightshare's code, so the note it produced is kept under a digest of exactly those, in the per-user private
cache (``_private_cache``: a private directory, entries sealed with its HMAC key, type-checked when read). Any
change is a miss and ORT is asked again; a note that could not be made (ORT refused the probe) is never kept.
"""

from __future__ import annotations

import json
import platform

from ...._checksum import new_hasher
from ...._private_cache import Bound, cache_path, read_sealed, write_sealed

__all__ = ["key_of", "recall", "remember"]

SCHEMA = "weightshare-ort-casts/1"
MAX_ENTRY = 16 << 10
_BOUND = Bound(name_len=48, max_entries=256, max_age_s=30 * 86400)


def key_of(probe: bytes, zeros: int, version: str) -> str:
    """The entry name for ``probe`` (the probe model's bytes, ``zeros`` the size of the stand-in file it maps)
    under onnxruntime ``version`` on this CPU kind."""
    from ...._measure_cache import code_digest
    from .probe import cpu_features, cpu_kind

    h = new_hasher()
    h.update(f"{SCHEMA}\0{version}\0{cpu_kind(cpu_features(), platform.machine())}\0{code_digest()}\0".encode())
    h.update(probe)
    h.update(f"\0{zeros}".encode())
    return h.hexdigest()[:48]


def recall(key: str) -> list[str] | None:
    """The notes kept under ``key`` when the entry is authentic and well-formed, else None (ask ORT)."""
    body = read_sealed(cache_path("ort-casts"), key, MAX_ENTRY)
    if body is None:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    ours = isinstance(doc, dict) and doc.get("schema") == SCHEMA and doc.get("key") == key
    notes = doc.get("notes") if ours else None
    if not isinstance(notes, list) or not all(isinstance(n, str) and len(n) < 2000 for n in notes):
        return None
    return list(notes)


def remember(key: str, notes: list[str]) -> None:
    """Keep ``notes`` under ``key`` (best effort: a cache that cannot be written is only slower)."""
    body = json.dumps({"schema": SCHEMA, "key": key, "notes": notes}, sort_keys=True).encode()
    if len(body) < MAX_ENTRY - 100:
        write_sealed(cache_path("ort-casts"), key, body, _BOUND)
