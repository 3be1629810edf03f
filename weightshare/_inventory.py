"""What a model's weights cost: where every payload lives, and what a runtime copies per session.

One report model for every format (``ModelInventory``); each format fills it in
its own ``inventory`` module. ``inspect`` renders it, ``check`` turns it into
findings, ``verify`` re-hashes what it records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ._checksum import digest_of, file_range_digest, split_digest
from ._findings import Finding
from ._tensors import CHUNK_SIZE, FileRange, PayloadSource
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
    copy_fix: str = ""  # what removes that copy, when it is not the code's own fix (an opt-in --unpack)
    sha256: str = ""
    recorded_sha256: str = ""  # from the blob's metadata, when it has one
    duplicate_of: str = ""
    problem: str = ""  # a problem found while locating the payload (missing file, escape, ...)
    problem_code: str = ""  # findings.Code value of ``problem``, set where it was detected
    would_move: bool = False  # `convert` would move it to the blob
    stays_inline_because: str = ""
    used_as_shape: bool = False  # an integer tensor the graph reads as a shape or axes: a constant, never a weight


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
    # When the figures are a verdict measured earlier and reused (``check``'s cache): that measurement's UTC time
    # (ISO 8601); "" when measured in this run or not at all.
    measured_cached: str = ""
    # Setting -> activation memory one more session keeps (a runtime's arena, kernel scratch), measured apart from
    # ``measured`` (formats that can tell them apart): information, never a weight copy.
    measured_activation: dict[str, int] = field(default_factory=dict)
    # The setting the runtime uses when the user does nothing (``check``'s target when none is named), and how
    # the model is opened there when weightshare made it for a loader ("" for a plain runtime default).
    default_setting: str = ""
    default_how: str = ""
    # A ``convert --prepack`` output: the runtime's packed copies are in its blob or cache already.
    prepack_output: bool = False
    # The envelope a packed model is exact in ("runtime", "version", "cpu_kind", "packed_bytes": what each session
    # pre-packs for itself outside it), and the same facts of the runtime installed here (empty: none).
    packed_for: dict[str, str] = field(default_factory=dict)
    runtime_here: dict[str, str] = field(default_factory=dict)
    # What a user pays, measured (formats whose loader has a cost of its own: TFLite's ``weightshare.litert``):
    # role ("converted": through the loader; "original": the same weights at the runtime's default) -> {"setting",
    # "one_process": PSS bytes of one process with 1, 2, ... instances, "two_processes": PSS bytes of two processes
    # with one instance each, alive at once}; empty when not measured.
    paid: JsonDict = field(default_factory=dict)

    @property
    def copies_source(self) -> str:
        """How the figure of the setting the model is held to by default was made (``source_of``)."""
        return self.source_of([self.default_setting] if self.default_setting else self.settings[:1])

    def source_of(self, settings: list[str]) -> str:
        """ "measured" when the runtime measured every one of ``settings``, "static" when none (the static rules'
        estimate), "partly measured" between: a figure is called measured only when it was."""
        done = [s for s in settings if s in self.measured]
        if not settings:
            return "measured" if self.measured else "static"
        return "measured" if len(done) == len(settings) else "partly measured" if done else "static"

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
            copies_source_by_setting={s: self.source_of([s]) for s in self.settings},
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
    kind = split_digest(like)[0] if like else "sha256"
    if isinstance(source, FileRange):
        fd = source.file.fd if source.file is not None else None
        return file_range_digest(source.path, source.offset, source.length, kind, lambda: source.chunks(CHUNK_SIZE), fd)
    return digest_of(source.chunks(CHUNK_SIZE), kind)


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


# What a measure note says of a setting's figure that the runtime itself saved at conversion instead of being measured
# again (a ``--prepack`` output's portable twin at default options: its packed model's packings); `check` then says
# so instead of "measured"
NOT_MEASURED_AGAIN = "not measured again"


def known_how(measure_notes: list[str], setting: str) -> str:
    """How a setting's figure is known: "measured", or that the runtime saved it at conversion."""
    if any(n.startswith(f"{setting}: ") and NOT_MEASURED_AGAIN in n for n in measure_notes):
        return "what the runtime saved of its packings at conversion, not measured again"
    return "measured"


@dataclass(frozen=True)
class MeasureInputs:
    """What the user told ``check`` about a model's inputs (``--dim NAME=N``, ``--input NAME=FILE``), handed to
    the measuring child, which makes the rest as ``verify`` does."""

    dims: tuple[tuple[str, int], ...] = ()
    input_files: tuple[tuple[str, str], ...] = ()


def judge_envelope(inv: ModelInventory, runtime: str = "") -> tuple[str | None, str]:
    """(the problem, or None; a note) of a packed model judged for ``runtime`` (``VERSION[/CPU_KIND]``, check's
    ``--runtime``) or, without it, for the runtime installed here (``inv.runtime_here``)."""
    made = inv.packed_for
    if not made:
        return None, ""
    if runtime:
        version, _, kind = runtime.partition("/")
        judged, where = {"version": version, "cpu_kind": kind}, "--runtime"
    else:
        judged, where = inv.runtime_here, "this machine"
    rt = made["runtime"]
    if not judged:
        return None, f"not judged for a runtime: {rt} is not installed here (--runtime names one)"
    keys = [k for k in ("version", "cpu_kind") if judged.get(k)]
    runs = " on ".join(judged[k] for k in keys)
    if all(judged[k] == made[k] for k in keys):
        return None, f"judged for {rt} {runs} ({where}), the runtime it was packed for"
    cost = int(made.get("packed_bytes", "0")) / 2**20
    return (
        f"packed for {rt} {made['version']} on {made['cpu_kind']}; {where} runs {rt} {runs}: weightshare's loader "
        f"opens the portable model there (+{cost:.1f} MiB per session, pre-packed by each), and a plain session "
        "of this file computes what was never verified"
    ), ""
