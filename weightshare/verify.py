"""`weightshare verify ORIGINAL CONVERTED`: same outputs, byte for byte, in the real runtime; blob checksums intact.

Compared: output names, count and order, then every output's kind (tensor,
sequence, map, optional), dtype, shape and raw bytes. A runtime failure is not a
bug in weightshare: when the original itself fails, the inputs or the runtime are
the problem (``OriginalFails``, exit 2); when only the converted model fails, the
conversion is (a verify failure, exit 1).
"""

from __future__ import annotations

import gc
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .compare import differences
from .errors import InvalidModel, UsageError, WeightshareError
from .formats import detect_format
from .inventory import inventory


class OriginalFails(WeightshareError):
    """The original model does not run in the runtime with these inputs: nothing to compare against."""

    kind = "original-fails"


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
    paths: list[str] = field(default_factory=list)  # runtime paths that ran, e.g. "LiteRT Interpreter, XNNPACK"
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.mismatches and not self.checksum_mismatches

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def _hint(fmt: str) -> str:
    if fmt == "onnx":
        return "give real inputs with --input NAME=FILE.npy, or symbolic dims with --dim NAME=VALUE"
    return "give real inputs with --input NAME=FILE.npy, or dynamic shapes with --shape NAME=1,16000 / --dim '*=N'"


def compare_outputs(report: VerifyReport, names: list[str], outs_a: dict[str, Any], outs_b: dict[str, Any],
                    run: int, prefix: str = "") -> None:
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


def _verify_onnx(report: VerifyReport, original: Path, converted: Path, opts: dict, broken: bool) -> None:
    from .runtimes.ort import index_bounds, new_session, random_feeds

    try:
        a = new_session(str(original), share=False, log_level=4)
    except Exception as e:  # noqa: BLE001 -- any runtime refusal is reported, not raised as a bug
        raise OriginalFails(f"the original model fails in onnxruntime: {first_line(e)} ({_hint('onnx')})",
                            original) from None
    report.paths.append("onnxruntime CPU, default session options")
    if broken:
        report.mismatches.append("the converted model was not run: its external data is broken (see above)")
        return
    try:
        b = new_session(str(converted), share=False, log_level=4)
    except Exception as e:  # noqa: BLE001
        report.mismatches.append(f"the converted model fails to load in onnxruntime: {first_line(e)}")
        return
    symbolic = {str(d) for i in a.get_inputs() for d in i.shape if isinstance(d, str)}
    unknown = sorted(set(opts["dims"]) - symbolic - {"*"})
    if unknown:  # a typo would otherwise be ignored silently and the dim left at 1
        raise UsageError(f"--dim {unknown[0]}: no input of {original.name} has a dimension of that name "
                         f"(symbolic dims: {', '.join(sorted(symbolic)) or 'none'}; '*' sets every dynamic one)")
    compare_names(report, "input", [i.name for i in a.get_inputs()], [i.name for i in b.get_inputs()])
    names_a, names_b = [o.name for o in a.get_outputs()], [o.name for o in b.get_outputs()]
    compare_names(report, "output", names_a, names_b)
    if report.mismatches:
        return
    bounds = index_bounds(str(original))
    for r in range(opts["runs"]):
        feeds = random_feeds(a, opts["seed"] + r, opts["dims"], opts["inputs"], bounds)
        try:
            outs_a = dict(zip(names_a, a.run(None, feeds)))
        except Exception as e:  # noqa: BLE001
            raise OriginalFails(f"the original model fails in onnxruntime: {first_line(e)} ({_hint('onnx')})",
                                original) from None
        try:
            outs_b = dict(zip(names_b, b.run(None, feeds)))
        except Exception as e:  # noqa: BLE001
            report.mismatches.append(f"run {r}: the converted model fails in onnxruntime: {first_line(e)}")
            return
        compare_outputs(report, names_a, outs_a, outs_b, r)
        report.runs += 1


