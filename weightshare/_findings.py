"""Findings as data: a stable code, a severity, where, what, and how to fix it.

A finding is created where the problem is detected (a format's inventory when it
locates a payload, ``check`` when it reads the inventory); ``check`` and ``inspect``
only render them. ``CODES`` is the table of the format-neutral codes' meanings and
fixes; a format declares its own runtime's codes beside it (``Format.findings``, a
``TextEnum`` of its own), and ``all_codes`` joins them. docs/ci.md lists every code,
and a test keeps the two in step.

Severity, by effect (``_check.Gate``): ``error`` -- a copy that costs more than the
threshold (default 1 MiB) per session under a setting ``check`` targets, or a model
that is broken or gives wrong outputs: ``check`` exits 1. ``warning`` -- such a copy
under a setting not targeted (the fix names the setting that avoids it), or a layout
that works but is not optimal: ``check`` exits 1 only with ``--strict``. ``info`` --
a copy or layout issue below the threshold: never fails. ``CODES`` gives each code's
severity at full effect.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from .errors import UnsafePath


class TextEnum(str, Enum):
    """Compares and hashes like its value, so ``"unaligned" in {Code.UNALIGNED}`` holds."""

    def __hash__(self) -> int:
        return str.__hash__(self)

    def __str__(self) -> str:
        return str(self.value)


class Severity(TextEnum):
    """An error fails ``check``; a warning (a copy that a runtime setting avoids) fails it only with --strict."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


class Code(TextEnum):
    """The format-neutral finding codes; a format's own are in its folder (``Format.findings``)."""

    EMBEDDED_WEIGHTS = "embedded-weights"
    UNPACKED_PER_SESSION = "unpacked-per-session"
    MEASURED_COPY = "copied-per-session"
    ACTIVATION_MEMORY = "activation-per-session"
    COSTS_MORE = "costs-more-than-original"
    WHAT_IT_COSTS = "what-it-costs"
    INLINE_UNALIGNED = "inline-unaligned"
    UNALIGNED = "unaligned"
    DUPLICATE_PAYLOADS = "duplicate-payloads"
    BLOB_OUTSIDE_MODEL_DIR = "blob-outside-model-dir"
    MISSING_EXTERNAL_FILE = "missing-external-file"
    BAD_EXTERNAL_DATA = "bad-external-data"
    BLOB_NOT_WORLD_READABLE = "blob-not-world-readable"
    CHECKSUM_MISMATCH = "checksum-mismatch"
    BLOB_DIGEST_MISMATCH = "blob-digest-mismatch"
    UNREADABLE_MODEL = "unreadable-model"
    PACKED_FOR_OTHER_RUNTIME = "packed-for-other-runtime"
    RUNTIME_REFUSES_MODEL = "runtime-refuses-model"


@dataclass(frozen=True)
class CodeInfo:
    severity: Severity
    meaning: str
    fix: str


