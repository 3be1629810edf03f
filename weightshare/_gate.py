"""The gate `check` runs: options checked, models found, each judged by ``_check``, and the exit code."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._check import Gate, check
from ._dispatch import find_models, load_input
from ._findings import Code, Finding, Severity
from ._inventory import ModelInventory
from .errors import UsageError
from .formats import registered

__all__ = ["GateResult", "exit_code", "run_gate", "setting_ids"]


@dataclass
class GateResult:
    """What one run of the gate found: every readable model's inventory, every finding, and the exit code."""

    inventories: list[ModelInventory]
    findings: list[Finding]
    exit_code: int

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def setting_ids() -> tuple[str, ...]:
    """Stable ids of the runtime settings an inventory reports copies under (``ModelInventory.settings``) and
    `check --target` takes: every registered format's ``Format.settings``."""
    return tuple(s for fmt in registered() for s in fmt.settings)


def exit_code(findings: Sequence[Finding], strict: bool) -> int:
    """2 when a model could not be read, 1 when a finding fails the gate, else 0."""
    if any(f.code == Code.UNREADABLE_MODEL for f in findings):
        return 2
    failing = {Severity.ERROR, Severity.WARNING} if strict else {Severity.ERROR}
    return 1 if any(f.severity in failing for f in findings) else 0


def run_gate(
    models: Sequence[str | os.PathLike[str]],
    gate: Gate,
    strict: bool = False,
    on_model: Callable[[str, int, int], None] | None = None,
) -> GateResult:
    """The one implementation of `check` behind the CLI and ``weightshare.check``: the gate's options checked,
    models found, each inventoried and judged (an unreadable one is an ``unreadable-model`` finding and the others
    are still checked), and the exit code (0 share-ready, 1 a failing finding, 2 an unreadable model). Raises
    ``UsageError`` for a bad option or no model found; the callers only render."""

    for t in gate.targets:
        if t not in setting_ids():
            raise UsageError(f"--target {t!r} is not a setting id ({', '.join(setting_ids())})")
    version, _, _kind = gate.runtime.partition("/")
    if gate.runtime and not all(part.isdigit() for part in version.split(".")):
        raise UsageError(f"--runtime takes VERSION[/CPU_KIND] (1.32.0/avx512), got {gate.runtime!r}")
    if gate.threshold < 0:
        raise UsageError("--threshold must not be negative")
    if gate.instances < 1 or gate.processes < 1:
        raise UsageError("--instances and --processes take a count of 1 or more")
    for name, value in gate.feeds.dims:
        if value < 0:
            raise UsageError(f"--dim takes NAME=VALUE with a non-negative integer, got {name}={value!r}")
    for name, file in gate.feeds.input_files:
        load_input(name, file)  # an unreadable file is a usage error here, before any model is measured
    paths = find_models(models)
    if not paths:
        raise UsageError("no models found")
    inventories, findings = check(paths, gate, keep_going=True, on_model=on_model)
    return GateResult(inventories, findings, exit_code(findings, strict))
