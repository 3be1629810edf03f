"""verify for ONNX: both models in onnxruntime (CPU, default session options), outputs compared byte for byte;
every payload the converted model keeps in its blob compared byte for byte with the original's payload after the
same unpacking; for a ``--prepack`` output the portable model too.

Outputs alone are sampled evidence: three random inputs never read most rows of an embedding, so a blob payload
overwritten (and its checksum re-recorded) would pass. The payload comparison does not depend on the inputs: a
payload that is not the original's, after the unpacking ``convert`` does, fails by construction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..._tensors import FileRange, PayloadSource
from ..._verify import OriginalFails, VerifyReport, compare_names, compare_outputs, first_difference, first_line
from ...errors import UsageError
from ...options import ConvertOptions
from .inventory import inventory_file
from .unpack import ORT_CPU
from .verify_dims import describe, dim_variants, fit

_HINT = "give real inputs with --input NAME=FILE.npy, or symbolic dims with --dim NAME=VALUE"


def _original_payloads(original: Path, converted_unpack: bool) -> dict[str, list[PayloadSource]]:
    """Tensor name -> what ``convert`` stores for it, under every unpacking the converted model may have had
    (default, ``--keep-packed``, and ``--unpack ort-cpu`` when the converted blob says it was used); nothing
    stays inline, so that outputs of any ``--inline-threshold`` find their payloads."""
    from .convert import prepare
    from .ort import cpu_unpack_step

    variants = [ConvertOptions(inline_threshold=0), ConvertOptions(inline_threshold=0, keep_packed=True)]
    if converted_unpack:
        variants.append(ConvertOptions(inline_threshold=0, unpack=frozenset({ORT_CPU})))
    out: dict[str, list[PayloadSource]] = {}
    for options in variants:
        for p in prepare(original, original.parent, options, cpu_unpack_step(options)).payloads:
            out.setdefault(p.tensor.name, []).append(p.source)
    return out


def _unpacked_for_cpu(converted: Path, files: list[str]) -> bool:
    from ..._recorded import blob_metadata

    return any(blob_metadata(str(converted.parent / f)).get("weightshare.unpack") == "ort-cpu" for f in files)


def compare_payloads(report: VerifyReport, original: Path, converted: Path, prepacked: bool) -> None:
    """Every external payload of ``converted`` against the original's payload of the same tensor, byte for byte."""
    inv = inventory_file(converted, hash_payloads=False)
    external = [p for p in inv.payloads if p.location == "external" and not p.problem and p.offset is not None]
    if not external:
        return
    expected = _original_payloads(original, _unpacked_for_cpu(converted, inv.external_files))
    foreign = []
    for p in external:
        candidates = [s for s in expected.get(p.name, []) if s.nbytes == p.nbytes]
        if not candidates:
            foreign.append(p.name)
            continue
        actual = FileRange(str(converted.parent / p.file), p.offset or 0, p.nbytes)
        at = [first_difference(s, actual) for s in candidates]
        report.payloads_compared += 1
        if all(d is not None for d in at):
            report.mismatches.append(
                f"{converted.name}: tensor {p.name!r} in {p.file} at offset {p.offset} differs from the "
                f"original's payload at byte {min(d for d in at if d is not None)}"
            )
    if foreign and prepacked:  # ORT's optimizer made them (NCHWc Conv weights, fusions): no original to compare
        report.notes.append(
            f"{converted.name}: {len(foreign)} payloads are onnxruntime's optimized initializers, checked by their "
            "recorded checksums and the outputs only"
        )
    elif foreign:
        report.mismatches.append(
            f"{converted.name}: {len(foreign)} payloads have no payload of that name and size in the original: "
            + ", ".join(repr(n) for n in foreign[:3])
            + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        )


def _portable_of(converted: Path) -> Path | None:
    """The portable model of a ``--prepack`` output (which ``weightshare.ort.session`` falls back to), or None:
    in a ``--prepack --shared-blob`` zoo, the model's own twin (the blob's record names one per model)."""
    from .ort.opened import prepack_info

    found = prepack_info(converted)
    if found is None:
        return None
    twins = found[0].get("portable_models")
    twin = twins.get(converted.name) if isinstance(twins, dict) else None
    name = str(twin or found[0].get("portable_model", ""))
    return converted.parent / name if name and "/" not in name and "\\" not in name else None


