"""Core ML part of ``weightshare verify``: the programs match op for op and every weight decodes to the same bytes.

Core ML runs only on Apple platforms, so on Linux nothing is executed: the two
specs are compared field by field (functions, blocks, ops, their inputs, outputs
and attributes, and everything outside the program), ignoring only where each
``BlobFileValue`` points; then each pair of blob values is decoded by coremltools'
own reader (``_BlobStorageReader``, the code ``ct.models.MLModel`` loads weights
with on Linux) and the decoded elements must be identical. Decoding holds one
pair of payloads in memory at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from google.protobuf.message import Message

from ..._verify import VerifyReport
from ...errors import WeightshareError
from .convert import iter_blob_file_values
from .inventory import BlobLocator, blob_sites
from .milblob import BlobRecord, WeightFile
from .package import Package, quiet_coremltools, read_package

if TYPE_CHECKING:
    from coremltools.proto import MIL_pb2

_M = TypeVar("_M", bound=Message)

# MIL blob dtype -> _BlobStorageReader method; bfloat16 and the float8 types have none and are compared as bytes.
READERS = {
    1: "read_fp16_data",
    2: "read_float_data",
    3: "read_uint8_data",
    4: "read_int8_data",
    6: "read_int16_data",
    7: "read_uint16_data",
    8: "read_int4_data",
    9: "read_uint1_data",
    10: "read_uint2_data",
    11: "read_uint4_data",
    12: "read_uint3_data",
    13: "read_uint6_data",
    14: "read_int32_data",
    15: "read_uint32_data",
}
MAX_LINES = 50  # per kind of difference: one broken conversion should not print a line per op


def _blob_reader_class() -> Callable[[str], Any]:
    with quiet_coremltools():
        from coremltools.libmilstoragepython import _BlobStorageReader
    reader_class: Callable[[str], Any] = _BlobStorageReader
    return reader_class


def _without_blob_places(message: _M) -> _M:
    """A copy of ``message`` with every BlobFileValue's file and offset cleared: what convert may change."""
    copy = type(message)()
    copy.CopyFrom(message)
    for bfv in iter_blob_file_values(copy):
        bfv.fileName = ""
        bfv.offset = 0
    return copy


class _Differ:
    def __init__(self, report: VerifyReport):
        self.report = report
        self.lines = 0

    def add(self, line: str) -> None:
        self.lines += 1
        if self.lines <= MAX_LINES:
            self.report.mismatches.append(line)
        elif self.lines == MAX_LINES + 1:
            self.report.mismatches.append("... more program differences not listed")

    def fields(self, label: str, a: Message, b: Message, skip: tuple[str, ...] = ()) -> None:
        """One line per differing field of two messages of the same type (map fields: per key)."""
        for fd in a.DESCRIPTOR.fields:
            if fd.name in skip:
                continue
            va, vb = getattr(a, fd.name), getattr(b, fd.name)
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                for key in sorted(set(va) | set(vb)):
                    if key not in vb:
                        self.add(f"{label}: {fd.name} {key!r} is missing from the converted model")
                    elif key not in va:
                        self.add(f"{label}: {fd.name} {key!r} is not in the original model")
                    elif va[key] != vb[key]:
                        self.add(f"{label}: {fd.name} {key!r} differs")
            elif va != vb:
                self.add(f"{label}: {fd.name} differs")

    def block(self, label: str, a: MIL_pb2.Block, b: MIL_pb2.Block) -> None:
        self.fields(label, a, b, skip=("operations",))
        if len(a.operations) != len(b.operations):
            self.add(f"{label}: {len(a.operations)} ops in the original, {len(b.operations)} in the converted model")
        for i, (oa, ob) in enumerate(zip(a.operations, b.operations)):
            name = oa.outputs[0].name if oa.outputs else ""
            op_label = f"{label} op {i} ({oa.type} {name})".replace(" )", ")")
            self.fields(op_label, oa, ob, skip=("blocks",))
            if len(oa.blocks) != len(ob.blocks):
                self.add(
                    f"{op_label}: {len(oa.blocks)} nested blocks in the original, {len(ob.blocks)} in the "
                    "converted model"
                )
            for j, (ba, bb) in enumerate(zip(oa.blocks, ob.blocks)):
                self.block(f"{op_label} block {j}", ba, bb)

    def program(self, a: MIL_pb2.Program, b: MIL_pb2.Program) -> None:
        self.fields("program", a, b, skip=("functions",))
        for name in sorted(set(a.functions) | set(b.functions)):
            if name not in b.functions:
                self.add(f"function {name!r} is missing from the converted model")
            elif name not in a.functions:
                self.add(f"function {name!r} is not in the original model")
            else:
                fa, fb = a.functions[name], b.functions[name]
                self.fields(f"function {name!r}", fa, fb, skip=("block_specializations",))
                for opset in sorted(set(fa.block_specializations) | set(fb.block_specializations)):
                    if opset not in fa.block_specializations or opset not in fb.block_specializations:
                        self.add(f"function {name!r}: block {opset!r} is only in one of the models")
                    else:
                        self.block(
                            f"function {name!r} block {opset!r}",
                            fa.block_specializations[opset],
                            fb.block_specializations[opset],
                        )


