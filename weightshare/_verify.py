"""`weightshare verify ORIGINAL CONVERTED`: same outputs, byte for byte, in the real runtime; blob checksums intact.

Compared: output names, count and order, then every output's kind (tensor,
sequence, map, optional), dtype, shape and raw bytes. A runtime failure is not a
bug in weightshare: when the original itself fails, the inputs or the runtime are
the problem (``OriginalFails``, exit 2); when only the converted model fails, the
conversion is (a verify failure, exit 1).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._compare import differences
from ._inventory import inventory
from ._tensors import CHUNK_SIZE, PayloadSource
from .errors import InvalidModel, UsageError, WeightshareError
from .formats import detect_format, get
from .report import JsonDict


class OriginalFails(WeightshareError):
    """The original model does not run in the runtime with these inputs: nothing to compare against."""

    kind = "original-fails"


@dataclass
class VerifyReport:
    original: str
    converted: str
    format: str
    runs: int = 0
    decode_steps: int = 0  # steps fed back from the previous step's present outputs, after a prefill (ONNX)
    outputs_compared: int = 0
    mismatches: list[str] = field(default_factory=list)
    payloads_hashed: int = 0
    payloads_compared: int = 0  # converted payloads compared byte for byte with the original's (ONNX)
    checksum_mismatches: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # runtime paths that ran, e.g. "LiteRT Interpreter, XNNPACK"
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.mismatches and not self.checksum_mismatches

    def to_dict(self) -> JsonDict:
        return {**asdict(self), "passed": self.passed}


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def compare_outputs(
    report: VerifyReport, names: list[str], outs_a: dict[str, Any], outs_b: dict[str, Any], run: int, prefix: str = ""
) -> None:
    """Every output of the original against the converted one's output of the same name."""
    for name in names:
        if name not in outs_b:
            continue  # reported once as a missing output
        report.outputs_compared += 1
        for line in differences(outs_a[name], outs_b[name], f"output {prefix}{name!r}"):
            report.mismatches.append(f"run {run}: {line}")


def compare_names(report: VerifyReport, what: str, a: list[str], b: list[str]) -> None:
    for name in a:
        if name not in b:
            report.mismatches.append(f"{what} {name!r} is missing from the converted model")
    for name in b:
        if name not in a:
            report.mismatches.append(f"{what} {name!r} exists only in the converted model")
    if set(a) == set(b) and a != b:
        report.mismatches.append(f"{what}s are in another order: {a} vs {b}")


def first_difference(a: PayloadSource, b: PayloadSource, chunk_size: int = CHUNK_SIZE) -> int | None:
    """Offset of the first byte at which ``a`` and ``b`` differ (the shorter one's length if one is a prefix of the
    other), None when they are equal. Streams both, one chunk of each in memory: flat for any payload size."""
    import numpy as np

    ia, ib = iter(a.chunks(chunk_size)), iter(b.chunks(chunk_size))
    ca = cb = memoryview(b"")
    pos = 0
    while True:
        # a chunk stays valid until its own source is advanced, so no copy is needed
        if not len(ca):
            ca = memoryview(next(ia, b"")).cast("B")
        if not len(cb):
            cb = memoryview(next(ib, b"")).cast("B")
        if not len(ca) or not len(cb):
            return None if not len(ca) and not len(cb) else pos
        n = min(len(ca), len(cb))
        if ca[:n] != cb[:n]:
            at = np.flatnonzero(np.frombuffer(ca[:n], np.uint8) != np.frombuffer(cb[:n], np.uint8))
            return pos + int(at[0])
        ca, cb, pos = ca[n:], cb[n:], pos + n


def _check_blob(report: VerifyReport, converted: Path) -> bool:
    """Re-hash every payload against its recorded checksum; True when an external reference is broken."""
    inv = inventory(converted, hash_payloads=True)
    broken = False
    for p in inv.payloads:
        if p.problem:
            broken = True
            report.checksum_mismatches.append(f"tensor {p.name!r}: {p.problem}")
        elif p.recorded_sha256:
            report.payloads_hashed += 1
            if p.sha256 != p.recorded_sha256:
                report.checksum_mismatches.append(
                    f"tensor {p.name!r} in {p.file} at offset {p.offset}: its "
                    "checksum differs from the one recorded in the blob"
                )
    report.payloads_hashed += inv.records_hashed  # blob records no tensor references (ORT packed copies)
    report.checksum_mismatches += inv.record_problems
    return broken


def verify(
    original: str | os.PathLike[str],
    converted: str | os.PathLike[str],
    runs: int = 3,
    dims: dict[str, int] | None = None,
    seed: int = 0,
    inputs: dict[str, Any] | None = None,
    shapes: dict[str, list[int]] | None = None,
    decode_steps: int = 0,
) -> VerifyReport:
    """Run ``original`` and ``converted`` on the same inputs and compare; re-hash the blob.

    ``inputs``: name -> value used in every run instead of random values; ``dims``:
    symbolic dim name (or ``"*"`` for every other dynamic dim) -> value; ``shapes``
    (TFLite): input name -> full shape for inputs with dynamic dims; ``decode_steps`` (ONNX decoders): after the
    runs, a prefill step and this many steps feeding each present output back as its past input.
    """
    original, converted = Path(original), Path(converted)
    fmt = detect_format(original)
    if detect_format(converted) != fmt:
        raise UsageError(f"{original} and {converted} are not the same format")
    if runs < 1:
        raise UsageError("--runs must be at least 1")
    if not 0 <= seed < 1 << 63:  # numpy's generators take a non-negative seed
        raise UsageError(f"--seed takes a non-negative integer below 2**63, got {seed}")
    if decode_steps < 0 or (decode_steps and not getattr(get(fmt), "decodes", False)):
        raise UsageError(f"--decode-steps takes a non-negative number of steps, for decoders ({fmt} has none)")
    report = VerifyReport(str(original), str(converted), fmt)
    opts: dict[str, Any] = {
        "runs": runs,
        "dims": dims or {},
        "seed": seed,
        "inputs": inputs or {},
        "shapes": shapes or {},
        "decode_steps": decode_steps,
    }
    try:
        broken = _check_blob(report, converted)
    except InvalidModel as e:
        report.checksum_mismatches.append(f"the converted model cannot be read: {e.message}")
        return report
    get(fmt).verify(report, original, converted, opts, broken)
    return report


def load_input(name: str, file: str | os.PathLike[str]) -> Any:
    """A value for ``--input NAME=FILE``: a .npy array, or a file a format reads (``Format.input_readers``, by
    suffix: ONNX's serialized TensorProto ``.pb``)."""
    import numpy as np

    from .formats import registered

    path = Path(file)
    try:
        for fmt in registered():
            read = getattr(fmt, "input_readers", {}).get(path.suffix)
            if read is not None:
                return read(path)
        return np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 -- unreadable input file: the user's problem, one line
        raise UsageError(f"--input {name}: cannot read {path}: {first_line(e)}") from None
