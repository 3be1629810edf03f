"""`weightshare check`: is a model share-ready? One finding per problem kind and model."""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

from .blob import ALIGN_THRESHOLD, LARGE_ALIGN, SMALL_ALIGN
from .inventory import ModelInventory, inventory
from .options import INLINE_THRESHOLD


@dataclass
class Finding:
    model: str
    code: str
    message: str

    def line(self) -> str:
        return f"{self.model}: {self.code}: {self.message}"

    def to_dict(self) -> dict:
        return asdict(self)


def _names(payloads, limit: int = 3) -> str:
    shown = ", ".join(p.name for p in payloads[:limit])
    return shown + (f" and {len(payloads) - limit} more" if len(payloads) > limit else "")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _stored_twice(inv: ModelInventory, min_bytes: int) -> list:
    """External payloads of ``min_bytes`` or more whose bytes are already stored at another place (aliases of one
    place are fine; so are small repeats such as coremltools' zero biases, cheaper than a record of their own)."""
    where = {}
    for p in inv.payloads:
        if p.location == "external" and not p.duplicate_of:
            where.setdefault(p.name, (p.file, p.offset))
    return [p for p in inv.payloads if p.location == "external" and p.duplicate_of and p.offset is not None
            and p.nbytes >= min_bytes
            and where.get(p.duplicate_of, (p.file, p.offset)) != (p.file, p.offset)]


def findings_for(inv: ModelInventory, inline_threshold: int = INLINE_THRESHOLD) -> list[Finding]:
    out: list[Finding] = []
    model = Path(inv.model).resolve()
    model_dir = model if model.is_dir() else model.parent  # an .mlpackage: file names are relative to it

    def add(code: str, message: str) -> None:
        out.append(Finding(inv.model, code, message))

    embedded = [p for p in inv.payloads if p.location == "embedded" and p.nbytes >= inline_threshold
                and not p.stays_inline_because]
    if embedded:
        add("embedded-weights", f"{len(embedded)} payloads ({_mib(sum(p.nbytes for p in embedded))}) are embedded in "
            f"the model file and copied per session: {_names(embedded)}")
    unpacked = [p for p in inv.payloads if p.unpacked_at_load]
    if unpacked:
        add("unpacked-per-session", f"{len(unpacked)} payloads are unpacked by the runtime in every session "
            f"({unpacked[0].unpacked_at_load}): {_names(unpacked)}")
    unaligned = [p for p in inv.payloads if p.location == "external" and p.alignment is not None
                 and p.alignment < (LARGE_ALIGN if p.nbytes >= ALIGN_THRESHOLD else SMALL_ALIGN)]
    if unaligned:
        add("unaligned", f"{len(unaligned)} external payloads sit at offsets that are not page aligned "
            f"(64 KiB for >= 1 MiB, 64 B below): {_names(unaligned)}")
    stored = _stored_twice(inv, inline_threshold)
    if stored:
        add("duplicate-payloads", f"{len(stored)} external payloads ({_mib(sum(p.nbytes for p in stored))}) repeat "
            f"bytes already stored elsewhere in the blob: {_names(stored)}")
    for problem in sorted({p.problem for p in inv.payloads if p.problem}):
        code = "blob-outside-model-dir" if ("outside" in problem or "absolute" in problem or ".." in problem) \
            else "missing-external-file" if "missing" in problem else "bad-external-data"
        add(code, problem)
    for name in inv.external_files:
        try:
            mode = os.stat(model_dir / name).st_mode
        except OSError:
            continue
        if not mode & stat.S_IROTH:
            add("blob-not-world-readable", f"{name} has mode {oct(mode & 0o777)}; other users (and services "
                "running as them) cannot map it")
    bad = [p for p in inv.payloads if p.sha256 and p.recorded_sha256 and p.sha256 != p.recorded_sha256]
    if bad:
        add("checksum-mismatch", f"{len(bad)} payloads differ from the SHA-256 recorded in the blob: {_names(bad)}")
    return out


def check(paths: list[str | os.PathLike], inline_threshold: int = INLINE_THRESHOLD) -> tuple[list[ModelInventory],
                                                                                               list[Finding]]:
    inventories, findings = [], []
    for path in paths:
        inv = inventory(path, hash_payloads=True)
        inventories.append(inv)
        findings += findings_for(inv, inline_threshold)
    return inventories, findings
