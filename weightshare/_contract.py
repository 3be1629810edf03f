"""The machine contract: the JSON document every command prints with ``--json``, and `check --format github`'s
workflow annotations.

Every document (schema 2) has one body whatever the command (``document``): the envelope (``"schema": SCHEMA``,
``"command"``, ``"ok"``, ``"exit_code"``, ``"error"``), then ``reports`` (one record per model, whatever the command)
and ``findings``; ``check`` adds its ``gate`` and ``summary`` beside them (``TOP_LEVEL``). A failure before any
result (a usage error, a missing file) is the same document for every command: ``error`` the one line stderr shows,
``reports`` and ``findings`` empty. A key is never renamed or given another meaning within a schema version; new
keys may appear inside the records. The JSON Schema of each command's document ships in ``weightshare/schemas/``
(``schema_path``); docs/ci.md shows them and how schema 1 maps to 2, and tests validate every command's output
against them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ._checksum import split_digest
from ._findings import Code, Finding, Severity
from ._gate import exit_code
from ._paid import paid_scenarios
from .report import ConversionReport, JsonDict, ZooReport

if TYPE_CHECKING:
    from ._check import Gate
    from ._folder import FolderReport
    from ._inventory import ModelInventory
    from ._verify import VerifyReport

SCHEMA = 2
COMMANDS = ("convert", "merge", "inspect", "check", "verify", "bench", "demo")
ENVELOPE = ("schema", "command", "ok", "exit_code", "error")
BODY = ("reports", "findings")
# The only keys beside the envelope and the body: check's verdict over all its models.
EXTRA = {"check": ("gate", "summary")}


def top_level(command: str) -> tuple[str, ...]:
    """Every top-level key of ``command``'s document, in order (a usage error's document: ``ENVELOPE + BODY``)."""
    return ENVELOPE + BODY + EXTRA.get(command, ())


def document(
    command: str,
    exit_code: int,
    reports: Sequence[JsonDict],
    findings: Sequence[Finding] = (),
    error: str | None = None,
    **extra: object,
) -> JsonDict:
    """The one body every ``--json`` document has: the envelope, ``reports`` (one record per model), ``findings``,
    and only the command's own extra keys (``EXTRA``)."""
    if set(extra) - set(EXTRA.get(command, ())):
        raise ValueError(f"{command} documents have no {sorted(set(extra) - set(EXTRA.get(command, ())))}")
    return {
        "schema": SCHEMA,
        "command": command,
        "ok": exit_code == 0,
        "exit_code": exit_code,
        "error": error,
        "reports": list(reports),
        "findings": [f.to_dict() for f in findings],
        **extra,
    }


def error_document(command: str, message: str, exit_code: int) -> JsonDict:
    """What ``--json`` prints when the command fails before it has a result: the one error line, as JSON, the
    same for every command."""
    return document(command, exit_code, [], error=message)


def schema_path(command: str) -> Path:
    """The JSON Schema (draft 2020-12) of ``command``'s document, shipped with the package."""
    return Path(__file__).parent / "schemas" / f"{command}.schema.json"


def convert_document(result: ZooReport | FolderReport | list[ConversionReport]) -> JsonDict:
    """``convert --json``: every model's report under ``reports``, whether the run converted one model, a batch, a
    model folder or a zoo. Each record names the run it was part of: ``folder`` (what was copied beside the
    models) and ``zoo`` (the shared blob, the dedupe), the same object in every record of that run, else null."""
    from .report import ZooReport

    folder = zoo = None
    if isinstance(result, list):
        reports = result
    elif isinstance(result, ZooReport):
        reports = result.models
        zoo = {k: v for k, v in result.to_dict().items() if k != "models"}
        if result.folder:  # a model folder with one blob per directory: its tree and side files kept too
            folder = {
                "folder": result.folder,
                "copied": result.copied,
                "copied_bytes": result.copied_bytes,
                "notes": result.notes,
            }
    else:
        reports = result.models
        folder = {k: v for k, v in result.to_dict().items() if k != "models"}
    return document("convert", 0, [{**r.to_dict(), "folder": folder, "zoo": zoo} for r in reports])


def totals(reports: Sequence[ConversionReport]) -> JsonDict:
    """A run's sums over its models (peak RSS: the highest, the models share one process)."""
    return {
        "models": len(reports),
        "tensors_moved": sum(r.tensors_moved for r in reports),
        "bytes_in": sum(r.bytes_in for r in reports),
        "bytes_written": sum(r.bytes_written for r in reports),
        "blob_bytes": sum(r.blob_bytes for r in reports),
        "wall_time_s": round(sum(r.wall_time_s for r in reports), 3),
        "peak_rss_mib": max((r.peak_rss_mib for r in reports), default=0.0),
    }


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


