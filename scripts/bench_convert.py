#!/usr/bin/env python3
"""Benchmark `weightshare convert` against the physical floor and against other tools.

Every figure comes from a fresh child process: wall seconds, CPU seconds (user + system of the child, from
getrusage(RUSAGE_CHILDREN) in a wrapper that spawns only it) and peak RSS (ru_maxrss of the same wrapper).
CPU seconds are the robust figure on a loaded machine; wall seconds include waiting for the disk.

Cases (sizes follow --scale; the row labels print the real sizes):
  unpack     fp16 weights embedded, each behind Cast (512 MiB fp16 -> 1 GiB fp32 at scale 1), against
               - a bare chunked loop: preadv -> numpy copyto fp16->fp32 -> pwrite, one fsync (no parsing, no
                 hashing): the CPU floor of unpacking; run twice, with one pwrite per 8 MiB chunk and with the
                 chunk written in 256 KiB pieces (a pwrite of >= 1 MiB costs several times the system CPU per
                 byte on this kernel), and compared with the cheaper of the two;
               - dd if=/dev/zero of the output size with conv=fsync: the disk floor.
  external   fp32 weights already in an external data file (1, 4 and 8 GiB at scale 1), against
               - onnx_ir load + save with external data (when onnx_ir is installed; not a dependency);
               - a bare copy_file_range loop of the data file with one fsync: the floor.
  many       200,000 initializers of 1.2 KB (at scale 1), against onnx.load + onnx.save_model with external data.
  tiny       200,000 initializers of 16 B (at scale 1; they stay inline), against the same.
  fold       4,000 fp16 initializers of 8 KiB, each behind a Cast to float (at scale 1), against the same.
  startup    a 1 MiB fp32 MatMul model (any scale): `weightshare convert`, `inspect`, `check` (measured in ORT
             children, and with --no-measure), `--version` and
             `--help`, against `python -c pass` and `python -c "import onnx"`; also `convert` of a 1 MiB fp16
             model (unpacking it imports numpy); at least 5 round-robin runs.

    python scripts/bench_convert.py [--workdir /tmp/ws-bench] [--scale 1.0] [--cases unpack,external,many]
        [--external-gib 1,4,8] (cases also: tiny, fold, startup) [--baseline /path/to/other/checkout] [--repeat 3]

The weightshare measured is the one `python -m weightshare` imports from "/" (set PYTHONPATH to a checkout).
--scale 0.25 turns 512 MiB into 128 MiB, 1/4/8 GiB into 256 MiB/1/2 GiB and 200,000 tensors into 50,000.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from weightshare._samples import mlp_onnx

GIB, MIB = 1 << 30, 1 << 20

_WRAPPER = (
    "import json, resource, subprocess, sys\n"
    "r = subprocess.run(sys.argv[1:], capture_output=True)\n"
    "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "sys.stderr.buffer.write(r.stderr[-4000:])\n"
    "print(json.dumps({'rc': r.returncode, 'cpu': u.ru_utime + u.ru_stime, 'peak': u.ru_maxrss / 1024}))\n"
)

BARE_UNPACK = """
import os, sys, numpy as np
src, dst, piece = sys.argv[1], sys.argv[2], int(sys.argv[3])
chunk = 4 << 20
fi = os.open(src, os.O_RDONLY)
fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
inb = bytearray(chunk); outb = np.empty(chunk // 2, np.float32)
pos = 0
while True:
    n = os.preadv(fi, [inb], pos)
    n -= n % 2
    if n <= 0:
        break
    out = outb[: n // 2]
    np.copyto(out, np.frombuffer(inb, np.float16, n // 2))
    if piece:
        view = memoryview(out).cast("B")
        for i in range(0, len(view), piece):
            os.pwrite(fo, view[i : i + piece], pos * 2 + i)
    else:
        os.pwrite(fo, out, pos * 2)
    pos += n
os.fsync(fo)
"""

BARE_COPY = """
import os, sys
src, dst = sys.argv[1], sys.argv[2]
fi = os.open(src, os.O_RDONLY)
fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
size, pos = os.fstat(fi).st_size, 0
while pos < size:
    pos += os.copy_file_range(fi, fo, min(64 << 20, size - pos), pos, pos)
os.fsync(fo)
"""

ONNX_IR_RESAVE = (
    "import onnx_ir as ir, sys; m = ir.load(sys.argv[1]); "
    "ir.save(m, sys.argv[2], external_data='weights.data', alignment=65536)"
)

ONNX_EXTERNALISE = (
    "import onnx, sys; m = onnx.load(sys.argv[1]); "
    "onnx.save_model(m, sys.argv[2], save_as_external_data=True, all_tensors_to_one_file=True, "
    "location='weights.data', size_threshold=1024)"
)


def run(cmd: list[str], pythonpath: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    os.sync()  # the previous run's dirty pages must not be written back (and charged) during this one
    t0 = time.perf_counter()
    # cwd "/": `python -m weightshare` puts the cwd first on sys.path, which would shadow PYTHONPATH.
    res = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *cmd], capture_output=True, text=True, env=env, check=False, cwd="/"
    )
    wall = time.perf_counter() - t0
    try:
        fig = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr}") from None
    if fig["rc"] != 0:
        raise SystemExit(f"failed ({fig['rc']}): {' '.join(cmd)}\n{res.stderr}")
    return {"wall": wall, "cpu": fig["cpu"], "peak": fig["peak"]}


def fresh(d: Path) -> Path:
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


BASELINE: str | None = None  # --baseline: another checkout's PYTHONPATH, measured next to this one


def weightshare_cmd(model: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "weightshare", "convert", str(model), "-o", str(out), "-q"]


REPEAT = 1  # --repeat: rows measured round-robin this many times; the medians are printed (peak: the largest)

Row = tuple[str, Callable[[], list[str]], "str | None"]  # name, command (made anew per run), PYTHONPATH


def measure(rows: list[Row]) -> dict[str, dict]:
    """Run every row REPEAT times, one after the other in turn (a row is never favoured by its place: the page
    cache and the kernel's reclaim change from one run to the next), and keep the median wall and CPU seconds."""
    got: dict[str, list[dict]] = {name: [] for name, _, _ in rows}
    for _ in range(REPEAT):
        for name, cmd, pythonpath in rows:
            got[name].append(run(cmd(), pythonpath))
    return {
        name: {
            "wall": statistics.median(r["wall"] for r in runs),
            "cpu": statistics.median(r["cpu"] for r in runs),
            "peak": max(r["peak"] for r in runs),
        }
        for name, runs in got.items()
    }


def weightshare_rows(model: Path, out: Path) -> list[Row]:
    rows: list[Row] = [("weightshare", lambda: weightshare_cmd(model, fresh(out)), None)]
    if BASELINE:
        rows.append(("weightshare (baseline)", lambda: weightshare_cmd(model, fresh(out)), BASELINE))
    return rows


def size_label(nbytes: int) -> str:
    return f"{nbytes / GIB:.2g} GiB" if nbytes >= GIB else f"{nbytes / MIB:.0f} MiB"


def case_unpack(work: Path, scale: float) -> list[tuple[str, dict, dict]]:
    layers = max(1, round(64 * scale))  # 2048x2048 fp16: 8 MiB a layer
    d = fresh(work / "unpack")
    model = mlp_onnx(d / "model.onnx", layers=layers, dim=2048, weights="float16")
    fp16 = model.stat().st_size
    label = f"fp16+Cast {size_label(fp16)} -> {size_label(2 * fp16)} fp32"
    out = work / "out"
    run(["cat", str(model)])  # warm the page cache for everyone
    count = 2 * fp16 // (4 * MIB) + 1
    rows = measure(
        [
            *weightshare_rows(model, out),
            (
                "bare preadv/copyto/pwrite+fsync",
                lambda: [sys.executable, "-c", BARE_UNPACK, str(model), str(fresh(out) / "bare.bin"), "0"],
                None,
            ),
            (
                "bare loop, pwrite in 256 KiB pieces",
                lambda: [sys.executable, "-c", BARE_UNPACK, str(model), str(fresh(out) / "bare.bin"), str(256 << 10)],
                None,
            ),
            (
                "dd 4M x output size, conv=fsync",
                lambda: [
                    *("dd", "if=/dev/zero", f"of={fresh(out) / 'dd.bin'}", "bs=4M", f"count={count}"),
                    *("conv=fsync", "status=none"),
                ],
                None,
            ),
        ]
    )
    shutil.rmtree(d), shutil.rmtree(out)
    ws, dd = rows["weightshare"], rows["dd 4M x output size, conv=fsync"]
    bare = min(
        rows["bare preadv/copyto/pwrite+fsync"], rows["bare loop, pwrite in 256 KiB pieces"], key=lambda r: r["cpu"]
    )
    checks = {
        "CPU s / cheaper bare loop CPU s (target <= 1.25)": ws["cpu"] / bare["cpu"],
        "wall / dd wall (target <= 1.3)": ws["wall"] / dd["wall"],
    }
    return [(label, rows, checks)]


def case_external(work: Path, scale: float, sizes_gib: list[float]) -> list[tuple[str, dict, dict]]:
    results = []
    have_onnx_ir = (
        subprocess.run([sys.executable, "-c", "import onnx_ir"], capture_output=True, check=False).returncode == 0
    )
    for gib in sizes_gib:
        layers = max(1, round(gib * scale * 16))  # 4096x4096 fp32: 64 MiB a layer
        d = fresh(work / "external")
        model = mlp_onnx(d / "model.onnx", layers=layers, dim=4096, weights="float32", external=True)
        data = model.with_suffix(".data")
        label = f"external fp32 {size_label(data.stat().st_size)}"
        out = work / "out"
        run(["cat", str(data)])
        specs = weightshare_rows(model, out)
        if have_onnx_ir:
            specs.append(
                (
                    "onnx_ir load+save (no hash, no fsync)",
                    lambda m=model, o=out: [sys.executable, "-c", ONNX_IR_RESAVE, str(m), str(fresh(o) / "model.onnx")],
                    None,
                )
            )
        specs.append(
            (
                "copy_file_range + fsync (floor)",
                lambda d=data, o=out: [sys.executable, "-c", BARE_COPY, str(d), str(fresh(o) / "copy.bin")],
                None,
            )
        )
        rows = measure(specs)
        shutil.rmtree(d), shutil.rmtree(out)
        checks = {"peak RSS MiB (target <= 150)": rows["weightshare"]["peak"]}
        if have_onnx_ir:
            checks["CPU s / onnx_ir CPU s (target <= 1.0)"] = (
                rows["weightshare"]["cpu"] / rows["onnx_ir load+save (no hash, no fsync)"]["cpu"]
            )
        results.append((label, rows, checks))
    return results


def many_tensors_model(path: Path, count: int, elems: int = 300) -> Path:
    """``count`` fp32 initializers of ``elems`` values each (1.2 KB at 300, 16 B at 4), all summed."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    base = rng.standard_normal(elems).astype(np.float32)
    inits = [numpy_helper.from_array(base + np.float32(i), f"t{i}") for i in range(count)]
    node = helper.make_node("Sum", ["x", *(f"t{i}" for i in range(count))], ["y"])
    return _save_vector_model(path, "many", [node], inits, elems)


def case_many(work: Path, scale: float) -> list[tuple[str, dict, dict]]:
    count = max(10, round(200_000 * scale))
    d = fresh(work / "many")
    model = many_tensors_model(d / "many.onnx", count)
    return [_versus_onnx(work, d, model, f"{count:,} initializers x 1.2 KB ({size_label(model.stat().st_size)})")]


def case_tiny(work: Path, scale: float) -> list[tuple[str, dict, dict]]:
    count = max(10, round(200_000 * scale))
    d = fresh(work / "tiny")
    model = many_tensors_model(d / "tiny.onnx", count, elems=4)
    return [_versus_onnx(work, d, model, f"{count:,} initializers x 16 B ({size_label(model.stat().st_size)})")]


def fold_model(path: Path, count: int, elems: int = 4096) -> Path:
    """``count`` fp16 initializers of ``elems`` values (8 KiB at 4096), each read by its own Cast to float."""
    from onnx import TensorProto, helper, numpy_helper

    base = np.random.default_rng(0).standard_normal(elems).astype(np.float16)
    inits = [numpy_helper.from_array(base + np.float16(i % 7), f"w{i}") for i in range(count)]
    nodes = [helper.make_node("Cast", [f"w{i}"], [f"c{i}"], to=TensorProto.FLOAT) for i in range(count)]
    nodes.append(helper.make_node("Sum", ["x", *(f"c{i}" for i in range(count))], ["y"]))
    return _save_vector_model(path, "fold", nodes, inits, elems)


def _save_vector_model(path: Path, name: str, nodes: list, inits: list, elems: int) -> Path:
    """Save a graph from float vector ``x`` to float vector ``y``, both of ``elems`` values (opset 17)."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [elems])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [elems])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def case_fold(work: Path, scale: float) -> list[tuple[str, dict, dict]]:
    count = max(10, round(4_000 * scale))
    d = fresh(work / "fold")
    model = fold_model(d / "fold.onnx", count)
    label = f"{count:,} fp16+Cast initializers x 8 KiB ({size_label(model.stat().st_size)})"
    label, rows, checks = _versus_onnx(work, d, model, label)
    checks = {"wall / onnx wall (target <= 2)": checks["wall / onnx wall (target <= 1.5)"]}
    return [(label, rows, checks)]


def case_startup(work: Path) -> list[tuple[str, dict, dict]]:
    """Process start-up: what one short command costs beyond the interpreter's own start."""
    global REPEAT
    from onnx import TensorProto, helper, numpy_helper

    d = fresh(work / "startup")
    x = np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32)  # 1 MiB
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "startup",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 512])],
        [numpy_helper.from_array(x, "w")],
    )
    model = d / "tiny.onnx"
    model.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    half = mlp_onnx(d / "tiny16.onnx", layers=1, dim=724, weights="float16")  # 1 MiB of fp16 behind a Cast
    ws = [sys.executable, "-m", "weightshare"]
    out = work / "out"
    ready = d / "converted"  # `check` of a share-ready model exits 0 (of the original: 1, a finding)
    run([*ws, "convert", str(model), "-o", str(ready), "-q"])
    repeat, REPEAT = REPEAT, max(REPEAT, 5)
    rows = measure(
        [
            ("python -c pass", lambda: [sys.executable, "-c", "pass"], None),
            ('python -c "import onnx"', lambda: [sys.executable, "-c", "import onnx"], None),
            ("weightshare --version", lambda: [*ws, "--version"], None),
            ("weightshare convert --help", lambda: [*ws, "convert", "--help"], None),
            ("weightshare convert", lambda: weightshare_cmd(model, fresh(out)), None),
            *(
                [("weightshare convert (baseline)", lambda: weightshare_cmd(model, fresh(out)), BASELINE)]
                if BASELINE
                else []
            ),
            ("weightshare convert, fp16 + Cast", lambda: weightshare_cmd(half, fresh(out)), None),
            ("weightshare inspect", lambda: [*ws, "inspect", str(model)], None),
            ("weightshare check", lambda: [*ws, "check", "-q", str(ready / model.name)], None),
            # the figures ORT measures (two child processes, one session count each) left out: the static rules
            ("weightshare inspect --no-measure", lambda: [*ws, "inspect", "--no-measure", str(model)], None),
            (
                "weightshare check --no-measure",
                lambda: [*ws, "check", "-q", "--no-measure", str(ready / model.name)],
                None,
            ),
        ]
    )
    REPEAT = repeat
    label = f"start-up: one fp32 MatMul model of {size_label(model.stat().st_size)} (median of {max(repeat, 5)} runs)"
    shutil.rmtree(d), shutil.rmtree(out, ignore_errors=True)
    checks = {
        "convert CPU s (target <= 0.25)": rows["weightshare convert"]["cpu"],
        "inspect --no-measure CPU s (target <= 0.25)": rows["weightshare inspect --no-measure"]["cpu"],
        "check --no-measure CPU s (target <= 0.25)": rows["weightshare check --no-measure"]["cpu"],
    }
    return [(label, rows, checks)]


