"""``verify --decode-steps N`` for TFLite LMs as litert-torch writes them: a prefill signature, then N runs of the
decode signature, each fed the KV cache the previous step output.

What is read from the model (no names are required beyond these patterns): the signatures whose outputs carry an
input's name (``kv_cache_k_0`` in and out: the KV cache); among them the one named ``*decode*`` and the one named
``*prefill*`` (a single such signature serves both); its int input whose name holds ``pos`` (positions) and its
other index input (token ids, bounded by the embedding table); its output whose name holds ``logits``.
The prefill step takes seeded random tokens, positions ``0..T-1`` and a zero cache; each decode step takes the
original's most likely next token (or a random one), the next position and the original's KV outputs. Both models
get the same feeds; every step's outputs are compared byte for byte, and the chain stops at the first difference
(the next step would be fed outputs that already differ).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..._compare import differences
from ..._verify import OriginalFails, VerifyReport, first_line
from ...errors import UsageError


@dataclass(frozen=True)
class LmPlan:
    prefill: str
    decode: str
    kv: tuple[str, ...]  # inputs fed from the previous step's output of the same name
    positions: str | None
    tokens: str | None
    token_bound: int | None
    positions_bound: int | None
    logits: str | None


def plan(entries: dict[str, Any], original: Path) -> LmPlan:
    """The prefill and decode signatures of ``entries`` (key -> the original's ``EntryPoint``), or UsageError."""
    kv_of: dict[str, tuple[str, ...]] = {}
    for key, entry in entries.items():
        outs = entry.output_details()
        kv_of[key] = tuple(n for n in entry.input_details() if n in outs)
    lms = [k for k, kv in kv_of.items() if kv]
    if not lms:
        raise UsageError(
            f"--decode-steps: no signature of {original.name} has an output feeding its input of the same name (a KV "
            "cache such as kv_cache_k_0), so there is nothing to decode (verify it without --decode-steps)"
        )
    decode = next((k for k in lms if "decode" in k.lower()), lms[0] if len(lms) == 1 else None)
    if decode is None:
        raise UsageError(
            f"--decode-steps: {original.name} has several signatures with a KV cache ({', '.join(lms)}) and none "
            "is named *decode*"
        )
    prefill = next((k for k in lms if "prefill" in k.lower()), decode)
    entry = entries[decode]
    ints = [n for n, d in entry.input_details().items() if np.dtype(d["dtype"]).kind in "iu"]
    positions = next((n for n in ints if "pos" in n.lower()), None)
    tokens = next((n for n in ints if n != positions and n in entry.bounds), None)
    logits = next((n for n in entry.output_details() if "logits" in n.lower()), None)
    return LmPlan(
        prefill,
        decode,
        kv_of[decode],
        positions,
        tokens,
        entry.bounds.get(tokens) if tokens else None,
        entry.bounds.get(positions) if positions else None,
        logits,
    )


def _length(feeds: dict[str, np.ndarray], name: str | None) -> int:
    return int(feeds[name].shape[-1]) if name and name in feeds and feeds[name].ndim else 1


def run_chain(
    report: VerifyReport,
    path: str,
    lm: LmPlan,
    ea: dict[str, Any],
    eb: dict[str, Any],
    opts: dict[str, Any],
    count: bool,
) -> None:
    """Prefill, then ``opts["decode_steps"]`` decode steps on one LiteRT path (entries by signature key; the
    original's ``ea`` make the feeds). ``count``: this path's steps are the ones the report counts."""
    steps = opts["decode_steps"]
    given = opts["inputs"]
    feeds = dict(ea[lm.prefill].feeds(opts["seed"], given, opts["shapes"], opts["dims"]))
    prompt = _length(feeds, lm.positions)
    if lm.positions_bound is not None and prompt + steps > lm.positions_bound:
        raise UsageError(
            f"--decode-steps {steps}: the prefill takes {prompt} positions and the model's tables hold "
            f"{lm.positions_bound}; use at most {lm.positions_bound - prompt} steps"
        )
    if lm.positions and given_missing(given, lm.prefill, lm.positions):
        feeds[lm.positions] = np.arange(prompt, dtype=feeds[lm.positions].dtype).reshape(feeds[lm.positions].shape)
    for name in lm.kv:
        if given_missing(given, lm.prefill, name):
            feeds[name] = np.zeros_like(feeds[name])  # a fresh cache
    rng = np.random.default_rng(opts["seed"])
    key = lm.prefill
    for step in range(steps + 1):
        label = f"{path}: decode step {step}" + (f" ({key})" if step == 0 else "")
        try:
            outs_a = ea[key](feeds)
        except (RuntimeError, ValueError) as e:
            raise OriginalFails(f"the original model fails at {label}: {first_line(e)}", report.original) from None
        try:
            outs_b = eb[key](feeds)
        except (RuntimeError, ValueError) as e:
            report.mismatches.append(f"{label}: the converted model fails: {first_line(e)}")
            return
        before = len(report.mismatches)
        for name in outs_a:
            if name not in outs_b:
                report.mismatches.append(f"{label}: output {name!r} is missing from the converted model")
                continue
            report.outputs_compared += 1
            report.mismatches += [f"{label}: {line}" for line in differences(outs_a[name], outs_b[name], name)]
        if len(report.mismatches) > before:
            return  # the next steps would be fed outputs that already differ
        if step and count:
            report.decode_steps += 1
        if step == steps:
            return
        key = lm.decode
        fresh = dict(ea[key].feeds(opts["seed"] + step + 1, given, opts["shapes"], opts["dims"]))
        for name in lm.kv:
            fresh[name] = outs_a[name]
        if lm.positions:
            shape = fresh[lm.positions].shape
            fresh[lm.positions] = np.full(shape, prompt + step, fresh[lm.positions].dtype)
        if lm.tokens and lm.logits and given_missing(given, key, lm.tokens):
            logits = np.asarray(outs_a[lm.logits])
            shape = fresh[lm.tokens].shape
            bound = lm.token_bound or logits.shape[-1]
            if logits.ndim and logits.shape[-1] <= bound and int(np.prod(shape)) == 1:
                token = int(np.argmax(logits.reshape(-1, logits.shape[-1])[-1]))
            else:
                token = int(rng.integers(0, bound))
            fresh[lm.tokens] = np.full(shape, token, fresh[lm.tokens].dtype)
        feeds = fresh


def given_missing(given: dict[str, Any], key: str, name: str) -> bool:
    return f"{key}:{name}" not in given and name not in given
