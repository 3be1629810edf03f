"""Findings as data: a stable code, a severity, where, what, and how to fix it.

A finding is created where the problem is detected (a format's inventory when it
locates a payload, ``check`` when it reads the inventory); ``check`` and ``inspect``
only render them. ``CODES`` is the one table of meanings and fixes; docs/ci.md
lists the same codes, and a test keeps the two in step.

Severity, by effect (``check.Gate``): ``error`` -- a copy that costs more than the
threshold (default 1 MiB) per session under a setting ``check`` targets, or a model
that is broken or gives wrong outputs: ``check`` exits 1. ``warning`` -- such a copy
under a setting not targeted (the fix names the setting that avoids it), or a layout
that works but is not optimal: ``check`` exits 1 only with ``--strict``. ``info`` --
a copy or layout issue below the threshold: never fails. ``CODES`` gives each code's
severity at full effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .errors import UnsafePath


class _StrEnum(str, Enum):
    """Compares and hashes like its value, so ``"unaligned" in {Code.UNALIGNED}`` holds."""

    def __hash__(self) -> int:
        return str.__hash__(self)

    def __str__(self) -> str:
        return str(self.value)


class Severity(_StrEnum):
    """An error fails ``check``; a warning (a copy that a runtime setting avoids) fails it only with --strict."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


class Code(_StrEnum):
    EMBEDDED_WEIGHTS = "embedded-weights"
    UNPACKED_PER_SESSION = "unpacked-per-session"
    MEASURED_COPY = "copied-per-session"
    ORT_NCHWC_COPY = "ort-nchwc-copy-per-session"
    ORT_PREPACK_COPY = "ort-prepack-copy-per-session"
    XNNPACK_PACK_COPY = "xnnpack-pack-copy-per-interpreter"
    INLINE_UNALIGNED = "inline-unaligned"
    UNALIGNED = "unaligned"
    DUPLICATE_PAYLOADS = "duplicate-payloads"
    BLOB_OUTSIDE_MODEL_DIR = "blob-outside-model-dir"
    MISSING_EXTERNAL_FILE = "missing-external-file"
    BAD_EXTERNAL_DATA = "bad-external-data"
    BLOB_NOT_WORLD_READABLE = "blob-not-world-readable"
    CHECKSUM_MISMATCH = "checksum-mismatch"
    BLOB_DIGEST_MISMATCH = "blob-digest-mismatch"
    BAD_PREPACKED_ENTRY = "bad-prepacked-entry"
    BAD_PREPACK_RECORD = "bad-prepack-record"
    UNREADABLE_MODEL = "unreadable-model"
    XNNPACK_CACHE_MISMATCH = "xnnpack-cache-mismatch"


@dataclass(frozen=True)
class CodeInfo:
    severity: Severity
    meaning: str
    fix: str


CODES: dict[Code, CodeInfo] = {
    Code.EMBEDDED_WEIGHTS: CodeInfo(
        Severity.ERROR,
        "Weights are stored inside the ONNX/Core ML model file; the runtime copies them into "
        "private memory in every session.",
        "weightshare convert MODEL -o OUT",
    ),
    Code.UNPACKED_PER_SESSION: CodeInfo(
        Severity.ERROR,
        "The runtime converts these weights in every session (ONNX Cast fp16->float constant "
        "folding, TFLite DEQUANTIZE or DENSIFY of a constant) into a private copy.",
        "weightshare convert MODEL -o OUT (stores the converted form in the blob)",
    ),
    Code.MEASURED_COPY: CodeInfo(
        Severity.ERROR,
        "Measured: one more session of this model costs this much private memory under the setting named (ONNX "
        "Runtime asked in a child process: PSS growth from 1 to 4 sessions, over 3). Whatever the cause (pre-packing, "
        "NCHWc, casts, a kernel inside a subgraph), each session pays it.",
        "convert with --prepack (packed copies in the blob), or load with session.disable_prepacking=1; the "
        "static findings listed with it say which weights",
    ),
    Code.ORT_NCHWC_COPY: CodeInfo(
        Severity.ERROR,
        "ONNX Runtime's NCHWc layout transformer (graph optimization level ORT_ENABLE_ALL, the "
        "default) copies these Conv weights into every session, even with session.disable_prepacking=1.",
        "convert with --prepack, or create sessions with graph_optimization_level=ORT_ENABLE_EXTENDED (and "
        "session.disable_prepacking=1)",
    ),
    Code.ORT_PREPACK_COPY: CodeInfo(
        Severity.WARNING,
        "With default session options ONNX Runtime (MLAS) pre-packs a private copy of every "
        "constant MatMul/Gemm B weight per session.",
        "create sessions with session.disable_prepacking=1, or convert with --prepack",
    ),
    Code.XNNPACK_PACK_COPY: CodeInfo(
        Severity.WARNING,
        "LiteRT's default XNNPACK delegate packs FULLY_CONNECTED/CONV weights into a private copy per interpreter.",
        "create interpreters with OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES, or "
        "use CompiledModel with an XNNPACK weight cache file",
    ),
    Code.INLINE_UNALIGNED: CodeInfo(
        Severity.WARNING,
        "TFLite buffers inside the flatbuffer are mapped with the file and shared, but only "
        "16-byte aligned: pages are shared partly, XNNPACK cannot map them.",
        "weightshare convert MODEL -o OUT",
    ),
    Code.UNALIGNED: CodeInfo(
        Severity.ERROR,
        "External payloads sit at offsets below the alignment their blob records (convert --align), else "
        "64 KiB for >= 1 MiB, 64 B below. A warning for ONNX (ONNX Runtime maps any offset); other formats: an "
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
    Code.BAD_PREPACKED_ENTRY: CodeInfo(
        Severity.ERROR,
        "A prepacked_N external-data entry of a --prepack model does not point at the packed copy the blob "
        "records for its tensor: ONNX Runtime refuses the model at load (ValidatePrePackedWeights) or maps "
        "another weight's packed bytes.",
        "re-run weightshare convert MODEL -o OUT --prepack from the original model",
    ),
    Code.BAD_PREPACK_RECORD: CodeInfo(
        Severity.ERROR,
        "The weightshare.ort_prepack record in the blob's metadata is malformed or names a model outside the "
        "model's directory: weightshare.ort.session refuses the model (no fallback).",
        "re-run weightshare convert MODEL -o OUT --prepack from the original model",
    ),
    Code.UNREADABLE_MODEL: CodeInfo(
        Severity.ERROR,
        "The file cannot be read as a model (truncated, corrupt, not a model): nothing in it was checked. "
        "The other models of the batch still are; `check` exits 2.",
        "replace the file with an intact copy",
    ),
    Code.XNNPACK_CACHE_MISMATCH: CodeInfo(
        Severity.ERROR,
        "An XNNPACK weight cache beside a TFLite model was built for other content (another "
        "model, blob or LiteRT version): LiteRT used with it directly would compute with the cached weights, "
        "not the model's.",
        "re-run weightshare convert MODEL -o OUT --prepack (builds the matching cache), or delete the stale cache file",
    ),
}


@dataclass
class Finding:
    """One problem ``check`` found: which code, in which file (and tensor), and the fix."""

    code: Code
    severity: Severity
    file: str  # the model (or package) the finding is about
    tensor: str  # the first tensor concerned, "" when the finding is about the file
    message: str
    fix: str

    @classmethod
    def of(cls, code: Code, file: str, message: str, tensor: str = "", severity: Severity | None = None) -> Finding:
        """``severity``: where the rule that found it weighed its effect (``check.Gate``); else the code's."""
        info = CODES[code]
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