def _versus_onnx(work: Path, d: Path, model: Path, label: str) -> tuple[str, dict, dict]:
    out = work / "out"
    run(["cat", str(model)])
    rows = measure(
        [
            *weightshare_rows(model, out),
            (
                "onnx load+save external",
                lambda: [sys.executable, "-c", ONNX_EXTERNALISE, str(model), str(fresh(out) / model.name)],
                None,
            ),
        ]
    )
    shutil.rmtree(d), shutil.rmtree(out)
    checks = {
        "peak RSS MiB (target <= 200)": rows["weightshare"]["peak"],
        "wall / onnx wall (target <= 1.5)": rows["weightshare"]["wall"] / rows["onnx load+save external"]["wall"],
        "CPU / onnx CPU (target <= 1.2)": rows["weightshare"]["cpu"] / rows["onnx load+save external"]["cpu"],
    }
    return label, rows, checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ws-bench"))
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--cases", default="unpack,external,many")
    ap.add_argument("--external-gib", default="1,4,8")
    ap.add_argument("--baseline", help="PYTHONPATH of another weightshare checkout to measure alongside")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each row, round-robin; medians are printed")
    args = ap.parse_args()
    global BASELINE, REPEAT
    BASELINE = args.baseline
    REPEAT = max(1, args.repeat)
    work = fresh(args.workdir.resolve())
    cases = set(args.cases.split(","))
    results = []
    if "unpack" in cases:
        results += case_unpack(work, args.scale)
    if "external" in cases:
        results += case_external(work, args.scale, [float(g) for g in args.external_gib.split(",")])
    if "many" in cases:
        results += case_many(work, args.scale)
    if "tiny" in cases:
        results += case_tiny(work, args.scale)
    if "fold" in cases:
        results += case_fold(work, args.scale)
    if "startup" in cases:
        results += case_startup(work)
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"scale {args.scale}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f} at the end; "
        f"median of {REPEAT} round-robin run(s) per row"
    )
    for label, rows, checks in results:
        print(f"\n{label}")
        print(f"  {'':40} {'wall s':>8} {'CPU s':>8} {'peak MiB':>9}")
        for name, r in rows.items():
            print(f"  {name:40} {r['wall']:>8.2f} {r['cpu']:>8.2f} {r['peak']:>9.0f}")
        for name, value in checks.items():
            print(f"  {name}: {value:.2f}")


if __name__ == "__main__":
    main()
