"""Which values ``verify`` gives the symbolic dims it is not told (ONNX): the sizes at which kernels switch.

MLAS picks other kernels and blockings as a MatMul's row count grows, so a converted model can equal the
original at batch 1-16 and differ at 32 or 64 (a ``--prepack`` graph that ORT optimized differently
did exactly that, and ``verify`` with every symbolic dim at 1 passed it). So the runs cycle through (run r takes
the (r mod 3)-th; the default 3 runs cover them all):

- every free dim at 1;
- batch dims (the first axis of an input) at 8, the others (sequence lengths, spatial sizes) at ``SEQUENCE``;
- batch dims at 64, the others at 1.

Dims the user gave (``--dim``, ``--dim '*=N'``), those the model determines (head counts and sizes), those of inputs
given with ``--input``, and the past / total lengths a decoder's runs derive (``decode.run_lengths``) keep their
values. Memory budget (docs/ci.md): a run's inputs and outputs at the chosen sizes, plus the working set the first
run (every free dim at 1) grew the process by, times how many times larger the run is, must stay within
``RUN_BUDGET_BYTES``; a run over it has its larger values halved until it fits (never below 2), or is skipped,
and the report says so.
"""

from __future__ import annotations

import math
import re
from typing import Any

BATCHES = (1, 8, 64)
SEQUENCE = 8  # a sequence longer than one token: attention and MatMuls over several rows per batch entry
RUN_BUDGET_BYTES = 1 << 30

_NAME = re.compile(r"[A-Za-z_]\w*\Z")


def dim_variants(
    inputs: list[Any], dims: dict[str, int], fixed: frozenset[str] | set[str] = frozenset()
) -> list[dict[str, int]]:
    """The values of the free symbolic dims of ``inputs`` for each run in turn (``[{}]`` when none is free).
    ``dims``: the dims already set (by the user or the model); ``fixed``: other dims that must keep their value."""
    if "*" in dims:  # the user set every dynamic dim
        return [{}]
    free: list[str] = []
    batch: set[str] = set()
    for inp in inputs:
        for axis, d in enumerate(inp.shape):
            if isinstance(d, str) and _NAME.match(d) and d not in dims and d not in fixed:
                free += [d] if d not in free else []
                if axis == 0:
                    batch.add(d)
    if not free:
        return [{}]
    others = [d for d in free if d not in batch]
    variants = [{d: 1 for d in free}]
    variants.append({**{d: BATCHES[1] for d in batch}, **{d: SEQUENCE for d in others}})
    if batch:
        variants.append({**{d: BATCHES[2] for d in batch}, **{d: 1 for d in others}})
    return variants


def run_bytes(inputs: list[Any], outputs: list[Any], dims: dict[str, int]) -> int:
    """Bytes of a run's inputs and outputs with ``dims`` (a dim nothing sets counts as 1)."""
    import numpy as np

    from ..._runtimes.ort import ORT_TYPES, dim_value

    total = 0
    for v in [*inputs, *outputs]:
        shape = getattr(v, "shape", None) or []
        try:
            size = np.dtype(ORT_TYPES.get(v.type, "float32")).itemsize
        except TypeError:
            size = 4
        total += size * math.prod(max(dim_value(d, dims), 0) for d in shape)
    return total


def fit(
    variant: dict[str, int], inputs: list[Any], outputs: list[Any], dims: dict[str, int], unit_bytes: int
) -> dict[str, int] | None:
    """``variant`` within ``RUN_BUDGET_BYTES`` (``unit_bytes``: the working set of the run at every free dim 1),
    its largest values halved as needed but kept above 1; None when even that does not fit."""
    current = dict(variant)
    while True:
        scale = math.prod(current.values()) if current else 1
        if run_bytes(inputs, outputs, {**dims, **current}) + unit_bytes * scale <= RUN_BUDGET_BYTES:
            return current
        top = max(current.values(), default=1)
        if top <= 2:
            return None
        current = {d: (v // 2 if v == top else v) for d, v in current.items()}


def describe(variants: list[dict[str, int]]) -> str:
    """'batch at 1, 8, 64; sequence_length at 1, 8' for the report."""
    values: dict[str, list[int]] = {}
    for v in variants:
        for d, n in v.items():
            values.setdefault(d, [])
            if n not in values[d]:
                values[d].append(n)
    return "; ".join(f"{d} at {', '.join(map(str, ns))}" for d, ns in values.items())