class _Decoder:
    """Decoded elements of one blob value, through coremltools' reader (one reader per weight file)."""

    def __init__(self, locator: BlobLocator):
        self.locator = locator
        self._readers: dict[Path, object] = {}

    def locate(self, bfv: MIL_pb2.Value.BlobFileValue) -> tuple[Path, WeightFile, BlobRecord]:
        return self.locator.locate(bfv.fileName, bfv.offset)

    def decode(self, path: Path, rec: BlobRecord) -> np.ndarray | None:
        method = READERS.get(rec.dtype)
        if method is None:
            return None
        reader = self._readers.get(path)
        if reader is None:
            reader = self._readers[path] = _blob_reader_class()(str(path))
        return np.asarray(getattr(reader, method)(rec.offset))


def _same_stored_bytes(wf_a: WeightFile, rec_a: BlobRecord, wf_b: WeightFile, rec_b: BlobRecord) -> bool:
    if rec_a.nbytes != rec_b.nbytes:
        return False
    chunks_b = wf_b.payload(rec_b).chunks()
    pending = b""
    for chunk in wf_a.payload(rec_a).chunks():
        mine = bytes(chunk)
        while len(pending) < len(mine):
            pending += bytes(next(chunks_b))
        if mine != pending[: len(mine)]:
            return False
        pending = pending[len(mine) :]
    return True


def _compare_weights(report: VerifyReport, a: Package, b: Package) -> None:
    sites_a = list(blob_sites(a.spec.mlProgram, a.model_path))
    sites_b = list(blob_sites(b.spec.mlProgram, b.model_path))
    if len(sites_a) != len(sites_b):
        report.mismatches.append(
            f"{len(sites_a)} blob values in the original, {len(sites_b)} in the converted model; weights not compared"
        )
        return
    dec_a, dec_b = _Decoder(BlobLocator(a)), _Decoder(BlobLocator(b))
    done: set[tuple[Path, int, Path, int]] = set()
    as_bytes = 0
    for sa, sb in zip(sites_a, sites_b):
        name = f"{sa.scope}/{sa.name}" if sa.op is not None and len(a.spec.mlProgram.functions) > 1 else sa.name
        try:
            path_a, wf_a, rec_a = dec_a.locate(sa.value.blobFileValue)
        except WeightshareError as e:
            report.mismatches.append(f"weight {name!r}: original: {e.message}")
            continue
        try:
            path_b, wf_b, rec_b = dec_b.locate(sb.value.blobFileValue)
        except WeightshareError as e:
            report.mismatches.append(f"weight {name!r}: converted: {e.message}")
            continue
        key = (path_a, rec_a.offset, path_b, rec_b.offset)
        if key in done:
            continue
        done.add(key)
        if (rec_a.dtype, rec_a.padding_bits) != (rec_b.dtype, rec_b.padding_bits):
            report.mismatches.append(
                f"weight {name!r}: stored as {rec_a.dtype_name} ({rec_a.padding_bits} padding "
                f"bits) in the original, {rec_b.dtype_name} ({rec_b.padding_bits}) converted"
            )
            continue
        try:
            x, y = dec_a.decode(path_a, rec_a), dec_b.decode(path_b, rec_b)
        except (RuntimeError, ValueError) as e:
            report.mismatches.append(f"weight {name!r}: coremltools cannot decode it ({e})")
            continue
        if x is None:  # no coremltools reader for this dtype: same dtype and same stored bytes decode alike
            as_bytes += 1
            same = _same_stored_bytes(wf_a, rec_a, wf_b, rec_b)
        else:
            same = y is not None and x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        if not same:
            report.mismatches.append(
                f"weight {name!r} ({rec_a.dtype_name}, {rec_a.nbytes} bytes): decoded "
                f"values differ (converted: {path_b.name} record at offset {rec_b.offset})"
            )
    report.notes.append(f"{len(done)} Core ML weights decoded and compared")
    if as_bytes:
        report.notes.append(
            f"{as_bytes} bfloat16/float8 payloads have no coremltools reader; their stored bytes were compared"
        )


def verify_programs(report: VerifyReport, original: Path, converted: Path) -> None:
    """Append one line to ``report.mismatches`` per difference between the two packages' programs and weights."""
    a, b = read_package(Path(original)), read_package(Path(converted))
    report.runs = 0
    report.notes.append(
        "Core ML cannot run on Linux: the programs were compared op for op and every weight "
        "decoded with coremltools' blob reader; no outputs were computed"
    )
    differ = _Differ(report)
    spec_a, spec_b = type(a.spec)(), type(b.spec)()
    spec_a.CopyFrom(a.spec)
    spec_b.CopyFrom(b.spec)
    spec_a.ClearField("mlProgram")
    spec_b.ClearField("mlProgram")
    differ.fields("model spec", spec_a, spec_b)
    differ.program(_without_blob_places(a.spec.mlProgram), _without_blob_places(b.spec.mlProgram))
    _compare_weights(report, a, b)