def _outside_envelope(converted: Path) -> str | None:
    """The onnxruntime version / CPU kind a ``--prepack`` output was packed for, when this machine's differ."""
    import platform

    import onnxruntime as ort

    from .ort.opened import prepack_info
    from .ort.probe import cpu_features, cpu_kind

    found = prepack_info(converted)
    if found is None:
        return None
    rec = found[0]
    made = (str(rec["onnxruntime"]), str(rec.get("cpu_kind") or cpu_kind(rec["cpu_features"], rec["machine"])))
    here = (ort.__version__, cpu_kind(cpu_features(), platform.machine()))
    if made == here and rec["cpu_features"] == cpu_features():
        return None
    return (
        f"{converted.name} was packed for onnxruntime {made[0]} on {made[1]}; this machine runs onnxruntime "
        f"{here[0]} on {here[1]}: its packed graph is exact only where it was made (verify it there; "
        "weightshare.ort.session opens the portable model here)"
    )


def mapped(path: Path) -> int:
    """Bytes the runtime maps of the model at ``path``: its file and the data files it references."""
    from ..._runtimes.bound import mapped_by

    return mapped_by(path, inventory_file)


def verify_in_runtime(
    report: VerifyReport, original: Path, converted: Path, opts: dict[str, Any], broken: bool
) -> None:
    from ..._runtimes.ort import new_session

    try:
        a = new_session(str(original), share=False, log_level=4)
    except Exception as e:  # noqa: BLE001 -- any runtime refusal is reported, not raised as a bug
        raise OriginalFails(f"the original model fails in onnxruntime: {first_line(e)} ({_HINT})", original) from None
    from .decode import check_dim_names

    check_dim_names(a.get_inputs(), opts["dims"], original.name)
    if broken:
        report.paths.append("onnxruntime CPU, default session options")
        report.mismatches.append("the converted model was not run: its external data is broken (see above)")
        return
    portable = _portable_of(converted)
    compare_payloads(report, original, converted, prepacked=portable is not None)
    report.paths.append("onnxruntime CPU, default session options")
    before = len(report.mismatches)
    _run_both(report, a, original, converted, opts, share=False, prefix="")
    outside = _outside_envelope(converted) if portable is not None else None
    if outside and len(report.mismatches) > before:
        report.mismatches.insert(before, outside)  # the cause first: the lines after it are what it does
    elif outside:
        report.notes.append(outside)
    if portable is None:
        return
    if not portable.is_file():
        report.mismatches.append(f"the portable model {portable.name} of this --prepack output is missing")
        return
    compare_payloads(report, original, portable, prepacked=False)
    # as weightshare.ort.session opens it outside the packed model's envelope: default options, pre-packing on,
    # against the original at the same options (the default-option session above)
    report.paths.append(f"{portable.name} and the original, default session options")
    _run_both(report, a, original, portable, opts, share=False, prefix=f"{portable.name}: ")