CODES: dict[TextEnum, CodeInfo] = {
    Code.EMBEDDED_WEIGHTS: CodeInfo(
        Severity.ERROR,
        "Weights are stored inside the model file, which the runtime parses (not maps): it copies them into "
        "private memory in every session.",
        "weightshare convert MODEL -o OUT",
    ),
    Code.UNPACKED_PER_SESSION: CodeInfo(
        Severity.ERROR,
        "The runtime converts these weights in every session (an fp16->float Cast folded as a constant, a "
        "DEQUANTIZE or DENSIFY of a constant) into a private copy.",
        "weightshare convert MODEL -o OUT (stores the converted form in the blob)",
    ),
    Code.MEASURED_COPY: CodeInfo(
        Severity.ERROR,
        "Measured: one more session of this model costs this much private memory under the setting named (the "
        "runtime asked in a child process: PSS growth from 1 to 4 sessions, over 3). Whatever the cause (pre-packing, "
        "a layout transform, casts, a kernel inside a subgraph), each session pays it.",
        "convert with --prepack (packed copies in the blob), or load with the setting that shares; the "
        "static findings listed with it say which weights and how",
    ),
    Code.COSTS_MORE: CodeInfo(
        Severity.WARNING,
        "Measured: N instances in one process, or M processes, cost more PSS through the loader the conversion "
        "was made for (its fixed cost per process: runtime state, mapped libraries and the file pages it reads) "
        "than the same weights at the runtime's default, which copies them per instance. Small models pay the "
        "fixed cost before sharing saves anything; the finding gives the break-even.",
        "below the break-even, serve the original at the runtime's default; above it the conversion pays",
    ),
    Code.WHAT_IT_COSTS: CodeInfo(
        Severity.INFO,
        "Measured: what N instances in one process and M processes cost (PSS of the processes) through the loader "
        "the conversion was made for, against the same weights at the runtime's default.",
        "none needed: the conversion costs less",
    ),
    Code.ACTIVATION_MEMORY: CodeInfo(
        Severity.INFO,
        "Measured: one more session keeps this much activation memory (the runtime's arena: inputs, intermediate "
        "tensors, kernel scratch) after a run. It is sized by the inputs, not the weights, and is not a copy of "
        "them: converting the model does not change it.",
        "none needed for sharing: it is working memory, not weights (the sessions of one process can share one "
        "arena: weightshare.ort.session(..., share_arena=True))",
    ),
    Code.INLINE_UNALIGNED: CodeInfo(
        Severity.WARNING,
        "Payloads inside the model file are mapped with the file and shared, but not page-aligned: "
        "pages are shared partly, and a runtime that maps aligned weights cannot map them.",
        "weightshare convert MODEL -o OUT",
    ),
    Code.UNALIGNED: CodeInfo(
        Severity.ERROR,
        "External payloads sit at offsets below the alignment their blob records (convert --align), else "
        "64 KiB for >= 1 MiB, 64 B below. A warning where the runtime maps any offset; otherwise an "
        "error from the threshold on.",
        "weightshare convert MODEL -o OUT (re-lays the blob)",
    ),
    Code.DUPLICATE_PAYLOADS: CodeInfo(
        Severity.ERROR,
        "External payloads repeat bytes already stored elsewhere: the same weights are mapped twice (an error "
        "from the threshold on, a warning below).",
        "weightshare convert MODEL -o OUT (stores identical payloads once)",
    ),
    Code.BLOB_OUTSIDE_MODEL_DIR: CodeInfo(
        Severity.ERROR,
        "An external data path is absolute, contains a '..' component or resolves outside the "
        "model directory; runtimes refuse it.",
        "keep external data files beside the model and reference them by a relative name",
    ),
    Code.MISSING_EXTERNAL_FILE: CodeInfo(
        Severity.ERROR,
        "A file the model references for its weights does not exist.",
        "ship the blob next to the model (copy the whole output directory)",
    ),
    Code.BAD_EXTERNAL_DATA: CodeInfo(
        Severity.ERROR,
        "An external reference is malformed: offset/length past the end of the file, a size "
        "that does not match the tensor, a bad record.",
        "re-run weightshare convert from the original model",
    ),
    Code.BLOB_NOT_WORLD_READABLE: CodeInfo(
        Severity.ERROR,
        "The blob's mode keeps other users (and services running as them) from mapping it.",
        "chmod a+r BLOB",
    ),
    Code.CHECKSUM_MISMATCH: CodeInfo(
        Severity.ERROR,
        "A payload differs from the checksum (BLAKE3; SHA-256 in older blobs) recorded in the "
        "blob: the blob was modified or corrupted.",
        "re-run weightshare convert from the original model; check the storage",
    ),
    Code.BLOB_DIGEST_MISMATCH: CodeInfo(
        Severity.ERROR,
        "The <digest12> in the blob's name (NAME.<digest12>.safetensors) is not the digest of its header, "
        "which lists every payload's checksum: the blob was rewritten after conversion (a payload overwritten "
        "and its checksum re-recorded) or another blob was renamed to this name.",
        "re-run weightshare convert from the original model",
    ),
    Code.PACKED_FOR_OTHER_RUNTIME: CodeInfo(
        Severity.ERROR,
        "A --prepack output was packed for another runtime version or CPU kind than the one it is judged for "
        "(this machine, or --runtime): its packed graph is exact only where it was made. weightshare's loader "
        "opens its portable model there (exact, each session pre-packing its own copy); a plain session of the "
        "packed file is outside what was verified.",
        "re-run convert --prepack on the serving machine's runtime, or pass --runtime VERSION/CPU_KIND when the "
        "machine running check is not the serving one",
    ),
    Code.UNREADABLE_MODEL: CodeInfo(
        Severity.ERROR,
        "The file cannot be read as a model (truncated, corrupt, not a model): nothing in it was checked. "
        "The other models of the batch still are; `check` exits 2.",
        "replace the file with an intact copy",
    ),
    Code.RUNTIME_REFUSES_MODEL: CodeInfo(
        Severity.ERROR,
        "The runtime check ran under refuses to load the model (an operator or domain it does not implement, an "
        "opset it does not know, a file made for another version): a server with this runtime cannot open it.",
        "convert from a model this runtime loads (or check under the runtime version that will serve it)",
    ),
}


