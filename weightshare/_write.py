"""The one write path: payloads -> a container file -> placements, each payload accounted once.

Every format hands ``write_payloads`` the payloads it wants out of its model file and a *container*: the
layout strategy of the file they go into. Three exist:

- ``_safetensors.SafetensorsBlob``: the shared safetensors blob (ONNX, TFLite ``--external``, zoo mode), a JSON
  header in front, payloads at page-aligned absolute offsets;
- ``formats.tflite.convert.AppendedContainer``: payloads appended after a TFLite flatbuffer, which the
  format writes over the file's first bytes once the payloads have their offsets;
- ``formats.coreml.milblob.WeightFileWriter``: a Core ML weight.bin, a 64-byte record before each payload;
  what the model references is the record's offset.

All three stream through one ``_placement.BlobWriter`` (alignment, dedupe by content digest, kernel copies,
writeback). ``write_payloads`` returns ``Placements``: where each payload landed, by its position in the
order given, which the format's ``emit`` then takes as an argument. The report's payload counters are
filled here and nowhere else.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from ._placement import BlobEntry, PlannedTensor, Progress
from ._tensors import PayloadSource
from .errors import OutputError
from .report import ConversionReport


@dataclass(slots=True)
class BlobPayload:
    """One payload for a container. A format with 100,000s of payloads may subclass it with ``__slots__`` and make
    ``source`` a property, so that no source object exists before its payload is written."""

    tensor: PlannedTensor  # name, dtype, shape and size in the blob
    source: PayloadSource  # bytes in the runtime's native form
    nbytes_in: int  # size as found in the input (before unpacking)


class Container(Protocol):
    """Where payloads go: one file's layout. ``place`` writes (or finds a stored copy of) one payload and says
    where the model must point: for a duplicate, at the first copy, with ``duplicate`` set."""

    def place(self, payload: BlobPayload, progress: Progress | None = None) -> BlobEntry: ...


class Placements:
    """Where each payload landed, by position in the order written: two flat arrays, not an object per payload."""

    __slots__ = ("_lengths", "_offsets")

    def __init__(self) -> None:
        self._offsets = array("q")
        self._lengths = array("q")

    def __len__(self) -> int:
        return len(self._offsets)

    def append(self, entry: BlobEntry) -> None:
        self._offsets.append(entry.offset)
        self._lengths.append(entry.nbytes)

    def offset(self, i: int) -> int:
        """Where payload ``i`` starts in its container file (for Core ML: its record)."""
        return self._offsets[i]

    def nbytes(self, i: int) -> int:
        return self._lengths[i]


def account(report: ConversionReport, nbytes_in: int, entry: BlobEntry) -> None:
    """The report's payload counters for one placed payload (see ``ConversionReport``)."""
    report.tensors_moved += 1
    report.bytes_in += nbytes_in
    report.bytes_out += entry.nbytes
    if entry.duplicate:
        report.deduplicated += 1
        report.deduplicated_bytes += entry.nbytes
    else:
        report.bytes_written += entry.nbytes


def write_payloads(
    container: Container, payloads: Iterable[BlobPayload], report: ConversionReport, progress: Progress | None = None
) -> Placements:
    """Place every payload, in order; account each in ``report``; return where each landed.

    ``payloads`` may be a generator: Core ML chooses its next payload from where the last one ended.
    """
    placements = Placements()
    for p in payloads:
        entry = container.place(p, progress)
        if entry.nbytes != p.tensor.nbytes:  # a container writes what the plan says or fails; anything else is a bug
            raise OutputError(f"payload {p.tensor.name!r}: {entry.nbytes} bytes placed, {p.tensor.nbytes} planned")
        placements.append(entry)
        account(report, p.nbytes_in, entry)
        release = getattr(p.source, "release", None)  # a staged source whose bytes are no longer needed
        if release is not None:
            release()
    return placements
