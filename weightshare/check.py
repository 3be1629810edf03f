"""`weightshare check`: is a model share-ready? One finding per problem kind and model.

Reads the inventory, where each format recorded what it found (payload problems carry
their code from where they were detected); never classifies by message text.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

from .blob import ALIGN_THRESHOLD, LARGE_ALIGN, SMALL_ALIGN
from .findings import Code, Finding
from .formats import model_suffixes
from .inventory import ModelInventory, PayloadInfo, inventory
from .options import INLINE_THRESHOLD


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


def _copies(inv: ModelInventory, add: Callable[[Code, list[PayloadInfo], str], None], inline_threshold: int) -> None:
    """What a runtime copies per session: embedded payloads, unpacking, and the per-setting copies that each
    format's inventory marked with their code (``PayloadInfo.copy_code``) where it derived them."""
    embedded = [
        p
        for p in inv.payloads
        if p.location == "embedded" and p.nbytes >= inline_threshold and not p.stays_inline_because
    ]
    if embedded and inv.format == "tflite":  # mapped with the file: shared, only badly aligned (measured)
        add(
            Code.INLINE_UNALIGNED,
            embedded,
            f"{len(embedded)} payloads ({_mib(sum(p.nbytes for p in embedded))}) "
            f"are inline in the flatbuffer: shared by interpreters without delegate, but only 16-byte aligned: "
            f"{_names(embedded)}",
        )
    elif embedded:
        add(
            Code.EMBEDDED_WEIGHTS,
            embedded,
            f"{len(embedded)} payloads ({_mib(sum(p.nbytes for p in embedded))}) "
            f"are embedded in the model file and copied per session: {_names(embedded)}",
        )
    unpacked = [p for p in inv.payloads if p.unpacked_at_load]
    if unpacked:
        add(
            Code.UNPACKED_PER_SESSION,
            unpacked,
            f"{len(unpacked)} payloads are unpacked by the runtime in every "
            f"session ({unpacked[0].unpacked_at_load}): {_names(unpacked)}",
        )
    by_code: dict[str, list[PayloadInfo]] = {}
    for p in inv.payloads:
        if p.copy_code:
            by_code.setdefault(p.copy_code, []).append(p)
    for code, payloads in by_code.items():
        worst = {s: sum(p.copies.get(s, 0) for p in payloads) for s in inv.settings}
        where = ", ".join(f"{_mib(n)} under {s}" for s, n in worst.items())
        add(
            Code(code),
            payloads,
            f"{len(payloads)} payloads ({_mib(sum(p.nbytes for p in payloads))}): "
            f"{payloads[0].copy_reason}; copied per session: {where}: {_names(payloads)}",
        )


def findings_for(inv: ModelInventory, inline_threshold: int = INLINE_THRESHOLD) -> list[Finding]:
    out: list[Finding] = []
    model = Path(inv.model).resolve()
    model_dir = model if model.is_dir() else model.parent  # an .mlpackage: file names are relative to it

    def add(code: Code, payloads: list[PayloadInfo], message: str) -> None:
        out.append(Finding.of(code, inv.model, message, payloads[0].name if payloads else ""))

    out += inv.findings
    _copies(inv, add, inline_threshold)
    unaligned = [
        p
        for p in inv.payloads
        if p.location == "external"
        and p.alignment is not None
        and p.alignment < (LARGE_ALIGN if p.nbytes >= ALIGN_THRESHOLD else SMALL_ALIGN)
    ]
    if unaligned:
        add(
            Code.UNALIGNED,
            unaligned,
            f"{len(unaligned)} external payloads sit at offsets that are not page "
            f"aligned (64 KiB for >= 1 MiB, 64 B below): {_names(unaligned)}",
        )
    stored = _stored_twice(inv, inline_threshold)
    if stored:
        add(
            Code.DUPLICATE_PAYLOADS,
            stored,
            f"{len(stored)} external payloads ({_mib(sum(p.nbytes for p in stored))})"
            f" repeat bytes already stored elsewhere in the blob: {_names(stored)}",
        )
    by_problem: dict[str, list[PayloadInfo]] = {}
    for p in inv.payloads:
        if p.problem:
            by_problem.setdefault(p.problem_code or Code.BAD_EXTERNAL_DATA.value, []).append(p)
    for code, payloads in sorted(by_problem.items()):
        more = f" (and {len(payloads) - 1} more payloads)" if len(payloads) > 1 else ""
        add(Code(code), payloads, payloads[0].problem + more)
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


def find_models(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files as given; directories searched recursively (sorted), an ``.mlpackage`` being a model, not a folder;
    unexpanded globs expanded."""
    import glob

    suffixes = model_suffixes()
    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir() and path.suffix not in suffixes:
            for root, dirs, files in os.walk(path):
                packages = sorted(d for d in dirs if Path(d).suffix in suffixes)  # a model package, not a folder
                dirs[:] = sorted(d for d in dirs if Path(d).suffix not in suffixes)  # walk the rest, in order
                here = Path(root)
                found += sorted([here / f for f in files if Path(f).suffix in suffixes] + [here / d for d in packages])
        elif not path.exists() and glob.has_magic(str(item)):
            found += sorted(Path(p) for p in glob.glob(str(item)))
        else:
            found.append(path)
    return found


def check(
    paths: Sequence[str | os.PathLike[str]], inline_threshold: int = INLINE_THRESHOLD
) -> tuple[list[ModelInventory], list[Finding]]:
    inventories, findings = [], []
    for path in paths:
        inv = inventory(path, hash_payloads=True)
        inventories.append(inv)
        findings += findings_for(inv, inline_threshold)
    return inventories, findings
