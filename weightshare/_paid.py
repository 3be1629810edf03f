"""What a user pays for a converted model opened through its loader, against the original at the runtime's default.

A format whose loader has a cost of its own (TFLite's ``weightshare.litert``: CompiledModel's state per process)
measures, in fresh processes, what the model and its runtime add with 1 and 4 instances in one process and with 2
processes alive at once (``ModelInventory.paid``). From those figures: the PSS of other configurations (shared
pages once, each process's own pages, each further instance's growth; labelled extrapolated), the break-even,
and ``check``'s finding.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._findings import Code, Severity
from ._inventory import ModelInventory
from .report import JsonDict

__all__ = ["Paid", "paid_scenarios", "paid_verdict"]

ROLES = ("converted", "original")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class Paid:
    """PSS of ``processes`` processes running ``instances`` instances (spread evenly), through the loader the
    conversion was made for ("converted") and at the runtime's default ("original"); ``extrapolated``: not a
    measured configuration (measured: 1 to 4 instances in one process, and 2 processes with one each)."""

    instances: int
    processes: int
    converted: int
    original: int
    extrapolated: bool

    def to_dict(self) -> dict[str, object]:
        return {
            "instances": self.instances,
            "processes": self.processes,
            "converted": self.converted,
            "original": self.original,
            "extrapolated": self.extrapolated,
        }


def _pss(figures: JsonDict, instances: int, processes: int) -> tuple[int, bool]:
    """PSS of ``processes`` processes with ``instances`` instances in all, from the measured ones: the figure itself
    where it was measured, else shared pages once plus each process's own (what the second process added) plus
    each further instance's growth."""
    one = {int(k): int(v) for k, v in figures["one_process"].items()}
    two = int(figures["two_processes"])
    if processes == 1 and instances in one:
        return one[instances], False
    if processes == 2 and instances == 2:
        return two, False
    first, last = min(one), max(one)
    growth = (one[last] - one[first]) / (last - first) if last > first else 0.0
    single = one[first] - (first - 1) * growth  # one process with one instance
    own = two - single  # a process's own pages: the second process's PSS less what it shares with the first
    shared = single - own
    return int(shared + processes * own + (instances - processes) * growth), True


def paid_scenarios(inv: ModelInventory, instances: int = 4, processes: int = 2) -> list[Paid]:
    """What a user pays in two configurations: ``instances`` in one process, ``processes`` processes with one
    instance each (``check --instances/--processes``); [] when the format measured no loader of its own."""
    if not {"converted", "original"} <= inv.paid.keys():
        return []
    out = []
    for count, procs in ((instances, 1), (processes, processes)):
        conv, guessed = _pss(inv.paid["converted"], count, procs)
        orig, guessed_too = _pss(inv.paid["original"], count, procs)
        out.append(Paid(count, procs, conv, orig, guessed or guessed_too))
    return out


def _break_even(inv: ModelInventory, per_process: bool, limit: int = 4096) -> int | None:
    """The fewest instances in one process (or processes with one instance each) at which the conversion costs
    no more than the original; None within ``limit``."""
    for n in range(1, limit + 1):
        shape = (n, n) if per_process else (n, 1)
        if _pss(inv.paid["converted"], *shape)[0] <= _pss(inv.paid["original"], *shape)[0]:
            return n
    return None


def paid_verdict(inv: ModelInventory, instances: int, processes: int) -> tuple[Code, str, Severity] | None:
    """What a user pays converted (through its loader, fixed cost per process included) against the original, as
    ``check``'s finding: a warning where the conversion costs more, with the break-even; else the figures, as
    information; None when not measured."""
    scenarios = paid_scenarios(inv, instances, processes)
    if not scenarios:
        return None
    conv_setting, orig_setting = inv.paid["converted"]["setting"], inv.paid["original"]["setting"]

    def where(p: Paid) -> str:
        what = f"{p.instances} instances in one process" if p.processes == 1 else f"{p.processes} processes"
        label = " (extrapolated from 1 and 4 instances and 2 processes)" if p.extrapolated else ""
        return f"{what}: {_mib(p.converted)} converted vs {_mib(p.original)} original{label}"

    figures = "; ".join(where(p) for p in scenarios)
    head = (
        f"what a user pays (PSS the model and its runtime add to the processes, measured; converted: as "
        f"{conv_setting} opens it, its fixed cost per process included; original: the same weights under "
        f"{orig_setting}): {figures}"
    )
    if not any(p.converted > p.original for p in scenarios):
        return Code.WHAT_IT_COSTS, head, Severity.INFO
    even = []
    for per_process, what in ((False, "instances in one process"), (True, "processes")):
        n = _break_even(inv, per_process)
        if n:
            even.append(f"from {n} {what}")
            continue
        extra = [_pss(inv.paid[r], *((2, 2) if per_process else (2, 1)))[0] - _pss(inv.paid[r], 1, 1)[0] for r in ROLES]
        even.append(f"never by adding {what} (each adds {_mib(extra[0])} converted vs {_mib(extra[1])} original)")
    return (
        Code.COSTS_MORE,
        f"{head}: the conversion costs more; break-even: {' or '.join(even)} (extrapolated beyond the measured)",
        Severity.WARNING,
    )
