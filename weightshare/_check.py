"""`weightshare check`: is a model share-ready? One finding per problem kind and model.

Reads the inventory, where each format recorded what it found (payload problems carry
their code from where they were detected); never classifies by message text.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ._dispatch import inventory, measure_or_reuse
from ._findings import Code, Finding, Severity, TextEnum, code_named
from ._inventory import MeasureInputs, ModelInventory, PayloadInfo, judge_envelope, known_how
from ._paid import paid_verdict
from ._placement import AlignPolicy
from ._recorded import blob_metadata
from ._safetensors import ALIGN_KEY
from .errors import UsageError, WeightshareError
from .formats import get
from .formats.base import MeasuresCopies, MeasuresSettings
from .options import INLINE_THRESHOLD

COPY_THRESHOLD = 1 << 20  # bytes per session a copy may cost before `check` fails on it (--threshold)
MAX_RATIO = 1.10  # a measured growth counts when 4 sessions cost more than this times one session's PSS
MARGIN = 0.25  # a measured figure within this fraction of a decision line is measured REPEATS times
REPEATS = 3  # measurements of a figure near a decision line; the median decides


def _names(payloads: list[PayloadInfo], limit: int = 3) -> str:
    shown = ", ".join(p.name for p in payloads[:limit])
    return shown + (f" and {len(payloads) - limit} more" if len(payloads) > limit else "")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _stored_twice(inv: ModelInventory, min_bytes: int) -> list[PayloadInfo]:
    """External payloads of ``min_bytes`` or more whose bytes are already stored at another place (aliases of one
    place are fine; so are small repeats such as coremltools' zero biases, cheaper than a record of their own)."""
    where: dict[str, tuple[str, int | None]] = {}
    for p in inv.payloads:
        if p.location == "external" and not p.duplicate_of:
            where.setdefault(p.name, (p.file, p.offset))
    return [
        p
        for p in inv.payloads
        if p.location == "external"
        and p.duplicate_of
        and p.offset is not None
        and p.nbytes >= min_bytes
        and where.get(p.duplicate_of, (p.file, p.offset)) != (p.file, p.offset)
    ]


@dataclass(frozen=True)
class Gate:
    """What `check` holds a model to: the runtime settings it will be loaded with (``--target``; a model whose
    format has no setting named is held to what its runtime does when the user does nothing,
    ``ModelInventory.default_setting``) and the bytes per session a copy may cost before it is an error
    (``--threshold``: that many bytes or more). Below the threshold a copy is information, under a setting not
    targeted a warning."""

    targets: tuple[str, ...] = ()
    threshold: int = COPY_THRESHOLD
    inline_threshold: int = INLINE_THRESHOLD
    measure: bool = True  # ask the runtime what one more session costs (ONNX, with onnxruntime installed)
    feeds: MeasureInputs = MeasureInputs()  # --dim / --input for the measuring runs
    # --runtime VERSION[/CPU_KIND]: the serving machine's runtime, when it is not the one check runs under
    runtime: str = ""
    instances: int = 4  # what a user pays: this many instances in one process (--instances) ...
    processes: int = 2  # ... and this many processes with one instance each (--processes)
    cache: bool = True  # reuse a measured verdict while its key is unchanged (``_measure_cache``; --no-cache: False)

    def targeted(self, inv: ModelInventory) -> list[str]:
        named = [s for s in inv.settings if s in self.targets]
        return named or ([inv.default_setting] if inv.default_setting else inv.settings[:1])

    def severity(self, inv: ModelInventory, cost: dict[str, int], floor: Severity = Severity.INFO) -> Severity:
        """``cost``: bytes per session under each setting (one key, "", when the cost is the same under all);
        ``floor``: the severity below the threshold (a layout that works but is not optimal: a warning)."""
        targeted = self.targeted(inv)
        over = {s for s, n in cost.items() if n > 0 and n >= self.threshold}
        if any(not s or s in targeted or not targeted for s in over):
            return Severity.ERROR
        return Severity.WARNING if over else floor


def _cost(inv: ModelInventory, payloads: list[PayloadInfo]) -> dict[str, int]:
    """Bytes the copy these payloads were marked with costs per session under each of the inventory's settings
    (``copy_bytes``; an inventory that does not split its figures by cause: everything they cost)."""
    if not inv.settings:
        return {"": sum(p.copied_per_session for p in payloads)}
    return {
        s: sum(p.copy_bytes.get(s, 0) if p.copy_bytes else p.copies.get(s, p.copied_per_session) for p in payloads)
        for s in inv.settings
    }


def _copies(inv: ModelInventory, add: Callable[..., None], gate: Gate) -> None:
    """What a runtime copies per session: embedded payloads, unpacking, and the per-setting copies that each
    format's inventory marked with their code (``PayloadInfo.copy_code``) where it derived them."""
    embedded = [
        p
        for p in inv.payloads
        if p.location == "embedded" and p.nbytes >= gate.inline_threshold and not p.stays_inline_because
    ]
    if embedded and "embedded" in get(inv.format).maps_in_place:  # mapped with the file: shared, only badly aligned
        add(
            Code.INLINE_UNALIGNED,
            embedded,
            f"{len(embedded)} payloads ({_mib(sum(p.nbytes for p in embedded))}) "
            f"are inline in the model file: mapped with it and shared where the runtime maps it, but not page-aligned: "
            f"{_names(embedded)}",
        )
    elif embedded:
        copied = sum(p.nbytes for p in embedded)
        add(
            Code.EMBEDDED_WEIGHTS,
            embedded,
            f"{len(embedded)} payloads ({_mib(copied)}) are embedded in the model file and copied per session: "
            f"{_names(embedded)}",
            gate.severity(inv, {"": copied}),
        )
    unpacked = [p for p in inv.payloads if p.unpacked_at_load]
    if unpacked:
        copied = sum(p.copied_per_session for p in unpacked)
        add(
            Code.UNPACKED_PER_SESSION,
            unpacked,
            f"{len(unpacked)} payloads are unpacked by the runtime in every session "
            f"({unpacked[0].unpacked_at_load}; {_mib(copied)} per session): {_names(unpacked)}",
            gate.severity(inv, {"": copied}),
        )
    by_code: dict[str, list[PayloadInfo]] = {}
    for p in inv.payloads:
        if p.copy_code:
            by_code.setdefault(p.copy_code, []).append(p)
    for code, payloads in by_code.items():
        cost = _cost(inv, payloads)
        # the settings that copy: one that copies nothing is the fix, named in the fix line, not a figure here
        where = ", ".join(f"{_mib(n)} under {s}" for s, n in cost.items() if n) or "nothing under any setting"
        add(
            code_named(code),
            payloads,
            f"{len(payloads)} payloads ({_mib(sum(p.nbytes for p in payloads))}): "
            f"{payloads[0].copy_reason}; copied per session: {where}: {_names(payloads)}",
            gate.severity(inv, cost),
            "; ".join(sorted({p.copy_fix for p in payloads if p.copy_fix})),
        )


def _lines(inv: ModelInventory, setting: str, gate: Gate) -> list[float]:
    """The figures at which a measured copy under ``setting`` changes the verdict: the threshold, and the growth
    at which 4 sessions cost MAX_RATIO times one."""
    return [gate.threshold, (MAX_RATIO - 1) * inv.measured_one_session.get(setting, 0) / 3]


def near_a_line(inv: ModelInventory, gate: Gate) -> list[str]:
    """Settings whose measured figure lies within MARGIN of a line where the verdict changes."""
    return [
        s
        for s, n in inv.measured.items()
        if any(line > 0 and abs(n - line) <= MARGIN * line for line in _lines(inv, s, gate))
    ]


def settle(inv: ModelInventory, gate: Gate, path: str | os.PathLike[str]) -> None:
    """Measure again, up to REPEATS in all, while a figure is near a decision line, and keep each setting's
    median: one measurement's noise (the runtime's per-session state, other processes) cannot flip the verdict
    of a model whose median is off the line, and the figures repeat themselves within a few percent."""
    fmt = get(inv.format)
    near = near_a_line(inv, gate)
    if not isinstance(fmt, MeasuresCopies) or not near:
        return
    feeds = [gate.feeds] if gate.feeds != MeasureInputs() else []
    samples: dict[str, list[int]] = {s: [inv.measured[s]] for s in near}
    ones: dict[str, list[int]] = {s: [inv.measured_one_session.get(s, 0)] for s in near}
    for _ in range(REPEATS - 1):
        # the settings near a line only, where the format can (the others' figures decide nothing here)
        again = (
            fmt.measure_settings(Path(path), near, *feeds)
            if isinstance(fmt, MeasuresSettings)
            else fmt.measure_copies(Path(path), *feeds)
        )
        for s, values in samples.items():
            if s in again[0]:
                values.append(again[0][s])
                ones[s].append(again[1].get(s, 0))
    for s, values in samples.items():  # the ratio's line moves with the one-session PSS: its median too
        inv.measured[s] = sorted(values)[len(values) // 2]
        inv.measured_one_session[s] = sorted(ones[s])[len(ones[s]) // 2]
    inv.measure_notes.append(
        "near the gate, measured "
        + ", ".join(f"{s} {len(v)} times ({', '.join(_mib(x) for x in v)}; median kept)" for s, v in samples.items())
    )


def _measured(inv: ModelInventory, add: Callable[..., None], gate: Gate) -> None:
    """One finding per setting under which one more session, measured, keeps the threshold or more of weights and
    their copies (activation memory is measured apart: ``_activations``)."""
    targeted = gate.targeted(inv)
    for setting in inv.settings:
        n = inv.measured.get(setting)
        if n is None:
            continue
        one = inv.measured_one_session.get(setting, 0)
        # sharing as a PSS benchmark sees it: 4 sessions within MAX_RATIO of one are shared, whatever the
        # runtime's own per-session state (a few MiB of kernel buffers on a 100 MiB model) costs
        severity = gate.severity(inv, {setting: n}) if 3 * n > (MAX_RATIO - 1) * one else Severity.INFO
        if severity is Severity.INFO:
            continue
        static = inv.copied_under(setting)
        # the weights the figure names: never a shape constant or a few bytes kept inline (a Reshape's
        # ``onnx::Reshape_288`` was named the "largest" of a 60 MiB figure it had no part in)
        copying = sorted(
            (
                p
                for p in inv.payloads
                if p.copies.get(setting, p.copied_per_session)
                and not p.used_as_shape
                and p.nbytes >= gate.inline_threshold
            ),
            key=lambda p: -p.copies.get(setting, p.copied_per_session),
        )
        how = f", {inv.default_how}" if inv.default_how and setting in targeted and not gate.targets else ""
        sharing = inv.settings[0] if inv.settings else setting
        gone = setting != sharing and inv.measured.get(sharing, n) < min(gate.threshold, n / 2)
        unexplained = 2 * static < n and not gone  # neither the rules nor the sharing setting's figure explain it
        fixes = sorted({p.copy_fix for p in copying if p.copy_fix})  # the static rules' own fixes for these copies
        add(
            Code.MEASURED_COPY,
            copying if not unexplained else [],
            f"one more session under {setting}{how} keeps {_mib(n)} of weights "
            f"({known_how(inv.measure_notes, setting)}; static rules: {_mib(static)}"
            + (f"; largest: {_names(copying)}" if copying else "")
            + (
                f"; {_mib(n - static)} no static rule explains"
                if unexplained
                else f"; {_mib(inv.measured[sharing])} at the sharing setting"
                if gone
                else ""
            )
            + ")",
            severity,
            "; ".join(fixes) if fixes and not unexplained else _measured_fix(inv, setting, unexplained),
        )


def _measured_fix(inv: ModelInventory, setting: str, unexplained: bool) -> str:
    """What removes a measured copy, never what the model already has: ``--prepack`` for a plain conversion whose
    copies the rules explain; for a ``--prepack`` output (or a copy no rule explains) no guess."""
    sharing = inv.settings[0] if inv.settings else ""
    if unexplained:
        return (
            "no known fix: no static rule explains this copy; `weightshare inspect --json MODEL` shows the "
            "measured and static figures per setting (please report it)"
        )
    if inv.prepack_output and inv.default_how and setting != inv.default_setting:
        # the copies are this setting's own (a loader not reading what --prepack stored): the loader is the fix
        return f"load it {inv.default_how}, the loader it was made for; or load with {sharing}"
    if inv.prepack_output:
        other = f"; or load with {sharing}" if sharing and sharing != setting else ""
        return (
            "report it: converting again stores the same packings (ort-session-state names the weights found copied; "
            f"packed-for-other-runtime, when they were packed for another runtime){other}"
        )
    if inv.fallback_of:  # a --prepack output's portable twin: the packed model is the fix, not another conversion
        return f"open {inv.fallback_of} (this model is its fallback) where its packings fit, or load with {sharing}"
    return (
        f"convert with --prepack (the packed copies stored beside the model, mapped by every session), or load "
        f"with {sharing}; the static findings listed with it say which weights and how"
    )


def _what_it_costs(inv: ModelInventory, add: Callable[..., None], gate: Gate) -> None:
    """What a user pays converted (through its loader, fixed cost per process included) against the original:
    a warning where the conversion costs more, with the break-even; else the figures, as information."""
    verdict = paid_verdict(inv, gate.instances, gate.processes)
    if verdict is not None:
        add(verdict[0], [], verdict[1], verdict[2])


def _activations(inv: ModelInventory, add: Callable[..., None], gate: Gate) -> None:
    """Activation memory one more session keeps (the runtime's arena: inputs, intermediate tensors, kernel scratch),
    measured apart from the weights: information, sized by the inputs, never a weight copy."""
    for setting, n in inv.measured_activation.items():
        if n >= gate.threshold:
            add(
                Code.ACTIVATION_MEMORY,
                [],
                f"one more session under {setting} keeps {_mib(n)} of activation memory (its arena after a run at "
                "the inputs check generated; measured apart from the weights, not a weight copy)",
                Severity.INFO,
            )


def _expected_alignment(inv: ModelInventory, model_dir: Path) -> Callable[[PayloadInfo], int]:
    """The alignment each external payload was meant to have: the policy its blob records (``convert --align``),
    else weightshare's default."""
    policies: dict[str, AlignPolicy] = {}
    for name in inv.external_files:
        policies[name] = AlignPolicy.parse(blob_metadata(str(model_dir / name)).get(ALIGN_KEY)) or AlignPolicy()
    default = AlignPolicy()
    return lambda p: policies.get(p.file, default).for_size(p.nbytes)


def _layout(inv: ModelInventory, add: Callable[..., None], gate: Gate, model_dir: Path) -> None:
    """Unaligned and duplicated payloads, each an error only when it costs more than the threshold."""
    expected = _expected_alignment(inv, model_dir)
    unaligned = [
        p for p in inv.payloads if p.location == "external" and p.alignment is not None and p.alignment < expected(p)
    ]
    if unaligned:
        # A runtime that maps external data at any offset (``Format.maps_unaligned``; ONNX Runtime 1.32, measured:
        # 2 x 16 MiB MatMul weights written with --align 64, 3 sessions with disable_prepacking: PSS 99.5 -> 99.8
        # MiB) pays partly shared pages for a misaligned payload, not a copy: a warning. Other runtimes: not
        # measured, so it counts whole against the threshold.
        cost = 0 if get(inv.format).maps_unaligned else sum(p.nbytes for p in unaligned)
        add(
            Code.UNALIGNED,
            unaligned,
            f"{len(unaligned)} external payloads ({_mib(sum(p.nbytes for p in unaligned))}) sit at offsets "
            f"below the alignment their blob records (else 64 KiB for >= 1 MiB, 64 B below): {_names(unaligned)}",
            gate.severity(inv, {"": cost}, Severity.WARNING),
        )
    stored = _stored_twice(inv, gate.inline_threshold)
    if stored:
        twice = sum(p.nbytes for p in stored)
        add(
            Code.DUPLICATE_PAYLOADS,
            stored,
            f"{len(stored)} external payloads ({_mib(twice)}) repeat bytes already stored elsewhere in the blob: "
            f"{_names(stored)}",
            gate.severity(inv, {"": twice}, Severity.WARNING),
        )


def _envelope(inv: ModelInventory, add: Callable[..., None], gate: Gate) -> None:
    """A packed model judged for the runtime it will be served by: this machine's, or ``--runtime``'s."""
    problem, note = judge_envelope(inv, gate.runtime)
    if problem:
        add(Code.PACKED_FOR_OTHER_RUNTIME, [], problem, Severity.ERROR)
    elif note:
        inv.notes.append(note)


def findings_for(inv: ModelInventory, gate: Gate | None = None) -> list[Finding]:
    gate = gate or Gate()
    out: list[Finding] = []
    model = Path(inv.model).absolute()
    # an .mlpackage: file names are relative to it; a model file: to the directory of the path given, where the
    # runtime opens them (not beside a symlink's target)
    model_dir = model.resolve() if model.is_dir() else model.parent

    def add(
        code: TextEnum, payloads: list[PayloadInfo], message: str, severity: Severity | None = None, fix: str = ""
    ) -> None:
        if inv.fallback_of and severity is not None and severity is Severity.ERROR:
            # a --prepack output's portable model is the fallback where its packed weights cannot be used
            severity = Severity.WARNING
            message += f" (fallback model of {inv.fallback_of}: each session costs this where that one cannot run)"
        finding = Finding.of(code, inv.model, message, payloads[0].name if payloads else "", severity)
        if fix:
            finding.fix = fix
        out.append(finding)

    out += inv.findings
    _envelope(inv, add, gate)
    _measured(inv, add, gate)
    _activations(inv, add, gate)
    _what_it_costs(inv, add, gate)
    static = len(out)
    _copies(inv, add, gate)
    if inv.measured and all(s in inv.measured for s in gate.targeted(inv)):
        # the runtime's own figure decides; the rules only say where the bytes go (a targeted setting that
        # was not measured, such as litert-compiled-cache without its cache, keeps its static findings)
        for f in out[static:]:
            f.severity = Severity.INFO
            f.message += " (static estimate)"
    _layout(inv, add, gate, model_dir)
    by_problem: dict[str, list[PayloadInfo]] = {}
    for p in inv.payloads:
        if p.problem:
            by_problem.setdefault(p.problem_code or Code.BAD_EXTERNAL_DATA.value, []).append(p)
    for code, payloads in sorted(by_problem.items()):
        more = f" (and {len(payloads) - 1} more payloads)" if len(payloads) > 1 else ""
        add(code_named(code), payloads, payloads[0].problem + more)
    for name in inv.external_files:
        try:
            mode = os.stat(model_dir / name).st_mode
        except OSError:
            continue
        if not mode & stat.S_IROTH:
            add(
                Code.BLOB_NOT_WORLD_READABLE,
                [],
                f"{name} has mode {oct(mode & 0o777)}; other users (and services running as them) cannot map it",
            )
    bad = [p for p in inv.payloads if p.sha256 and p.recorded_sha256 and p.sha256 != p.recorded_sha256]
    if bad:
        add(
            Code.CHECKSUM_MISMATCH,
            bad,
            f"{len(bad)} payloads differ from the checksum recorded in the blob: {_names(bad)}",
        )
    return out


def check(
    paths: Sequence[str | os.PathLike[str]],
    gate: Gate | None = None,
    keep_going: bool = False,
    on_model: Callable[[str, int, int], None] | None = None,
) -> tuple[list[ModelInventory], list[Finding]]:
    """Inventory and findings of every model. A model that cannot be read raises its ``WeightshareError``, or with
    ``keep_going`` (the CLI's batch) is one ``unreadable-model`` finding, and the others are still checked.
    ``on_model(path, i, n)`` is called before the i-th of n models is read and measured (the CLI's stage line)."""
    from ._checksum import digests_kept
    from ._runtimes.memory import reused_children

    # one runtime child measures the models one after another (``in_worker``); a blob two models read (a --prepack
    # output and its portable twin) hashed once
    with reused_children(), digests_kept():
        return _check_each(paths, gate or Gate(), keep_going, on_model)


def _check_each(
    paths: Sequence[str | os.PathLike[str]],
    gate: Gate,
    keep_going: bool,
    on_model: Callable[[str, int, int], None] | None,
) -> tuple[list[ModelInventory], list[Finding]]:
    inventories, findings = [], []
    for i, path in enumerate(paths, 1):
        if on_model is not None:
            on_model(str(path), i, len(paths))
        try:
            inv = inventory(path, hash_payloads=True)
            if gate.measure:  # or the verdict measured for the same model and options (``_measure_cache``)
                reuse = _reuse_key(gate) if gate.cache else None
                measure_or_reuse(inv, path, gate.feeds, reuse, partial(settle, inv, gate, path))
        except UsageError:  # a --dim / --input the model does not have: the user's, not the model's
            raise
        except WeightshareError as e:
            if not keep_going:
                raise
            finding = Finding.of(Code.UNREADABLE_MODEL, str(path), e.message)
            if e.message == "no such file":  # nothing to replace: the path is wrong
                finding.fix = "check the path: no file is there"
            findings.append(finding)
            continue
        inventories.append(inv)
        findings += findings_for(inv, gate)
    return inventories, findings


def _reuse_key(gate: Gate) -> dict[str, object]:
    """What a measured verdict depends on of the gate: the repeats near a line follow the targets and threshold."""
    return {"targets": sorted(gate.targets), "threshold": gate.threshold}


def inspected(path: str | os.PathLike[str], hash_payloads: bool = True, measure: bool = True) -> ModelInventory:
    """`inspect`'s inventory, measured as `check` measures the model under its default gate (the repeats near a
    line included) and through the same cache: a model checked or inspected before is not measured again."""
    from ._runtimes.memory import reused_children

    inv = inventory(path, hash_payloads=hash_payloads)
    if measure:
        gate = Gate()
        with reused_children():
            measure_or_reuse(inv, path, gate.feeds, _reuse_key(gate), partial(settle, inv, gate, path))
    return inv