def _run_both(
    report: VerifyReport, a: Any, original: Path, converted: Path, opts: dict[str, Any], share: bool, prefix: str
) -> None:
    from ..._runtimes.ort import dim_value, new_session
    from .decode import derived_dims, encoder_states, make_feeds, plan, read_facts, run_lengths, window_pasts

    # the encoder beside a decoder runs (and is freed) before the converted model opens: one original and one
    # converted runtime in memory at a time, never a third
    states, note = encoder_states(original, a.get_inputs(), opts["inputs"], opts["dims"])
    try:
        b = new_session(str(converted), share=share, log_level=4)
    except Exception as e:  # noqa: BLE001
        report.mismatches.append(f"{prefix}the converted model fails to load in onnxruntime: {first_line(e)}")
        return
    before = len(report.mismatches)
    compare_names(report, f"{prefix}input", [i.name for i in a.get_inputs()], [i.name for i in b.get_inputs()])
    names_a, names_b = [o.name for o in a.get_outputs()], [o.name for o in b.get_outputs()]
    compare_names(report, f"{prefix}output", names_a, names_b)
    if len(report.mismatches) > before:
        return
    facts = read_facts(original)
    report.notes += [f"{prefix}{line}" for line in facts.capped]
    if states:  # a decoder beside its encoder: the cross-attention reads what the encoder really outputs
        opts = {**opts, "inputs": {**opts["inputs"], **states}}
    if note:
        report.notes.append(f"{prefix}{note}")
    dims, missing = derived_dims(a.get_inputs(), facts, opts["dims"], opts["inputs"])
    merged = any("use_cache" in i.name.lower() and i.type == "tensor(bool)" for i in a.get_inputs())
    p = plan(a.get_inputs(), names_a)
    window = window_pasts(p, facts, dims, opts["dims"])
    if window:
        report.notes.append(f"{prefix}{window}")
    variants, unit = _variants(a, p, dims, opts), 0
    if any(variants):
        report.notes.append(f"{prefix}symbolic dims exercised: {describe(variants[: opts['runs']])} (verify_dims)")
    report.planned_runs += opts["runs"]
    for r in range(opts["runs"]):  # the default 3 runs cover every variant
        # use_cache_branch (merged decoders) alternates: run 0 takes the prefill branch (no past: the mask is as
        # long as the new tokens), run 1 the cache branch
        use_cache = r % 2 == 1
        variant = fit(variants[r % len(variants)], a.get_inputs(), a.get_outputs(), dims, unit)
        if variant is None:
            report.skipped.append(f"{prefix}run {r}{_at(variants[r % len(variants)])} not run: over the memory budget")
            continue
        grown = _max_rss()
        # dims verify chose itself may disagree in ways their names do not say: the original refusing them, the
        # run is tried once more with only the batch dims grown (GroupQueryAttention takes no batch > 1 with a
        # sequence and a past: batch 8 runs as 8 decode steps' rows), else it is skipped, and the verdict says so
        outs_a, refused = None, ""
        for tried in dict.fromkeys((tuple(variant.items()), _batch_only(variant, a.get_inputs()))):
            run_dims = run_lengths(p, {**dims, **dict(tried)}, past_zero=merged and not use_cache)
            past = max((dim_value(d, run_dims) for d in p.past_dims), default=0)
            feeds = make_feeds(
                a.get_inputs(), facts, run_dims, opts["inputs"], opts["seed"] + r, use_cache, missing, past
            )
            try:
                outs_a = _run_original(a, feeds, original)
                break
            except OriginalFails as e:
                if r % len(variants) == 0:  # at the sizes the user asked for (or 1): the inputs are the problem
                    raise
                refused = refused or _runtime_refusal(e.message)
        if outs_a is None:
            report.skipped.append(f"{prefix}run {r}{_at(variant)} not run: {refused}")
            continue
        if dict(tried) != variant:
            report.notes.append(f"{prefix}run {r}{_at(dict(tried))} instead ({_at(variant).strip()}: {refused})")
        try:
            outs_b = dict(zip(names_b, b.run(None, feeds)))
        except Exception as e:  # noqa: BLE001
            report.mismatches.append(f"{prefix}run {r}: the converted model fails in onnxruntime: {first_line(e)}")
            return
        compare_outputs(report, names_a, dict(zip(names_a, outs_a)), outs_b, r, prefix)
        report.runs += 1
        if r == 0:  # what a run at every free dim 1 grew the process by: the unit the budget scales
            unit = max(_max_rss() - grown, 0)
    if opts.get("decode_steps", 0) and len(report.mismatches) == before:
        _decode(report, a, b, original, opts, prefix, facts, dims, missing)


def _batch_only(variant: dict[str, int], inputs: list[Any]) -> tuple[tuple[str, int], ...]:
    """``variant`` with every dim but the batch dims (first axes of inputs) back at 1."""
    batch = {i.shape[0] for i in inputs if i.shape and isinstance(i.shape[0], str)}
    return tuple((d, n if d in batch else 1) for d, n in variant.items())


def _at(variant: dict[str, int]) -> str:
    """' at batch_size=8, sequence_length=8': the dims a skipped run would have had."""
    return " at " + ", ".join(f"{d}={n}" for d, n in variant.items()) if variant else ""