def _open_paths(original: Path, converted: Path, external: bool):
    """(path name, original entry points, converted entry points or an error line), one per LiteRT mode."""
    from .runtimes.litert import MODES, compiled_entry_points, entry_points, open_mode

    if external:  # only CompiledModel loads ExternalBuffer groups: run both models through it, same kernels
        try:
            ca: Any = compiled_entry_points(str(original), str(original))
        except Exception as e:  # noqa: BLE001
            return [], [f"CompiledModel: {first_line(e)}"]
        try:
            cb: Any = compiled_entry_points(str(converted), str(original))
        except Exception as e:  # noqa: BLE001
            cb = f"the converted model fails to load in LiteRT CompiledModel: {first_line(e)}"
        return [("CompiledModel", "LiteRT CompiledModel", ca, cb)], []
    opened: list[tuple[str, str, Any, Any]] = []
    refusals: list[str] = []
    for mode in MODES:
        try:
            ea = entry_points(open_mode(str(original), mode))
        except Exception as e:  # noqa: BLE001
            refusals.append(f"{mode}: {first_line(e)}")
            continue
        try:
            eb: Any = entry_points(open_mode(str(converted), mode))
        except Exception as e:  # noqa: BLE001
            eb = f"the converted model fails to load in LiteRT ({mode}): {first_line(e)}"
        opened.append((mode, f"LiteRT Interpreter, {mode}", ea, eb))
    return opened, refusals


def _run_path(report: VerifyReport, path: str, ea, eb, opts: dict) -> str:
    """Compare on one LiteRT path; returns why the original could not run on it in the first run ('' if it ran)."""
    before = len(report.mismatches)
    compare_names(report, "signature", [k for k, _ in ea], [k for k, _ in eb])
    if len(report.mismatches) > before:
        return ""
    for r in range(opts["runs"]):
        for (key, run_a), (_, run_b) in zip(ea, eb):
            feeds = run_a.feeds(opts["seed"] + r, opts["inputs"], opts["shapes"], opts["dims"])
            try:
                outs_a = run_a(feeds)
            except Exception as e:  # noqa: BLE001
                if r == 0:  # this path does not run the original (an op it lacks, a shape it refuses)
                    return first_line(e)
                raise OriginalFails(f"the original model fails in {path}: {first_line(e)} ({_hint('tflite')})",
                                    report.original) from None
            try:
                outs_b = run_b(feeds)
            except Exception as e:  # noqa: BLE001
                report.mismatches.append(f"run {r}: the converted model fails in {path}: {first_line(e)}")
                return ""
            compare_names(report, "output", list(outs_a), list(outs_b))
            compare_outputs(report, list(outs_a), outs_a, outs_b, r, f"{key}:" if key else "")
        report.runs += 1
    return ""


def _verify_tflite(report: VerifyReport, original: Path, converted: Path, opts: dict, broken: bool) -> None:
    """Every signature (or the primary subgraph), on every path the original runs on."""
    external = any(p.location == "external" and p.file != converted.name for p in inventory(converted, False).payloads)
    opened, refusals = _open_paths(original, converted, external)
    for mode, path, ea, eb in opened:
        if broken:
            break
        if isinstance(eb, str):
            report.paths.append(path)
            report.mismatches.append(eb)
            continue
        refused = _run_path(report, path, ea, eb, opts)
        if refused:
            refusals.append(f"{mode}: {refused}")
        else:
            report.paths.append(path)
    if not report.paths and not broken:
        raise OriginalFails(f"the original model fails in LiteRT: {'; '.join(refusals)} ({_hint('tflite')})",
                            original)
    for line in refusals:
        report.notes.append(f"the original model does not run with LiteRT {line}; that path was skipped")
    if broken:
        report.mismatches.append("the converted model was not run: its external data is broken (see above)")


def _check_blob(report: VerifyReport, converted: Path) -> bool:
    """Re-hash every payload against its recorded SHA-256; True when an external reference is broken."""
    inv = inventory(converted, hash_payloads=True)
    broken = False
    for p in inv.payloads:
        if p.problem:
            broken = True
            report.checksum_mismatches.append(f"tensor {p.name!r}: {p.problem}")
        elif p.recorded_sha256:
            report.payloads_hashed += 1
            if p.sha256 != p.recorded_sha256:
                report.checksum_mismatches.append(f"tensor {p.name!r} in {p.file} at offset {p.offset}: SHA-256 "
                                                  "differs from the one recorded in the blob")
    _check_other_records(report, converted, inv)
    return broken


