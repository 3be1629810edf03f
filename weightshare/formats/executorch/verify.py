"""verify for ExecuTorch: every method of both programs run by ``executorch.runtime``, outputs compared byte for byte.

Each program is loaded as a user loads it (``Runtime.load_program(path, data_path=...)``, the ``.ptd`` beside it
when it reads external data); inputs are random values of each input's dtype and shape from the method's
metadata, the same for both programs; outputs compared with ``np.array_equal`` on their raw bytes (``differences``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ..._tensors import FileRange
from ..._verify import OriginalFails, VerifyReport, compare_outputs, first_difference, first_line
from ...errors import Unsupported
from . import flatbuf
from .flatbuf import SCALAR_TYPES
from .inventory import delegate_blob_bytes, find_data_file, reads_key

# executorch_flatbuffer.ScalarType -> numpy dtype of random inputs: the scalar types numpy has as they are
_NUMPY = {
    k: v
    for k, v in SCALAR_TYPES.items()
    if v in ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bool")
}


def data_path_for(program: Path) -> Path | None:
    """The ``.ptd`` beside ``program`` holding its external tensors (None when it reads none or when no file
    beside it holds them: the runtime then says what is missing)."""
    with open(program, "rb") as fh:
        prog = flatbuf.read_program(fh.fileno(), str(program))
        blobs = delegate_blob_bytes(prog, fh.fileno())
    return find_data_file(program, reads_key(prog, blobs))[0]


def payloads(program: Path) -> dict[str, FileRange]:
    """Every weight a program reads, by a name that survives conversion: named data by key (its own and its
    .ptd's), constant-segment tensors by buffer index."""
    out: dict[str, FileRange] = {}
    with open(program, "rb") as fh:
        prog = flatbuf.read_program(fh.fileno(), str(program))
        blobs = delegate_blob_bytes(prog, fh.fileno())
    for nd in prog.named_data:
        seg = prog.segments[nd.segment]
        out[nd.key] = FileRange(str(program), seg.file_offset, seg.nbytes)
    if prog.constant_segment is not None:
        seg, offs = prog.segments[prog.constant_segment], prog.constant_offsets
        sizes = {c.buffer_index: c for c in prog.constants if c.buffer_index}
        for j, start in enumerate(offs):
            end = offs[j + 1] if j + 1 < len(offs) else seg.nbytes
            c = sizes.get(j)
            if c is None or end <= start:
                continue
            n = min(end - start, seg.nbytes - start)
            out[f"constant {j} ({c.name})"] = FileRange(str(program), seg.file_offset + start, n)
    ptd, found = find_data_file(program, reads_key(prog, blobs))
    for key, (_nd, dseg) in found.items():
        assert ptd is not None
        out[f"{ptd.name}:{key}"] = FileRange(str(ptd), dseg.file_offset, dseg.nbytes)
    return out


def compare_payloads(report: VerifyReport, original: Path, converted: Path) -> None:
    """Each weight of the converted program byte for byte against the original's of the same name. A constant
    piece of the converted program may be longer (alignment padding after it): the original's length is compared."""
    a, b = payloads(original), payloads(converted)
    for name in sorted(a):
        if name not in b:
            report.mismatches.append(f"weight {name!r} is missing from the converted program")
            continue
        src, dst = a[name], b[name]
        if name.startswith("constant "):
            dst = FileRange(dst.path, dst.offset, min(dst.length, src.length))
        at = first_difference(src, dst)
        report.payloads_compared += 1
        if at is not None:
            report.mismatches.append(f"weight {name!r} differs from the original at byte {at}")


def _runtime() -> Any:
    try:
        runtime = importlib.import_module("executorch.runtime")
    except ImportError as e:
        raise Unsupported(f"verify needs ExecuTorch's Python runtime (pip install executorch): {e}") from None
    return runtime.Runtime.get()


def _inputs(meta: Any, seed: int, run: int) -> list[Any]:
    import numpy as np

    torch = importlib.import_module("torch")  # installed with executorch

    rng = np.random.default_rng(seed + run)
    out = []
    for i in range(meta.num_inputs()):
        info = meta.input_tensor_meta(i)
        dtype = _NUMPY.get(int(info.dtype()))
        if dtype is None:
            raise Unsupported(f"input {i} of {meta.name()!r} has ExecuTorch dtype {info.dtype()}: give no random input")
        shape = tuple(info.sizes())
        if dtype == "bool":
            arr = rng.integers(0, 2, shape).astype(bool)
        elif dtype.startswith(("int", "uint")):
            arr = rng.integers(0, 8, shape).astype(dtype)
        else:
            arr = rng.standard_normal(shape).astype(dtype)
        out.append(torch.from_numpy(arr))
    return out


def _run(rt: Any, path: Path, data: Path | None, seed: int, runs: int) -> dict[str, list[dict[str, Any]]]:
    kwargs = {"data_path": str(data)} if data is not None else {}
    program = rt.load_program(str(path), **kwargs)
    results: dict[str, list[dict[str, Any]]] = {}
    for name in sorted(program.method_names):
        method = program.load_method(name)
        meta = method.metadata
        results[name] = []
        for run in range(runs):
            outs = method.execute(_inputs(meta, seed, run))
            results[name].append({f"output{i}": o.numpy().copy() for i, o in enumerate(outs)})
    return results


def verify_in_runtime(
    report: VerifyReport, original: Path, converted: Path, opts: dict[str, Any], broken: bool
) -> None:
    with open(original, "rb") as fh:
        if flatbuf.kind_of(fh.read(8)) == "ptd":
            raise Unsupported("verify runs programs: give the .pte files that load this .ptd", original)
    if not broken:
        compare_payloads(report, original, converted)
    rt = _runtime()
    seed, runs = int(opts.get("seed", 0)), max(1, int(opts.get("runs", 1)))
    try:
        want = _run(rt, original, data_path_for(original), seed, runs)
    except Exception as e:
        raise OriginalFails(
            f"the original program does not run in executorch.runtime: {first_line(e)}", original
        ) from None
    report.paths.append("executorch.runtime load_program(path) (MmapDataLoader)")
    if broken:
        return
    try:
        got = _run(rt, converted, data_path_for(converted), seed, runs)
    except Exception as e:
        report.mismatches.append(f"the converted program fails in executorch.runtime: {first_line(e)}")
        return
    for name, runs_a in want.items():
        if name not in got:
            report.mismatches.append(f"method {name!r} is missing from the converted program")
            continue
        for run, (a, b) in enumerate(zip(runs_a, got[name])):
            compare_outputs(report, sorted(a), a, b, run, f"{name}/")
        report.runs += len(runs_a)