def _model_summary(inv: ModelInventory, gate: Gate) -> JsonDict:
    return {
        "model": inv.model,
        "format": inv.format,
        "settings": list(inv.settings),
        "copied_per_session_by_setting": {s: inv.per_session(s) for s in inv.settings},
        # what the verdict was made of: the settings the gate held the model to
        "copies_source": inv.source_of(gate.targeted(inv)),
        "copies_source_by_setting": {s: inv.source_of([s]) for s in inv.settings},
        "fallback_of": inv.fallback_of,
        "default_setting": inv.default_setting,
        "activation_per_session_by_setting": dict(inv.measured_activation),
        "measure_notes": list(inv.measure_notes),  # how the figures were made (text output: on stderr)
        "measured_cached": inv.measured_cached,  # a reused verdict's measuring time, "" when measured now or not
        "packed_for": dict(inv.packed_for),  # a --prepack output's envelope (version, CPU kind); {} for others
        "judged_for": next((n for n in inv.notes if n.startswith(("judged for", "not judged for"))), ""),
        # what a user pays, converted vs original (check --instances / --processes)
        "paid": [p.to_dict() for p in paid_scenarios(inv, gate.instances, gate.processes)],
    }


def check_document(
    inventories: Sequence[ModelInventory], findings: Sequence[Finding], gate: Gate, strict: bool
) -> JsonDict:
    code = exit_code(findings, strict)
    count = {s.value: sum(1 for f in findings if f.severity == s) for s in Severity}
    unreadable = [f.file for f in findings if f.code == Code.UNREADABLE_MODEL]
    return document(
        "check",
        code,
        [_model_summary(i, gate) for i in inventories] + [_unreadable(f) for f in unreadable],
        findings,
        error=unreadable_line(findings) or None,
        gate={"targets": list(gate.targets), "threshold": gate.threshold, "strict": strict, "runtime": gate.runtime},
        summary={"models": len(inventories) + len(unreadable), **count},
    )


def unreadable_lines(findings: Sequence[Finding]) -> list[str]:
    """check's error lines (stderr, after ``weightshare: error: ``): one per model it could not read, the others
    checked all the same."""
    return [
        f"no such file: {f.file}" if f.message == "no such file" else f"{f.file}: {f.message}"
        for f in findings
        if f.code == Code.UNREADABLE_MODEL
    ]


def unreadable_line(findings: Sequence[Finding]) -> str:
    """check's ``error``: its error lines as one ("" when every model was read)."""
    return "; ".join(unreadable_lines(findings))


def _unreadable(model: str) -> JsonDict:
    return {
        "model": model,
        "format": "",
        "settings": [],
        "copied_per_session_by_setting": {},
        "copies_source": "",
        "copies_source_by_setting": {},
        "fallback_of": "",
        "default_setting": "",
        "activation_per_session_by_setting": {},
        "measure_notes": [],
        "measured_cached": "",
        "packed_for": {},
        "judged_for": "",
        "paid": [],
    }


def inspect_document(inv: ModelInventory, findings: Sequence[Finding]) -> JsonDict:
    """One model's inventory as its one record, and check's findings for it."""
    return document("inspect", 0, [inventory_dict(inv)], findings)


def verify_document(report: VerifyReport, strict: bool = False) -> JsonDict:
    """The comparison as one record (``model``: the converted model it verified). ``strict`` (``verify
    --strict``): a partial comparison (``skipped`` runs) exits 1."""
    return document("verify", report.exit_code(strict), [{"model": report.converted, **report.to_dict()}])


_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def _escape(text: str, property_: bool = False) -> str:
    """GitHub's workflow-command escaping (``%``, CR, LF; also ``:`` and ``,`` in properties)."""
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if property_ else text


def annotation(level: str, message: str, file: str | None = None, title: str | None = None) -> str:
    """One GitHub Actions workflow command: ``::error file=PATH,title=TITLE::MESSAGE`` (``level``: error, warning
    or notice), escaped so that a path or message with ``:``, ``,``, ``%`` or a newline stays one annotation."""
    props = [f"{key}={_escape(value, property_=True)}" for key, value in (("file", file), ("title", title)) if value]
    return f"::{level}{' ' + ','.join(props) if props else ''}::{_escape(message)}"


def github_annotations(findings: Sequence[Finding]) -> list[str]:
    """One ``::error file=...,title=...::message`` line per finding (GitHub Actions workflow commands)."""
    return [
        annotation(_LEVEL[f.severity], f"{f.message} (fix: {f.fix})", f.file, f"weightshare {f.code.value}")
        for f in findings
    ]


_SARIF_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def sarif_document(findings: Sequence[Finding]) -> JsonDict:
    """``check --format sarif``: the findings as a SARIF 2.1.0 log (GitHub code scanning and other SARIF viewers).
    One rule per finding code that occurs (its meaning and fix from the code table), one result per finding."""
    from ._findings import all_codes
    from ._version import __version__

    table = all_codes()
    codes = sorted({f.code for f in findings}, key=lambda c: c.value)
    rules = [
        {
            "id": code.value,
            "shortDescription": {"text": code.value},
            "fullDescription": {"text": table[code].meaning},
            "help": {"text": f"fix: {table[code].fix}"},
            "defaultConfiguration": {"level": _SARIF_LEVEL[table[code].severity]},
        }
        for code in codes
    ]
    results = [
        {
            "ruleId": f.code.value,
            "ruleIndex": codes.index(f.code),
            "level": _SARIF_LEVEL[f.severity],
            "message": {"text": f"{f.message} (fix: {f.fix})"},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": Path(f.file).as_posix()}}}],
            **({"properties": {"tensor": f.tensor}} if f.tensor else {}),
        }
        for f in findings
    ]
    driver = {"name": "weightshare", "version": __version__, "rules": rules}
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{"tool": {"driver": driver}, "results": results}],
    }
