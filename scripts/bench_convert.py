#!/usr/bin/env python3
"""Benchmark: peak RSS and wall time of `weightshare convert` vs the onnx library vs cp.

Generates, in --workdir:
  A. 1 GiB model, fp32 weights embedded in the protobuf
  B. 1 GiB model, fp16 weights embedded, each behind Cast(to=FLOAT)
  C. 4 GiB model, fp32 weights in an external data file
and, each in a fresh child process, measures:
  - weightshare convert MODEL -o OUT
  - onnx: onnx.load + onnx.save_model(save_as_external_data=True)  (the library's own externalisation)
  - cp of the same input (model file and its data file)
Peak RSS is the child's ru_maxrss (getrusage RUSAGE_CHILDREN of a wrapper that spawns only it).

    python scripts/bench_convert.py [--workdir /tmp/ws-bench] [--scale 1.0]

--scale shrinks every model (0.1 = 100 MiB / 400 MiB) for a quick look.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from weightshare.runtimes.memory import run_child_peak
from weightshare.samples import mlp_onnx

ONNX_EXTERNALISE = (
    "import onnx, sys; m = onnx.load(sys.argv[1]); "
    "onnx.save_model(m, sys.argv[2], save_as_external_data=True, all_tensors_to_one_file=True, "
    "location='weights.data', size_threshold=1024)"
)


def timed(cmd: list[str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    res, peak = run_child_peak(cmd)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr}")
    return wall, peak


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.iterdir() if p.is_file()) if path.exists() else 0


def bench_one(label: str, model: Path, work: Path) -> dict:
    out_cp, out_ws, out_onnx = work / "cp", work / "ws", work / "onnx"
    for d in (out_cp, out_ws, out_onnx):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    inputs = [str(p) for p in model.parent.iterdir() if p.is_file() and p.stem == model.stem]
    # cp first: it also warms the page cache for the two that follow.
    cp_wall, cp_peak = timed(["cp", *inputs, str(out_cp)])
    cp_wall, cp_peak = timed(["cp", *inputs, str(out_cp)])
    # weightshare fsyncs its outputs before renaming them into place (a crash must not leave a renamed but
    # empty file); cp does not. `sync FILE` fsyncs the copies, for a like-for-like figure.
    copies = " ".join(f"'{out_cp / Path(p).name}'" for p in inputs)
    sync_wall, _ = timed(["sh", "-c", f"cp {' '.join(repr(p) for p in inputs)} '{out_cp}' && sync {copies}"])
    ws_wall, ws_peak = timed([sys.executable, "-m", "weightshare", "convert", str(model), "-o", str(out_ws), "-q"])
    on_wall, on_peak = timed([sys.executable, "-c", ONNX_EXTERNALISE, str(model), str(out_onnx / model.name)])
    row = {"model": label, "input_gib": sum(Path(p).stat().st_size for p in inputs) / (1 << 30),
           "cp_s": cp_wall, "cp_mib": cp_peak, "cp_sync_s": sync_wall, "ws_s": ws_wall, "ws_mib": ws_peak, "onnx_s": on_wall,
           "onnx_mib": on_peak, "ws_out_gib": size_of(out_ws / model.name) / (1 << 30)}
    for d in (out_cp, out_ws, out_onnx):
        shutil.rmtree(d, ignore_errors=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ws-bench"))
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    rows = []
    specs = [  # label, layers of 2048x2048 (fp32: 16 MiB each; fp16: 8 MiB), weights, external, dim
        ("1 GiB fp32 embedded", 64, "float32", False, 2048),
        ("1 GiB fp16 + Cast embedded", 128, "float16", False, 2048),
        ("4 GiB fp32 external data", 64, "float32", True, 4096),
    ]
    for label, layers, weights, external, dim in specs:
        d = work / label.replace(" ", "_").replace("+", "")
        d.mkdir(parents=True)
        n = max(1, int(layers * args.scale))
        print(f"generating {label} ({n} layers, dim {dim}) ...", file=sys.stderr, flush=True)
        model = mlp_onnx(d / "model.onnx", layers=n, dim=dim, weights=weights, external=external)
        print(f"benchmarking {label} ...", file=sys.stderr, flush=True)
        rows.append(bench_one(label, model, work / "out"))
        shutil.rmtree(d, ignore_errors=True)

    head = (f"{'model':28} {'input':>8} | {'cp s':>6} {'+sync s':>7} {'cp MiB':>7} | {'weightshare s':>13} "
            f"{'MiB':>6} | {'onnx s':>7} {'MiB':>7} | {'ws/cp':>6} {'ws/cp+sync':>10} {'onnx/ws RSS':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:28} {r['input_gib']:>6.2f}Gi | {r['cp_s']:>6.2f} {r['cp_sync_s']:>7.2f} "
              f"{r['cp_mib']:>7.0f} | {r['ws_s']:>13.2f} {r['ws_mib']:>6.0f} | {r['onnx_s']:>7.2f} "
              f"{r['onnx_mib']:>7.0f} | {r['ws_s'] / r['cp_s']:>5.2f}x {r['ws_s'] / r['cp_sync_s']:>9.2f}x "
              f"{r['onnx_mib'] / r['ws_mib']:>10.1f}x")


if __name__ == "__main__":
    main()
