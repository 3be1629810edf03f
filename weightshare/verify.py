"""`weightshare verify ORIGINAL CONVERTED`: same outputs in the real runtime, blob checksums intact."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .errors import UsageError
from .formats import detect_format
from .inventory import inventory


@dataclass
class VerifyReport:
    original: str
    converted: str
    format: str
    runs: int = 0
    outputs_compared: int = 0
    mismatches: list[str] = field(default_factory=list)
    payloads_hashed: int = 0
    checksum_mismatches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.mismatches and not self.checksum_mismatches

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equal values, NaN positions equal."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind in "fc":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


def _compare(report: VerifyReport, name: str, a: np.ndarray, b: np.ndarray, run: int) -> None:
    report.outputs_compared += 1
    if not same_array(a, b):
        if a.shape != b.shape or a.dtype != b.dtype:
            what = f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        else:
            diff = np.argwhere(~((a == b) | (np.isnan(a) & np.isnan(b)) if a.dtype.kind in "fc" else a == b))
            what = f"{len(diff)} of {a.size} values differ, first at {diff[0].tolist()}"
        report.mismatches.append(f"run {run}: output {name!r}: {what}")


def _verify_onnx(report: VerifyReport, original: Path, converted: Path, runs: int, dims: dict, seed: int) -> None:
    from .runtimes.ort import new_session, random_feeds

    a = new_session(str(original), share=False)
    try:
        b = new_session(str(converted), share=False)
    except Exception as e:  # e.g. a --prepack model whose packed copy ORT's load-time validation rejects
        report.mismatches.append(f"onnxruntime refused the converted model: {str(e).splitlines()[0][:300]}")
        return
    if [i.name for i in a.get_inputs()] != [i.name for i in b.get_inputs()]:
        report.mismatches.append("the models have different inputs")
        return
    names = [o.name for o in a.get_outputs()]
    for r in range(runs):
        feeds = random_feeds(a, seed + r, dims)
        for name, x, y in zip(names, a.run(None, feeds), b.run(None, feeds)):
            _compare(report, name, x, y, r)
        report.runs += 1


def _verify_tflite(report: VerifyReport, original: Path, converted: Path, runs: int, dims: dict, seed: int) -> None:
    """Every signature (or the primary subgraph when there is none), run by LiteRT's Interpreter."""
    from .runtimes.litert import entry_points, new_interpreter

    a, b = new_interpreter(str(original)), new_interpreter(str(converted))
    ea, eb = entry_points(a), entry_points(b)
    if [k for k, _ in ea] != [k for k, _ in eb]:
        report.mismatches.append("the models have different signatures")
        return
    for r in range(runs):
        for (key, run_a), (_, run_b) in zip(ea, eb):
            feeds = run_a.feeds(seed + r)
            outs_a, outs_b = run_a(feeds), run_b(feeds)
            for name in outs_a:
                _compare(report, f"{key}:{name}" if key else name, outs_a[name], outs_b[name], r)
        report.runs += 1


def verify(original: str | os.PathLike, converted: str | os.PathLike, runs: int = 3,
           dims: dict[str, int] | None = None, seed: int = 0) -> VerifyReport:
    original, converted = Path(original), Path(converted)
    fmt = detect_format(original)
    if detect_format(converted) != fmt:
        raise UsageError(f"{original} and {converted} are not the same format")
    report = VerifyReport(str(original), str(converted), fmt)
    if fmt == "onnx":
        _verify_onnx(report, original, converted, runs, dims or {}, seed)
    elif fmt == "tflite":
        _verify_tflite(report, original, converted, runs, dims or {}, seed)
    else:
        from .formats.coreml.verify import verify_programs

        verify_programs(report, original, converted)
    inv = inventory(converted, hash_payloads=True)
    for p in inv.payloads:
        if p.recorded_sha256:
            report.payloads_hashed += 1
            if p.sha256 != p.recorded_sha256:
                report.checksum_mismatches.append(f"{p.name} in {p.file} at offset {p.offset}: SHA-256 differs "
                                                  "from the one recorded in the blob")
    return report
