"""The machine contract: the JSON documents `check`, `inspect` and `verify` print with ``--json``, and
`check --format github`'s workflow annotations.

Every document carries ``"schema": SCHEMA`` and ``"command"``, and has the same top-level keys whatever the
number of models. A key is never renamed or given another meaning within a schema version; new keys may appear.
docs/ci.md shows the schema and an example, which a test keeps in step with this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._checksum import split_digest
from ._findings import Code, Finding, Severity
from .report import JsonDict

if TYPE_CHECKING:
    from ._check import Gate
    from ._inventory import ModelInventory
    from ._verify import VerifyReport

SCHEMA = 1


def setting_ids() -> tuple[str, ...]:
    """Stable ids of the runtime settings an inventory reports copies under (``ModelInventory.settings``) and
    `check --target` takes: every registered format's ``Format.settings``."""
    from .formats import registered

    return tuple(s for fmt in registered() for s in fmt.settings)


def tagged_digest(digest: str) -> str:
    """``kind:hex`` for any digest weightshare records ("" stays ""): SHA-256 ones are stored bare."""
    if not digest:
        return ""
    kind, value = split_digest(digest)
    return f"{kind}:{value}"


def inventory_dict(inv: ModelInventory) -> JsonDict:
    """``ModelInventory.to_dict`` with digest fields named by what they hold."""
    d = inv.to_dict()
    for p in d["payloads"]:
        p["digest"] = tagged_digest(p.pop("sha256"))
        p["recorded_digest"] = tagged_digest(p.pop("recorded_sha256"))
    return d


def _model_summary(inv: ModelInventory) -> JsonDict:
    return {
        "model": inv.model,
        "format": inv.format,
        "settings": list(inv.settings),
        "copied_per_session_by_setting": {s: inv.per_session(s) for s in inv.settings},
        "copies_source": inv.copies_source,
        "fallback_of": inv.fallback_of,
        "default_setting": inv.default_setting,
        "activation_per_session_by_setting": dict(inv.measured_activation),
    }


def exit_code(findings: Sequence[Finding], strict: bool) -> int:
    """2 when a model could not be read, 1 when a finding fails the gate, else 0."""
    if any(f.code == Code.UNREADABLE_MODEL for f in findings):
        return 2
    failing = {Severity.ERROR, Severity.WARNING} if strict else {Severity.ERROR}
    return 1 if any(f.severity in failing for f in findings) else 0


def check_document(
    inventories: Sequence[ModelInventory], findings: Sequence[Finding], gate: Gate, strict: bool
) -> JsonDict:
    code = exit_code(findings, strict)
    count = {s.value: sum(1 for f in findings if f.severity == s) for s in Severity}
    unreadable = [f.file for f in findings if f.code == Code.UNREADABLE_MODEL]
    return {
        "schema": SCHEMA,
        "command": "check",
        "ok": code == 0,
        "exit_code": code,
        "gate": {"targets": list(gate.targets), "threshold": gate.threshold, "strict": strict},
        "models": [_model_summary(i) for i in inventories] + [_unreadable(f) for f in unreadable],
        "findings": [f.to_dict() for f in findings],
        "summary": {"models": len(inventories) + len(unreadable), **count},
    }


def _unreadable(model: str) -> JsonDict:
    return {
        "model": model,
        "format": "",
        "settings": [],
        "copied_per_session_by_setting": {},
        "copies_source": "",
        "fallback_of": "",
        "default_setting": "",
        "activation_per_session_by_setting": {},
    }


def inspect_document(inv: ModelInventory, findings: Sequence[Finding]) -> JsonDict:
    """One model's inventory, its keys at the top level next to the schema, and check's findings for it."""
    return {"schema": SCHEMA, "command": "inspect", **inventory_dict(inv), "findings": [f.to_dict() for f in findings]}


def verify_document(report: VerifyReport) -> JsonDict:
    return {"schema": SCHEMA, "command": "verify", **report.to_dict()}


_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def _escape(text: str, property_: bool = False) -> str:
    """GitHub's workflow-command escaping (``%``, CR, LF; also ``:`` and ``,`` in properties)."""
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if property_ else text


def github_annotations(findings: Sequence[Finding]) -> list[str]:
    """One ``::error file=...,title=...::message`` line per finding (GitHub Actions workflow commands)."""
    lines = []
    for f in findings:
        title = _escape(f"weightshare {f.code.value}", property_=True)
        message = _escape(f"{f.message} (fix: {f.fix})")
        lines.append(f"::{_LEVEL[f.severity]} file={_escape(f.file, property_=True)},title={title}::{message}")
    return lines
