"""What a conversion did, in numbers a user can check."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ConversionReport", "JsonDict", "ZooReport"]

# A JSON object as ``json.dumps`` takes it: values are numbers, strings, lists and nested objects.
JsonDict = dict[str, Any]


@dataclass
class ConversionReport:
    """Filled in by a format converter; rendered by the CLI (table or ``--json``).

    Byte counts are payload bytes: ``bytes_in`` as found in the input (packed),
    ``bytes_out`` as placed in the blob after unpacking (before dedupe), and
    ``bytes_written`` the unique bytes actually stored.
    """

    model: str
    format: str
    outputs: list[str] = field(default_factory=list)
    tensors_moved: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    bytes_written: int = 0
    deduplicated: int = 0  # payloads stored as a reference to an identical earlier one
    deduplicated_bytes: int = 0
    unpacked: int = 0  # payloads turned into the runtime's native form (fp16->fp32, typed fields -> raw)
    unpacked_bytes_in: int = 0
    unpacked_bytes_out: int = 0
    ops_removed: int = 0  # Cast / DEQUANTIZE nodes folded away
    inline_kept: int = 0  # payloads left inline (small, or shape tensors)
    inline_kept_bytes: int = 0
    blob_bytes: int = 0  # size of the blob file (payloads + alignment padding + header)
    wall_time_s: float = 0.0
    peak_rss_mib: float = 0.0
    notes: list[str] = field(default_factory=list)
    prepack: JsonDict = field(default_factory=dict)  # --prepack only: what ORT packed per op type, its child's peak

    def to_dict(self) -> JsonDict:
        d = asdict(self)
        if not self.prepack:
            del d["prepack"]  # other conversions' --json stays as it was
        return d


@dataclass
class ZooReport:
    """Many models, one blob: per-model reports and the totals that show the dedupe."""

    blob: str
    models: list[ConversionReport] = field(default_factory=list)
    blob_bytes: int = 0  # every blob's size (a model folder: one blob per directory holding models)
    wall_time_s: float = 0.0
    peak_rss_mib: float = 0.0
    blobs: list[str] = field(default_factory=list)  # ``blob`` and, for a model folder, each directory's
    folder: str = ""  # a model folder given alone: its tree was kept; what was copied unchanged
    copied: list[str] = field(default_factory=list)
    copied_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_in(self) -> int:
        return sum(m.bytes_in for m in self.models)

    @property
    def bytes_out(self) -> int:
        return sum(m.bytes_out for m in self.models)

    @property
    def bytes_written(self) -> int:
        return sum(m.bytes_written for m in self.models)

    @property
    def dedupe_ratio(self) -> float:
        """Payload bytes referenced by the models / unique bytes stored."""
        return self.bytes_out / self.bytes_written if self.bytes_written else 1.0

    def to_dict(self) -> JsonDict:
        return {
            "blob": self.blob,
            "blob_bytes": self.blob_bytes,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "bytes_written": self.bytes_written,
            "dedupe_ratio": round(self.dedupe_ratio, 4),
            "wall_time_s": self.wall_time_s,
            "peak_rss_mib": self.peak_rss_mib,
            "blobs": self.blobs,
            "models": [m.to_dict() for m in self.models],
        }
