"""What a model's weights cost: where every payload lives, and what a runtime copies per session.

One report model for every format (``ModelInventory``); each format fills it in
its own ``inventory`` module. ``inspect`` renders it, ``check`` turns it into
findings, ``verify`` re-hashes what it records.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ._checksum import digest_of, split_digest
from ._findings import Code, Finding
from ._platform import require_posix
from ._recorded import blob_name_problem, record_problem, recorded_records
from ._tensors import CHUNK_SIZE, PayloadSource
from .formats import detect
from .report import JsonDict


@dataclass
class PayloadInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int  # bytes as stored
    location: str  # "embedded" (inside the model file) or "external"
    encoding: str = "raw"  # "raw", a typed protobuf field name, "sparse", ...
    file: str = ""  # external: the file, relative to the model directory
    offset: int | None = None  # absolute offset in ``file`` (or in the model file when embedded and known)
    alignment: int | None = None  # largest power of two dividing ``offset`` (capped at 1 MiB)
    unpacked_at_load: str = ""  # what the runtime materialises per session, e.g. "Cast fp16->float"
    copied_per_session: int = 0  # bytes copied to private memory per session under the sharing setting
    copies: dict[str, int] = field(default_factory=dict)  # runtime setting -> bytes copied per session
    copy_reason: str = ""  # why a setting copies it, e.g. "MLAS pre-packs MatMul B at default options"
    copy_code: str = ""  # findings.Code value of that copy, set by the rule that found it
    copy_bytes: dict[str, int] = field(default_factory=dict)  # runtime setting -> bytes that copy alone costs
    sha256: str = ""
    recorded_sha256: str = ""  # from the blob's metadata, when it has one
    duplicate_of: str = ""
    problem: str = ""  # a problem found while locating the payload (missing file, escape, ...)
    problem_code: str = ""  # findings.Code value of ``problem``, set where it was detected
    would_move: bool = False  # `convert` would move it to the blob
    stays_inline_because: str = ""


@dataclass
class ModelInventory:
    model: str
    format: str
    file_bytes: int
    payloads: list[PayloadInfo] = field(default_factory=list)
    external_files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Runtime settings whose per-session copies ``PayloadInfo.copies`` records; the first is the one that shares
    # most (what ``copied_per_session`` reports), the others are the runtime's defaults.
    settings: list[str] = field(default_factory=list)
    # Problems about the model as a whole that its format detected (not tied to one payload), as
    # ``_findings.Finding``; ``check`` reports them with the payload findings.
    findings: list[Finding] = field(default_factory=list)
    # Blob records no tensor references directly (e.g. ORT's pre-packed copies of ``--prepack``), re-hashed
    # when the inventory hashes payloads: how many, and one line per record that fails its recorded digest.
    records_hashed: int = 0
    record_problems: list[str] = field(default_factory=list)
    # A --prepack output's portable model: the prepacked model it is the fallback of ("" for any other model).
    fallback_of: str = ""
    # Setting -> bytes one more session costs, measured in the runtime (``inventory(measure=True)``, formats that
    # can: ONNX); empty when not measured, and ``measure_notes`` says why.
    measured: dict[str, int] = field(default_factory=dict)
    measured_one_session: dict[str, int] = field(default_factory=dict)  # setting -> PSS with one session
    measure_notes: list[str] = field(default_factory=list)
    # Setting -> activation memory one more session keeps (a runtime's arena, kernel scratch), measured apart from
    # ``measured`` (formats that can tell them apart): information, never a weight copy.
    measured_activation: dict[str, int] = field(default_factory=dict)
    # The setting the runtime uses when the user does nothing (``check``'s target when none is named), and how
    # the model is opened there when weightshare made it for a loader ("" for a plain runtime default).
    default_setting: str = ""
    default_how: str = ""
    # A ``convert --prepack`` output: the runtime's packed copies are in its blob or cache already.
    prepack_output: bool = False

    @property
    def copies_source(self) -> str:
        return "measured" if self.measured else "static"

    def per_session(self, setting: str) -> int:
        """Bytes one more session costs under ``setting``: measured when it was, else the static estimate."""
        return self.measured.get(setting, self.copied_under(setting))

    def copied_under(self, setting: str) -> int:
        return sum(p.copies.get(setting, p.copied_per_session) for p in self.payloads)

    @property
    def copied_per_session(self) -> int:
        return sum(p.copied_per_session for p in self.payloads)

    @property
    def embedded_bytes(self) -> int:
        return sum(p.nbytes for p in self.payloads if p.location == "embedded")

    @property
    def external_bytes(self) -> int:
        return sum(p.nbytes for p in self.payloads if p.location == "external")

    @property
    def duplicate_bytes(self) -> int:
        return sum(p.nbytes for p in self.payloads if p.duplicate_of)

    def to_dict(self) -> JsonDict:
        d = asdict(self)
        d.update(
            copied_per_session=self.copied_per_session,
            embedded_bytes=self.embedded_bytes,
            external_bytes=self.external_bytes,
            duplicate_bytes=self.duplicate_bytes,
            copied_per_session_by_setting={s: self.per_session(s) for s in self.settings},
            static_copied_per_session_by_setting={s: self.copied_under(s) for s in self.settings},
            copies_source=self.copies_source,
        )
        return d


def alignment_of(offset: int | None) -> int | None:
    if offset is None:
        return None
    if offset == 0:
        return 1 << 20
    return min(offset & -offset, 1 << 20)


def payload_digest(source: PayloadSource, like: str = "") -> str:
    """The payload's digest, SHA-256 unless ``like`` (a recorded digest) names another kind ("blake3:..."),
    so that it can be compared with that recorded digest."""

    return digest_of(source.chunks(CHUNK_SIZE), split_digest(like)[0] if like else "sha256")


def mark_duplicates(payloads: list[PayloadInfo]) -> None:
    first: dict[tuple[int, str], str] = {}
    for p in payloads:
        if not p.sha256:
            continue
        key = (p.nbytes, p.sha256)
        if key in first:
            p.duplicate_of = first[key]
        else:
            first[key] = p.name


@dataclass(frozen=True)
class MeasureInputs:
    """What the user told ``check`` about a model's inputs (``--dim NAME=N``, ``--input NAME=FILE``), handed to
    the measuring child, which makes the rest as ``verify`` does."""

    dims: tuple[tuple[str, int], ...] = ()
    input_files: tuple[tuple[str, str], ...] = ()


def inventory(
    path: str | os.PathLike[str], hash_payloads: bool = True, measure: bool = False, feeds: MeasureInputs | None = None
) -> ModelInventory:
    """Inventory of the model at ``path`` (format detected from the file). ``measure``: also measure what one more
    session costs per setting in the runtime itself, for formats that can (``measure_copies``), its runs' inputs
    as ``feeds`` say."""

    require_posix("reading a model")
    path = Path(path)
    fmt = detect(path)
    inv = fmt.inventory(path, hash_payloads)
    if hash_payloads:
        mark_duplicates(inv.payloads)
        _check_other_records(inv, path.resolve() if path.is_dir() else path.resolve().parent)
    measure_copies = getattr(fmt, "measure_copies", None)
    if measure and measure_copies is not None and not any(p.problem for p in inv.payloads):  # broken: not run
        # what the user said of the inputs, to a format that takes it (a format of its own may not: its inputs)
        measured = measure_copies(path, feeds) if feeds and (feeds.dims or feeds.input_files) else measure_copies(path)
        inv.measured, inv.measured_one_session, inv.measure_notes = measured[:3]
        if len(measured) > 3:  # a format that tells activation memory apart from weight copies
            inv.measured_activation = measured[3]
    return inv


def _check_other_records(inv: ModelInventory, base: Path) -> None:
    """Re-hash every blob record with a recorded digest that no payload of ``inv`` sits at, so that a flipped
    byte in a packed copy fails ``check`` and ``verify`` like one in a weight."""

    seen = {(p.file, p.offset, p.nbytes) for p in inv.payloads}
    bad: list[str] = []
    for name in inv.external_files:
        blob = base / name
        renamed = blob_name_problem(str(blob))
        if renamed:
            inv.record_problems.append(f"blob {name}: {renamed}")
            inv.findings.append(Finding.of(Code.BLOB_DIGEST_MISMATCH, inv.model, f"blob {name}: {renamed}"))
        for key, begin, length, digest in sorted(recorded_records(str(blob)), key=lambda r: r[1]):
            if (name, begin, length) in seen:
                continue
            seen.add((name, begin, length))
            inv.records_hashed += 1
            why = record_problem(str(blob), begin, length, digest, blob.stat().st_size)
            if why:
                inv.record_problems.append(f"blob record {key!r} in {name} at offset {begin}: {why}")
                bad.append(key)
    if inv.record_problems:
        more = f" and {len(inv.record_problems) - 1} more" if len(inv.record_problems) > 1 else ""
        inv.findings.append(
            Finding.of(Code.CHECKSUM_MISMATCH, inv.model, inv.record_problems[0] + more, bad[0] if bad else "")
        )
