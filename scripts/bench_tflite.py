"""TFLite benchmark: what folding fp16 DEQUANTIZE into shared fp32 weights buys, measured side by side.

Generates a model with CONV_2D and FULLY_CONNECTED weights stored as fp16 + DEQUANTIZE (>= 256 MiB as fp32),
converts it with weightshare, then measures in fresh child processes:
  1. peak RSS (ru_maxrss of the child) and wall time of the conversion vs `cp` of the same file;
  2. PSS (/proc/<pid>/smaps_rollup) of 1, 2, 4, 8 interpreters in one process, original vs converted,
     with the default XNNPACK delegate and with BUILTIN_WITHOUT_DEFAULT_DELEGATES;
  3. PSS of two processes with one interpreter each (no delegate).
Optionally (--big-gib 1) the conversion peak RSS on a ~1 GiB model.

Usage: python scripts/bench_tflite.py [--workdir DIR] [--fp32-mib 256] [--big-gib 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FC_DIM = 4096  # one FULLY_CONNECTED layer: 4096 x 4096 weights = 64 MiB as fp32


def generate(path: Path, fp32_mib: int, seed: int = 0) -> Path:
    """CONV_2D (fp16 filter) -> RESHAPE -> FULLY_CONNECTED x n (fp16 weights), every weight behind DEQUANTIZE."""
    import numpy as np
    from ai_edge_litert import schema_py_generated as s

    sys.path.insert(0, str(REPO / "tests"))
    from tflite_fixtures import OP, ModelBuilder

    rng = np.random.default_rng(seed)
    layers = max(1, round(fp32_mib / (FC_DIM * FC_DIM * 4 / 2 ** 20)))
    mb = ModelBuilder()
    g = mb.subgraph("main")
    x = g.input("x", [1, 8, 8, 64])
    w = g.dequantize("conv_w", (rng.standard_normal((64, 3, 3, 64), np.float32) * 0.05).astype(np.float16))
    c = g.tensor("conv", [1, 8, 8, 64], "float32")
    g.op(OP.CONV_2D, [x, w, g.const("conv_b", np.zeros(64, np.float32))], [c], s.BuiltinOptions.Conv2DOptions,
         s.Conv2DOptionsT(padding=s.Padding.SAME, strideW=1, strideH=1))
    h = g.tensor("flat", [1, FC_DIM], "float32")
    g.op(OP.RESHAPE, [c, g.const("shape", np.array([1, FC_DIM], np.int32))], [h], s.BuiltinOptions.ReshapeOptions,
         s.ReshapeOptionsT(newShape=[1, FC_DIM]))
    for i in range(layers):
        wi = g.dequantize(f"fc{i}_w", (rng.standard_normal((FC_DIM, FC_DIM), np.float32) * 0.02).astype(np.float16))
        hi = g.tensor(f"fc{i}", [1, FC_DIM], "float32")
        g.op(OP.FULLY_CONNECTED, [h, wi, g.const(f"fc{i}_b", np.zeros(FC_DIM, np.float32))], [hi],
             s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
        h = hi
    g.outputs = [h]
    mb.signature("serving_default", g)
    return mb.save(path)


def measured(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS MiB, wall s) of ``cmd``, measured by a fresh Python parent: ru_maxrss of RUSAGE_CHILDREN."""
    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
             "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True, text=True).stdout
    wall, kib = out.split()
    return int(kib) / 1024, float(wall)


def convert_cmd(src: Path, out: Path) -> list[str]:
    return [sys.executable, "-c", "import sys; from weightshare.api import convert; convert(sys.argv[1], sys.argv[2])",
            str(src), str(out)]


def smaps(pid: int | str = "self") -> dict[str, float]:
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[1].isdigit():
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return fields


def _load(path: str, mode: str):
    """One runtime instance of ``path``, invoked once; ``mode``: none | xnnpack | cache:<weight cache file>."""
    import numpy as np

    x = np.ones((1, 8, 8, 64), np.float32)
    if mode.startswith("cache:"):
        from ai_edge_litert.compiled_model import CompiledModel
        from ai_edge_litert.cpu_options import CpuOptions
        from ai_edge_litert.options import Options

        cm = CompiledModel.from_file(path, options=Options(cpu_options=CpuOptions(
            xnnpack_weight_cache_path=mode[len("cache:"):])))
        ins, outs = cm.create_input_buffers(0), cm.create_output_buffers(0)
        ins[0].write(x)
        cm.run_by_index(0, ins, outs)
        return cm, ins, outs
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    resolver = OpResolverType.AUTO if mode == "xnnpack" else OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    it = Interpreter(model_path=path, experimental_op_resolver_type=resolver)
    runner = it.get_signature_runner("serving_default")
    runner(x=x)
    return it, runner