def _check_other_records(report: VerifyReport, converted: Path, inv) -> None:
    """Re-hash the blob records no tensor references directly (e.g. ORT pre-packed copies of ``--prepack``): every
    record with a recorded SHA-256 is checked, so a flipped byte in a packed copy fails verify too."""
    from .blob import read_safetensors_metadata
    from .inventory import sha256_of
    from .tensors import FileRange

    seen = {(p.file, p.offset) for p in inv.payloads}
    base = converted.resolve() if converted.is_dir() else converted.resolve().parent
    for name in inv.external_files:
        path = base / name
        try:
            data_start, header, meta = read_safetensors_metadata(str(path))
        except (InvalidModel, OSError):
            continue  # not a weightshare blob: nothing recorded
        for key, entry in meta.items():
            t = header.get(key)
            if not (isinstance(t, dict) and isinstance(entry, dict) and "sha256" in entry):
                continue
            begin, end = (data_start + int(x) for x in t["data_offsets"])
            if (name, begin) in seen:
                continue
            seen.add((name, begin))
            report.payloads_hashed += 1
            if end > path.stat().st_size:
                report.checksum_mismatches.append(f"blob record {key!r} in {name} at offset {begin}: runs past "
                                                  "the end of the file")
            elif sha256_of(FileRange(str(path), begin, end - begin)) != entry["sha256"]:
                report.checksum_mismatches.append(f"blob record {key!r} in {name} at offset {begin}: SHA-256 "
                                                  "differs from the one recorded in the blob")


def verify(original: str | os.PathLike, converted: str | os.PathLike, runs: int = 3,
           dims: dict[str, int] | None = None, seed: int = 0, inputs: dict[str, Any] | None = None,
           shapes: dict[str, list[int]] | None = None) -> VerifyReport:
    """Run ``original`` and ``converted`` on the same inputs and compare; re-hash the blob.

    ``inputs``: name -> value used in every run instead of random values; ``dims``:
    symbolic dim name (or ``"*"`` for every other dynamic dim) -> value; ``shapes``
    (TFLite): input name -> full shape for inputs with dynamic dims.
    """
    original, converted = Path(original), Path(converted)
    fmt = detect_format(original)
    if detect_format(converted) != fmt:
        raise UsageError(f"{original} and {converted} are not the same format")
    if runs < 1:
        raise UsageError("--runs must be at least 1")
    report = VerifyReport(str(original), str(converted), fmt)
    opts: dict[str, Any] = {"runs": runs, "dims": dims or {}, "seed": seed, "inputs": inputs or {},
                            "shapes": shapes or {}}
    try:
        broken = _check_blob(report, converted)
    except InvalidModel as e:
        report.checksum_mismatches.append(f"the converted model cannot be read: {e.message}")
        return report
    if fmt == "onnx":
        _verify_onnx(report, original, converted, opts, broken)
    elif fmt == "tflite":
        from .runtimes.litert import native_stderr_silenced

        named = sorted(set(opts["dims"]) - {"*"})
        if named:
            raise UsageError(f"--dim {named[0]}: TFLite dimensions have no names; use --dim '*=N' for every "
                             "dynamic dimension or --shape INPUT=D0,D1,... for one input")

        with native_stderr_silenced():
            _verify_tflite(report, original, converted, opts, broken)
            gc.collect()  # LiteRT environments log as they are destroyed: while stderr is still silenced
    else:
        from .formats.coreml.verify import verify_programs

        verify_programs(report, original, converted)
    return report


def load_input(name: str, file: str | os.PathLike) -> Any:
    """A value for ``--input NAME=FILE``: a .npy array, or a serialized ONNX TensorProto (.pb)."""
    import numpy as np

    path = Path(file)
    try:
        if path.suffix == ".pb":
            import onnx
            from onnx import numpy_helper

            proto = onnx.TensorProto()
            proto.ParseFromString(path.read_bytes())
            return numpy_helper.to_array(proto)
        return np.load(path, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 -- unreadable input file: the user's problem, one line
        raise UsageError(f"--input {name}: cannot read {path}: {first_line(e)}") from None