def _runtime_refusal(message: str) -> str:
    """What onnxruntime said, without its status codes and verify's hint: "the original fails in
    GroupQueryAttention 'layers.0.attn.gqa': batch_size must be 1 when ..."."""
    import re

    text = message.removesuffix(f" ({_HINT})")
    found = re.search(r"running (\S+) node\. Name:'([^']*)' Status Message: (.*)", text)
    if found:
        return f"the original fails in {found[1]} {found[2]!r}: {found[3].rstrip('. ')}"
    return re.sub(r"\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)


def _variants(a: Any, p: Any, dims: dict[str, int], opts: dict[str, Any]) -> list[dict[str, int]]:
    """The free symbolic dims' values run after run (``verify_dims``): those of given inputs and the past / total
    lengths of a decoder's runs (``run_lengths``) keep theirs."""
    given = {d for i in a.get_inputs() if i.name in opts["inputs"] for d in i.shape if isinstance(d, str)}
    return dim_variants(a.get_inputs(), dims, given | p.past_dims | p.total_dims)


def _max_rss() -> int:
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def _run_original(a: Any, feeds: dict[str, Any], original: Path) -> list[Any]:
    import re

    try:
        return list(a.run(None, feeds))
    except Exception as e:  # noqa: BLE001
        # ORT's source location and C++ signature come before what it says: keep what it says
        said = re.sub(r"/onnxruntime_src/\S+:\d+ [^(]*\([^)]*\)[^ ]* ", "", str(e))
        why = first_line(RuntimeError(said))
        raise OriginalFails(f"the original model fails in onnxruntime: {why} ({_HINT})", original) from None


def _decode(
    report: VerifyReport,
    a: Any,
    b: Any,
    original: Path,
    opts: dict[str, Any],
    prefix: str,
    facts: Any,
    dims: dict[str, int],
    missing: list[tuple[str, str]],
) -> None:
    """A prefill step, then ``decode_steps`` steps feeding each present output back as its past input; both
    models get the original's feeds at every step and every step's outputs are compared byte for byte."""
    import numpy as np

    from ..._compare import differences
    from .decode import is_cross, make_feeds, next_tokens, plan, step_dims

    inputs = a.get_inputs()
    names_a, names_b = [o.name for o in a.get_outputs()], [o.name for o in b.get_outputs()]
    p = plan(inputs, names_a)
    if not p.feeds_back and p.ids is None:
        raise UsageError(
            f"--decode-steps: {original.name} has no present* output feeding a past* input and no input_ids "
            "to grow, so there is nothing to decode (verify it without --decode-steps)"
        )
    given = opts["inputs"]
    if p.ids in given or any(name in given for name in p.feeds_back):
        raise UsageError(
            "--decode-steps makes the token ids and past inputs of every step itself: drop --input for "
            + ", ".join(n for n in [p.ids or "", *p.feeds_back] if n in given)
        )
    seq = next((opts["dims"][d] for d in p.seq_dims if d in opts["dims"]), 4)
    static = [i.shape[-1] for i in inputs if i.name == p.ids and i.shape and isinstance(i.shape[-1], int)]
    if static and not p.feeds_back:
        raise UsageError(
            f"--decode-steps: {original.name} has no present* output feeding a past* input and its {p.ids} has a "
            f"fixed length ({static[0]}), so there is nothing to decode (verify it without --decode-steps)"
        )
    seq = static[0] if static else seq
    past = next((opts["dims"][d] for d in p.past_dims if d in opts["dims"]), facts.window)
    rng = np.random.default_rng(opts["seed"])
    feeds = make_feeds(inputs, facts, step_dims(p, dims, past, seq), given, opts["seed"], False, missing, past)
    grown = ("attention_mask", "position", "seqlens_k", "total_sequence_length", "use_cache")
    steps = opts["decode_steps"]
    for step in range(steps + 1):
        label = f"{prefix}decode step {step}" + (" (prefill)" if step == 0 else "")
        outs_a = dict(zip(names_a, _run_original(a, feeds, original)))
        try:
            outs_b = dict(zip(names_b, b.run(None, feeds)))
        except Exception as e:  # noqa: BLE001
            report.mismatches.append(f"{label}: the converted model fails in onnxruntime: {first_line(e)}")
            return
        before = len(report.mismatches)
        for name in names_a:
            if name in outs_b:
                report.outputs_compared += 1
                report.mismatches += [f"{label}: {line}" for line in differences(outs_a[name], outs_b[name], name)]
        if len(report.mismatches) > before:
            return  # the next steps would be fed from outputs that already differ
        if step:
            report.decode_steps += 1
        if step == steps:
            return
        ids = feeds.get(p.ids) if p.ids else None
        token = next_tokens(p, outs_a, ids, facts, rng) if ids is not None and p.ids not in given else None
        if p.feeds_back:  # a KV cache: one new token on top of the past
            past, seq = past + seq, 1
        else:  # no cache: the whole sequence again, one token longer
            seq += 1
        fresh = make_feeds(inputs, facts, step_dims(p, dims, past, seq), given, opts["seed"] + step + 1, True)
        for inp in inputs:
            name, old = inp.name, feeds[inp.name]
            if name in p.feeds_back and (step == 0 or not is_cross(name)):
                # cross-attention K/V come from the prefill step and stay: a merged decoder's cache branch
                # outputs a dummy in their place (optimum pads the with-past model's missing outputs)
                feeds[name] = outs_a[p.feeds_back[name]]
            elif name == p.ids and token is not None:
                feeds[name] = token if p.feeds_back else np.concatenate([old, token], axis=-1)
            elif any(g in name.lower() for g in grown) and "encoder" not in name.lower():
                feeds[name] = fresh[name]
            elif getattr(old, "shape", None) != getattr(fresh[name], "shape", None):
                feeds[name] = fresh[name]
