"""verify for TFLite: every signature on every LiteRT path the original runs on, outputs compared byte for byte.

Paths: the Interpreter without a delegate and with the default XNNPACK delegate; CompiledModel for models with
ExternalBuffer groups (only it loads them); and CompiledModel with the XNNPACK weight cache that ``--prepack``
wrote beside the converted model.
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..._verify import OriginalFails, VerifyReport, compare_names, compare_outputs, first_line
from ...errors import UsageError, WeightshareError
from .inventory import inventory_file

_HINT = "give real inputs with --input NAME=FILE.npy, or dynamic shapes with --shape NAME=1,16000 / --dim '*=N'"


def mapped(path: Path) -> int:
    """Bytes the runtime maps of the model at ``path``: its file and the data files it references."""
    from ..._runtimes.bound import mapped_by

    return mapped_by(path, inventory_file)


def verify_in_runtime(
    report: VerifyReport, original: Path, converted: Path, opts: dict[str, Any], broken: bool
) -> None:
    from ..._runtimes.litert import native_stderr_silenced

    named = sorted(set(opts["dims"]) - {"*"})
    if named:
        raise UsageError(
            f"--dim {named[0]}: TFLite dimensions have no names; use --dim '*=N' for every "
            "dynamic dimension or --shape INPUT=D0,D1,... for one input"
        )
    with native_stderr_silenced():
        try:
            _verify_paths(report, original, converted, opts, broken)
            if not broken:
                _verify_weight_cache(report, original, converted, opts)
        except Exception as e:
            # The frames of a failed leg hold its LiteRT objects, which log as they are destroyed: destroy them
            # here, still silenced, so that the caller's one line (or the traceback) is all stderr shows.
            traceback.clear_frames(e.__traceback__)
            gc.collect()
            raise
        gc.collect()  # LiteRT environments log as they are destroyed: while stderr is still silenced


def _verify_weight_cache(report: VerifyReport, original: Path, converted: Path, opts: dict[str, Any]) -> None:
    """A --prepack XNNPACK weight cache, checked through CompiledModel: original without, converted with it."""
    from ..._runtimes.litert import LITERT_ERRORS, compiled_entry_points
    from . import cache_record, xnnpack_cache
    from .signatures import signature_bounds
    from .xnnpack_cache import open_cache

    cache, fd, why = open_cache(converted)
    if cache is None or fd is None:
        if xnnpack_cache.candidate_caches(converted):
            report.notes.append(f"no XNNPACK weight cache checked: {why}")
        return
    held = cache_record.HeldFd(fd)  # the cache LiteRT maps is the one that was checked
    path = f"LiteRT CompiledModel + XNNPACK weight cache {cache.name}"
    try:
        ea = compiled_entry_points(str(original), str(original), bounds_of=signature_bounds)
    except LITERT_ERRORS as e:
        report.notes.append(f"the original model does not run with LiteRT CompiledModel: {first_line(e)}")
        return
    try:
        eb: Any = compiled_entry_points(
            str(converted), str(original), cache_record.fd_path(fd, cache), bounds_of=signature_bounds
        )
    except LITERT_ERRORS as e:
        report.paths.append(path)
        report.mismatches.append(f"the converted model fails to load in {path}: {first_line(e)}")
        return
    refused = _run_path(report, path, ea, eb, opts, f"CompiledModel + {cache.name}: ", _lm_plan(original, opts))
    if refused:
        report.notes.append(f"the original model does not run with LiteRT CompiledModel: {refused}")
    else:
        report.paths.append(path)
    held.close()


def _lm_plan(original: Path, opts: dict[str, Any]) -> Any:
    """``--decode-steps``: the prefill and decode signatures read from the original (None without the option)."""
    if not opts.get("decode_steps"):
        return None
    from ..._runtimes.litert import MODES
    from .decode import plan

    return plan(dict(_entry_points(original, MODES[0])), original)


def _entry_points(path: Path, mode: str) -> list[tuple[str, Any]]:
    """The entry points of ``path`` in LiteRT ``mode``: opened first (a model LiteRT refuses is refused before its
    graph is read), then its inputs used as indices read from the graph."""
    from ..._runtimes.litert import entry_points, open_mode
    from .signatures import signature_bounds

    interp = open_mode(str(path), mode)
    return list(entry_points(interp, signature_bounds(str(path))))


def _check_given(original: Path, opts: dict[str, Any]) -> None:
    """``--input NAME=FILE`` / ``SIGNATURE:NAME=FILE`` must name an input of some signature of the model."""
    if not opts["inputs"]:
        return
    from ..._runtimes.litert import LITERT_ERRORS, MODES, unknown_given

    try:
        entries = _entry_points(original, MODES[0])
    except LITERT_ERRORS:
        return  # reported by the legs
    unknown = unknown_given(entries, opts["inputs"])
    if unknown:
        takes = sorted({f"{k}:{n}" if k else n for k, e in entries for n in e.input_details()})
        raise UsageError(f"--input {unknown[0]}: the model takes no such input (it takes {', '.join(takes)})")


def _open_paths(
    original: Path, converted: Path, external: bool, refusals: list[str]
) -> Iterator[tuple[str, str, Any, Any]]:
    """(path name, original entry points, converted entry points or an error line), one LiteRT mode at a time: the
    next mode's pair is opened only once the caller dropped the last (one original and one converted runtime in
    memory, not a pair per mode: a 128 MiB two-signature LM's verify --decode-steps peaked at 682 MiB with both
    modes' pairs open, 503 MiB one pair at a time; scripts/bench_check.py --cost). A mode the original does not
    open is a line in ``refusals``."""
    from ..._runtimes.litert import LITERT_ERRORS, MODES, compiled_entry_points
    from .signatures import signature_bounds

    if external:  # only CompiledModel loads ExternalBuffer groups: run both models through it, same kernels
        try:
            ca: Any = compiled_entry_points(str(original), str(original), bounds_of=signature_bounds)
        except LITERT_ERRORS as e:
            refusals.append(f"CompiledModel: {first_line(e)}")
            return
        try:
            cb: Any = compiled_entry_points(str(converted), str(original), bounds_of=signature_bounds)
        except LITERT_ERRORS as e:
            cb = f"the converted model fails to load in LiteRT CompiledModel: {first_line(e)}"
        yield "CompiledModel", "LiteRT CompiledModel", ca, cb
        return
    for mode in MODES:
        try:
            ea = _entry_points(original, mode)
        except LITERT_ERRORS as e:
            refusals.append(f"{mode}: {first_line(e)}")
            continue
        try:
            eb: Any = _entry_points(converted, mode)
        except LITERT_ERRORS as e:
            eb = f"the converted model fails to load in LiteRT ({mode}): {first_line(e)}"
        yield mode, f"LiteRT Interpreter, {mode}", ea, eb
        del ea, eb
        gc.collect()  # LiteRT's interpreters hold cycles: freed now, before the next mode's pair is opened


def _run_path(
    report: VerifyReport,
    path: str,
    ea: list[tuple[str, Any]],
    eb: list[tuple[str, Any]],
    opts: dict[str, Any],
    label: str = "",
    lm: Any = None,
) -> str:
    """Compare on one LiteRT path; returns why the original could not run on it in the first run ('' if it ran).

    Only LiteRT's own errors count as "this path does not run the model"; any other exception propagates.
    """
    from ..._runtimes.litert import LITERT_ERRORS

    before = len(report.mismatches)
    compare_names(report, "signature", [k for k, _ in ea], [k for k, _ in eb])
    if len(report.mismatches) > before:
        return ""
    for r in range(opts["runs"]):
        for (key, run_a), (_, run_b) in zip(ea, eb):
            feeds = run_a.feeds(opts["seed"] + r, opts["inputs"], opts["shapes"], opts["dims"])
            try:
                outs_a = run_a(feeds)
            except LITERT_ERRORS as e:
                if r == 0:  # this path does not run the original (an op it lacks, a shape it refuses)
                    return first_line(e)
                raise OriginalFails(
                    f"the original model fails in {path}: {first_line(e)} ({tflite_hint(e, feeds, opts)})",
                    report.original,
                ) from None
            try:
                outs_b = run_b(feeds)
            except LITERT_ERRORS as e:
                report.mismatches.append(f"run {r}: the converted model fails in {path}: {first_line(e)}")
                return ""
            compare_names(report, "output", list(outs_a), list(outs_b))
            compare_outputs(report, list(outs_a), outs_a, outs_b, r, label + (f"{key}:" if key else ""))
        report.runs += 1
    if lm is not None and len(report.mismatches) == before:
        from .decode import run_chain

        run_chain(report, path, lm, dict(ea), dict(eb), opts, count=report.decode_steps == 0)
    return ""


_CAUSES = (  # (words in LiteRT's message, what the user can do about it)
    (
        ("flex", "select tensorflow op"),
        "the model needs TensorFlow ops (the Flex delegate), which ai-edge-litert "
        "does not include; verify cannot run it here",
    ),
    (
        ("custom op", "unresolved custom"),
        "the model uses a custom op that LiteRT's Python runtime does not register; verify cannot run it here",
    ),
    (
        ("scale", "zero_point", "quantiz"),
        "a kernel rejected the model's quantization parameters (a property of the model, not of the inputs)",
    ),
    (  # e.g. an int16x8 model with an op whose kernel has no int16 version: "Type INT16 is unsupported by op Sin"
        ("unsupported by op", "only supports", "->type ==", "type int", "type float", "not supported"),
        "an op of the model has no LiteRT kernel for its tensor types (such as int16 activations in an int16x8 "
        "model): a property of the model, not of the inputs; verify cannot run it here",
    ),
)


def tflite_hint(e: BaseException, feeds: dict[str, Any], opts: dict[str, Any]) -> str:
    """The likely cause of a LiteRT failure: a missing delegate or op, quantization, or the (random) inputs."""
    text = str(e).lower()
    for words, cause in _CAUSES:
        if any(w in text for w in words):
            return cause
    random = [n for n in feeds if n not in opts["inputs"]]
    if random:
        return (
            f"the inputs were random: give real ones by signature input name, e.g. --input {random[0]}=FILE.npy, "
            "or dynamic shapes with --shape NAME=1,16000 / --dim '*=N'"
        )
    if feeds:
        given = ", ".join(f"--input {n}" for n in feeds)
        return f"the values given ({given}) do not suit the model, e.g. indices out of range"
    return _HINT


def _first_feeds(ea: list[tuple[str, Any]], opts: dict[str, Any]) -> dict[str, Any]:
    """The inputs the first run feeds (for naming them in a hint); empty when they cannot be made."""
    for _key, entry in ea:
        try:
            return dict(entry.feeds(opts["seed"], opts["inputs"], opts["shapes"], opts["dims"]))
        except WeightshareError:
            return {}
    return {}


def _verify_paths(report: VerifyReport, original: Path, converted: Path, opts: dict[str, Any], broken: bool) -> None:
    """Every signature (or the primary subgraph), on every path the original runs on."""
    external = any(
        p.location == "external" and p.file != converted.name for p in inventory_file(converted, False).payloads
    )
    lm = _lm_plan(original, opts)  # before anything runs: a model with nothing to decode is a usage error
    _check_given(original, opts)
    refusals: list[str] = []
    first: dict[str, Any] | None = None  # the inputs of the first path's first run, for a hint
    for mode, path, ea, eb in _open_paths(original, converted, external, refusals):
        if broken:
            break
        if isinstance(eb, str):
            report.paths.append(path)
            report.mismatches.append(eb)
            continue
        refused = _run_path(report, path, ea, eb, opts, lm=lm)
        if refused and first is None and not report.paths:
            first = _first_feeds(ea, opts)
        del ea, eb  # before the next mode's pair opens
        if refused:
            refusals.append(f"{mode}: {refused}")
        else:
            report.paths.append(path)
    if not report.paths and not broken:
        cause = tflite_hint(RuntimeError("; ".join(refusals)), first or {}, opts)
        raise OriginalFails(f"the original model fails in LiteRT: {'; '.join(refusals)} ({cause})", original)
    for line in refusals:
        report.notes.append(f"the original model does not run with LiteRT {line}; that path was skipped")
    if broken:
        report.mismatches.append("the converted model was not run: its external data is broken (see above)")
