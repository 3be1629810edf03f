"""`weightshare verify ORIGINAL CONVERTED`: same outputs, byte for byte, in the real runtime; blob checksums intact.

Compared: output names, count and order, then every output's kind (tensor,
sequence, map, optional), dtype, shape and raw bytes. A runtime failure is not a
bug in weightshare: when the original itself fails, the inputs or the runtime are
the problem (``OriginalFails``, exit 2); when only the converted model fails, the
conversion is (a verify failure, exit 1).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._compare import differences
from ._tensors import CHUNK_SIZE, PayloadSource
from .errors import UsageError, WeightshareError
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
    planned_runs: int = 0  # runs the format planned (ONNX: --runs per runtime leg); 0 where it does not count
    skipped: list[str] = field(default_factory=list)  # one line per planned run that did not run, saying why
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

    @property
    def partial(self) -> bool:
        """Some planned runs did not run: the comparison that passed covers less than was planned."""
        return bool(self.skipped)

    def exit_code(self, strict: bool = False) -> int:
        """1 on a difference; with ``strict`` (``verify --strict``) also when a planned run did not run."""
        return 1 if not self.passed or (strict and self.partial) else 0

    def verdict(self, strict: bool = False) -> str:
        """ "ok", "FAILED", or "ok (partial: 2 of 3 runs; run 1 at ... not run: ...)": never a bare "ok" after a
        skip."""
        if not self.passed:
            return "FAILED"
        if not self.partial:
            return "ok"
        planned = self.planned_runs or self.runs + len(self.skipped)
        head = "FAILED (--strict; " if strict else "ok ("
        return f"{head}partial: {self.runs} of {planned} runs; {'; '.join(self.skipped)})"

    def to_dict(self) -> JsonDict:
        return {**asdict(self), "passed": self.passed, "partial": self.partial}


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def read_input(name: str, file: str | os.PathLike[str], readers: Mapping[str, Callable[[Path], Any]]) -> Any:
    """A value for ``--input NAME=FILE``: read by ``readers[suffix]`` (a format's own files: ONNX's ``.pb``) or as a
    .npy array; an unreadable file is the user's problem, one line."""
    import numpy as np

    path = Path(file)
    try:
        read = readers.get(path.suffix)
        return read(path) if read is not None else np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 -- unreadable input file: the user's problem, one line
        raise UsageError(f"--input {name}: cannot read {path}: {first_line(e)}") from None


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