@dataclass
class Finding:
    """One problem ``check`` found: which code, in which file (and tensor), and the fix."""

    code: TextEnum  # a ``Code``, or a format's own code (``Format.findings``)
    severity: Severity
    file: str  # the model (or package) the finding is about
    tensor: str  # the first tensor concerned, "" when the finding is about the file
    message: str
    fix: str

    @classmethod
    def of(cls, code: TextEnum, file: str, message: str, tensor: str = "", severity: Severity | None = None) -> Finding:
        """``severity``: where the rule that found it weighed its effect (``_check.Gate``); else the code's."""
        info = all_codes()[code]
        return cls(code, severity or info.severity, file, tensor, message, info.fix)

    def line(self) -> str:
        return f"{self.file}: {self.severity.value}: {self.code.value}: {self.message} (fix: {self.fix})"

    def to_dict(self) -> dict[str, str]:
        return {
            "code": self.code.value,
            "severity": self.severity.value,
            "file": self.file,
            "model": self.file,
            "tensor": self.tensor,
            "message": self.message,
            "fix": self.fix,
        }


def problem_code(error: Exception, file_exists: bool) -> Code:
    """The code of a payload-location error, from its type and the file's existence (never its wording)."""

    if isinstance(error, UnsafePath):
        return Code.BLOB_OUTSIDE_MODEL_DIR
    return Code.BAD_EXTERNAL_DATA if file_exists else Code.MISSING_EXTERNAL_FILE


_TABLES: list[Mapping[TextEnum, CodeInfo]] = []


def register_codes(table: Mapping[TextEnum, CodeInfo]) -> Mapping[TextEnum, CodeInfo]:
    """Make a format's own codes known to ``Finding.of`` and ``all_codes``; returns ``table``. Each format's
    findings module registers its table as it is defined, and the registry every registered ``Format.findings``
    (so this module never asks the registry: it sits below it)."""
    if not any(t is table for t in _TABLES):
        _TABLES.append(table)
    return table


def all_codes() -> Mapping[TextEnum, CodeInfo]:
    """Every finding code known: the format-neutral ``CODES`` and each registered format's ``Format.findings``
    (``formats.registered()`` registers every built-in format's)."""
    codes: dict[TextEnum, CodeInfo] = dict(CODES)
    for table in _TABLES:
        codes.update(table)
    return codes


def code_named(value: str) -> TextEnum:
    """The code whose value is ``value`` (``PayloadInfo.copy_code``, ``problem_code``), format codes included."""
    for code in all_codes():
        if code.value == value:
            return code
    raise KeyError(value)
