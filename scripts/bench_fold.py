#!/usr/bin/env python3
"""Benchmark: fold/plan/emit cost in the number of tensors.

Builds a model with N fp16 initializers of 8 KiB (4096 elements) each behind its own Cast(to=FLOAT),
chained by Add, and times, each in a fresh child process:
  - weightshare convert MODEL -o OUT   (folds every Cast)
  - onnx.load + onnx.save               (the floor the issue compares with)

    python scripts/bench_fold.py [--count 4000] [--workdir /tmp/ws-bench-fold]

Run it from outside the checkout (or with PYTHONPATH set) to pick the weightshare you mean: `python -m`
puts the current directory first on sys.path.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build(path: Path, count: int, elements: int = 4096) -> None:
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    acc = "x"
    for i in range(count):
        inits.append(numpy_helper.from_array(rng.standard_normal(elements).astype(np.float16), f"w{i}"))
        nodes.append(helper.make_node("Cast", [f"w{i}"], [f"c{i}"], to=TensorProto.FLOAT))
        out = "y" if i == count - 1 else f"a{i}"
        nodes.append(helper.make_node("Add", [acc, f"c{i}"], [out]))
        acc = out
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [elements])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [elements])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one child: CPU is the robust figure on a loaded machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr}")
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=4000)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ws-bench-fold"))
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    model = args.workdir / "m.onnx"
    build(model, args.count)
    onnx_wall, onnx_cpu = timed(
        [
            sys.executable,
            "-c",
            "import onnx, sys; onnx.save(onnx.load(sys.argv[1]), sys.argv[2])",
            str(model),
            str(args.workdir / "copy.onnx"),
        ]
    )
    ws_wall, ws_cpu = timed(
        [sys.executable, "-m", "weightshare", "convert", "-q", str(model), "-o", str(args.workdir / "out")]
    )
    print(f"{args.count} fp16+Cast initializers of 8 KiB ({model.stat().st_size / 2**20:.1f} MiB):")
    print(f"  onnx load+save       {onnx_wall:7.2f} s wall {onnx_cpu:7.2f} s CPU")
    print(
        f"  weightshare convert  {ws_wall:7.2f} s wall {ws_cpu:7.2f} s CPU  "
        f"({ws_wall / onnx_wall:.2f}x wall, {ws_cpu / onnx_cpu:.2f}x CPU)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