def child_interpreters(path: str, n: int, mode: str) -> None:
    """Runs in a child: n runtime instances in one process; prints PSS/RSS in MiB."""
    import ai_edge_litert.interpreter  # noqa: F401  (library mappings belong to the baseline)

    base = smaps()
    keep = [_load(path, mode) for _ in range(n)]
    now = smaps()
    print(json.dumps({"pss": now["Pss"], "rss": now["Rss"], "pss_delta": now["Pss"] - base["Pss"]}))
    if os.environ.get("BENCH_HOLD"):
        sys.stdout.flush()
        sys.stdin.readline()
    del keep


def interpreters(path: Path, n: int, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", str(path), str(n), mode]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def two_processes(path: Path) -> float:
    """Sum of the PSS of two processes holding one interpreter each (no delegate), read while both live."""
    env = dict(os.environ, BENCH_HOLD="1")
    cmd = [sys.executable, __file__, "--child", str(path), "1", "none"]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env=env) for _ in range(2)]
    try:
        for p in procs:
            p.stdout.readline()
        return sum(smaps(p.pid)["Pss"] for p in procs)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--fp32-mib", type=int, default=256)
    ap.add_argument("--big-gib", type=float, default=0, help="also measure conversion of a model this big (fp16 file)")
    ap.add_argument("--sessions", default="1,2,4,8")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_interpreters(args.child[0], int(args.child[1]), args.child[2])
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_tflite_"))
    work.mkdir(parents=True, exist_ok=True)
    src = generate(work / "model.tflite", args.fp32_mib)
    out_dir = work / "out"
    shutil.rmtree(out_dir, ignore_errors=True)
    size = src.stat().st_size / 2 ** 20
    cp_rss, cp_wall = measured(["cp", str(src), str(work / "copy.tflite")])
    cv_rss, cv_wall = measured(convert_cmd(src, out_dir))
    conv = out_dir / src.name
    print(f"model: {src} ({size:.0f} MiB fp16 file, {args.fp32_mib} MiB fp32-equivalent weights); "
          f"converted: {conv.stat().st_size / 2 ** 20:.0f} MiB")
    print("\n| conversion | peak RSS MiB | wall s |\n|---|---|---|")
    print(f"| cp | {cp_rss:.1f} | {cp_wall:.2f} |\n| weightshare convert | {cv_rss:.1f} | {cv_wall:.2f} |")
    print("\n| instances | runtime | original PSS MiB | converted PSS MiB | original RSS MiB | "
          "converted RSS MiB | original / converted PSS |\n|---|---|---|---|---|---|---|")
    modes = {"none": "Interpreter, no delegate", "xnnpack": "Interpreter, XNNPACK (default)"}
    for mode, label in modes.items():
        for n in [int(v) for v in args.sessions.split(",")]:
            a, b = interpreters(src, n, mode), interpreters(conv, n, mode)
            print(f"| {n} | {label} | {a['pss']:.0f} | {b['pss']:.0f} | {a['rss']:.0f} | {b['rss']:.0f} | "
                  f"{a['pss'] / b['pss']:.2f}x |", flush=True)
    for model in (src, conv):  # the first instance writes the XNNPACK weight cache; measure with it in place
        interpreters(model, 1, f"cache:{model}.xnn_cache")
    for n in [int(v) for v in args.sessions.split(",")]:
        a, b = (interpreters(m, n, f"cache:{m}.xnn_cache") for m in (src, conv))
        print(f"| {n} | CompiledModel, XNNPACK weight cache | {a['pss']:.0f} | {b['pss']:.0f} | {a['rss']:.0f} | "
              f"{b['rss']:.0f} | {a['pss'] / b['pss']:.2f}x |", flush=True)
    p_orig, p_conv = two_processes(src), two_processes(conv)
    print(f"\ntwo processes, one interpreter each, no delegate: PSS sum original {p_orig:.0f} MiB, "
          f"converted {p_conv:.0f} MiB")
    if args.big_gib:
        big = generate(work / "big.tflite", int(args.big_gib * 2048), seed=1)
        shutil.rmtree(work / "big_out", ignore_errors=True)
        cp_rss, cp_wall = measured(["cp", str(big), str(work / "big_copy.tflite")])
        b_rss, b_wall = measured(convert_cmd(big, work / "big_out"))
        print(f"\n{big.stat().st_size / 2 ** 30:.2f} GiB model -> "
              f"{(work / 'big_out' / big.name).stat().st_size / 2 ** 30:.2f} GiB: convert peak RSS {b_rss:.1f} MiB, "
              f"{b_wall:.1f} s; cp peak RSS {cp_rss:.1f} MiB, {cp_wall:.1f} s")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
