"""TFLite benchmark: what folding fp16 DEQUANTIZE into shared fp32 weights buys, measured side by side.

Generates a model with CONV_2D and FULLY_CONNECTED weights stored as fp16 + DEQUANTIZE (>= 256 MiB as fp32),
converts it with weightshare, then measures in fresh child processes:
  1. peak RSS (ru_maxrss of the child) and wall time of the conversion vs `cp` of the same file;
  2. PSS (/proc/<pid>/smaps_rollup) of 1, 2, 4, 8 interpreters in one process, original vs converted,
     with the default XNNPACK delegate and with BUILTIN_WITHOUT_DEFAULT_DELEGATES;
  3. PSS of two processes with one interpreter each (no delegate);
  4. the XNNPACK weight cache (`convert --prepack`, loaded with `weightshare.litert.compiled_model`): PSS above an
     idle process that imported the runtime for 1/4/8 CompiledModels in one process and for 1/2/4 processes, next
     to CompiledModel without a cache and the default Interpreter; load and run latency; outputs compared
     byte for byte with the original model run through CompiledModel without a cache;
  5. peak RSS of `convert --prepack` (the converter, and the child process that builds the cache).
Optionally (--big-gib 1) the conversion peak RSS on a ~1 GiB model (with and without --prepack).

Usage: python scripts/bench_tflite.py [--workdir DIR] [--fp32-mib 256] [--big-gib 1] [--only-cache]
       python scripts/bench_tflite.py --recipes [ARGS of scripts/bench_tflite_recipes.py]
         (fp32, fp16, full int8, dynamic-range int8 and weight-only int8 models of >= 64 MiB: PSS of 1/4
         instances and 1/3 processes, latency vs the default Interpreter, for each loading recipe)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
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
    layers = max(1, round(fp32_mib / (FC_DIM * FC_DIM * 4 / 2**20)))
    mb = ModelBuilder()
    g = mb.subgraph("main")
    x = g.input("x", [1, 8, 8, 64])
    w = g.dequantize("conv_w", (rng.standard_normal((64, 3, 3, 64), np.float32) * 0.05).astype(np.float16))
    c = g.tensor("conv", [1, 8, 8, 64], "float32")
    g.op(
        OP.CONV_2D,
        [x, w, g.const("conv_b", np.zeros(64, np.float32))],
        [c],
        s.BuiltinOptions.Conv2DOptions,
        s.Conv2DOptionsT(padding=s.Padding.SAME, strideW=1, strideH=1),
    )
    h = g.tensor("flat", [1, FC_DIM], "float32")
    g.op(
        OP.RESHAPE,
        [c, g.const("shape", np.array([1, FC_DIM], np.int32))],
        [h],
        s.BuiltinOptions.ReshapeOptions,
        s.ReshapeOptionsT(newShape=[1, FC_DIM]),
    )
    for i in range(layers):
        wi = g.dequantize(f"fc{i}_w", (rng.standard_normal((FC_DIM, FC_DIM), np.float32) * 0.02).astype(np.float16))
        hi = g.tensor(f"fc{i}", [1, FC_DIM], "float32")
        g.op(
            OP.FULLY_CONNECTED,
            [h, wi, g.const(f"fc{i}_b", np.zeros(FC_DIM, np.float32))],
            [hi],
            s.BuiltinOptions.FullyConnectedOptions,
            s.FullyConnectedOptionsT(),
        )
        h = hi
    g.outputs = [h]
    mb.signature("serving_default", g)
    return mb.save(path)


def measured(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS MiB, wall s) of ``cmd``, measured by a fresh Python parent: ru_maxrss of RUSAGE_CHILDREN."""
    probe = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
        "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True, text=True).stdout
    wall, kib = out.split()
    return int(kib) / 1024, float(wall)


def convert_cmd(src: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-c",
        "import sys; from weightshare.api import convert; convert(sys.argv[1], sys.argv[2])",
        str(src),
        str(out),
    ]


def smaps(pid: int | str = "self") -> dict[str, float]:
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[1].isdigit():
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return fields


def _load(path: str, mode: str):
    """One runtime instance of ``path``, invoked once; returns (keep-alive, run callable).

    ``mode``: none | xnnpack (Interpreter) | compiled (CompiledModel, no cache) | cache:<file> (CompiledModel with
    that weight cache, straight LiteRT) | helper (``weightshare.litert.compiled_model``).
    """
    import numpy as np

    x = np.ones((1, 8, 8, 64), np.float32)
    if mode in ("compiled", "helper") or mode.startswith("cache:"):
        from ai_edge_litert.compiled_model import CompiledModel
        from ai_edge_litert.cpu_options import CpuOptions
        from ai_edge_litert.options import Options

        if mode == "helper":
            from weightshare.litert import compiled_model

            cm = compiled_model(path)
            assert cm.weightshare_cache is not None, "no matching cache"
        elif mode == "compiled":
            cm = CompiledModel.from_file(path)
        else:
            cm = CompiledModel.from_file(
                path,
                options=Options(cpu_options=CpuOptions(num_threads=1, xnnpack_weight_cache_path=mode[len("cache:") :])),
            )
        ins, outs = cm.create_input_buffers(0), cm.create_output_buffers(0)
        ins[0].write(x)
        n = int(
            np.prod(
                cm.get_output_tensor_details("serving_default")[
                    cm.get_signature_list()["serving_default"]["outputs"][0]
                ]["shape"]
            )
        )

        def run():
            cm.run_by_index(0, ins, outs)
            return outs[0].read(n, np.float32)

        run()
        return (cm, ins, outs), run
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    resolver = OpResolverType.AUTO if mode == "xnnpack" else OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    it = Interpreter(model_path=path, experimental_op_resolver_type=resolver)
    runner = it.get_signature_runner("serving_default")

    def run_it():
        return next(iter(runner(x=x).values()))

    run_it()
    return (it, runner), run_it


def child_interpreters(path: str, n: int, mode: str) -> None:
    """Runs in a child: n runtime instances in one process; prints PSS/RSS in MiB, latency and an output digest."""
    import ai_edge_litert.compiled_model  # noqa: F401  (library mappings belong to the baseline)
    import ai_edge_litert.interpreter  # noqa: F401

    base = smaps()
    keep, load_s = [], []
    for _ in range(n if mode != "idle" else 0):
        t = time.perf_counter()
        keep.append(_load(path, mode))
        load_s.append(time.perf_counter() - t)
    now = smaps()
    result = {"pss": now["Pss"], "rss": now["Rss"], "pss_delta": now["Pss"] - base["Pss"]}
    if keep:
        run = keep[0][1]
        out = run()
        times = []
        for _ in range(10):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        result.update(
            load_s=sorted(load_s)[len(load_s) // 2],
            run_ms=1000 * sorted(times)[len(times) // 2],
            out_sha=hashlib.sha256(out.tobytes()).hexdigest(),
        )
    print(json.dumps(result), flush=True)
    if os.environ.get("BENCH_HOLD"):
        sys.stdin.readline()
    del keep


def interpreters(path: Path, n: int, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", str(path), str(n), mode]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])


def processes(path: Path, k: int, mode: str) -> float:
    """Sum of the PSS (MiB) of k processes holding one instance each, read while all of them live."""
    env = dict(os.environ, BENCH_HOLD="1")
    cmd = [sys.executable, __file__, "--child", str(path), "1", mode]
    procs = [
        subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
        )
        for _ in range(k)
    ]
    try:
        for p in procs:
            p.stdout.readline()
        return sum(smaps(p.pid)["Pss"] for p in procs)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()


def two_processes(path: Path) -> float:
    """Sum of the PSS of two processes holding one interpreter each (no delegate), read while both live."""
    return processes(path, 2, "none")


def convert_prepack(src: Path, out: Path) -> dict:
    """`weightshare convert --prepack --json` in a fresh process: its own peak RSS, the cache builder's, wall."""
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    # Spawned through a fresh, small Python: Linux carries the spawning process's RSS high-water mark across
    # vfork + exec into the child's ru_maxrss, so spawning from this (big) process would inflate the figure.
    relay = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            relay,
            sys.executable,
            "-m",
            "weightshare",
            "convert",
            str(src),
            "-o",
            str(out),
            "--prepack",
            "--json",
            "-q",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t
    (report,) = json.loads(r.stdout)["reports"]  # the --json document: one record per model
    note = next(n for n in report["notes"] if "built in a child process" in n)
    child = float(note.split("peak RSS ")[1].split(" MiB")[0])
    return {"peak_rss": report["peak_rss_mib"], "child_rss": child, "wall": wall, "cache": report["outputs"][-1]}


def cache_section(src: Path, work: Path, counts: list[int]) -> None:
    """--prepack + weightshare.litert.compiled_model, next to the other ways of running the same weights."""
    out = work / "out_prepack"
    cp = convert_prepack(src, out)
    conv = out / src.name
    print(
        f"\n`weightshare convert --prepack`: converter peak RSS {cp['peak_rss']:.1f} MiB, cache builder (child) "
        f"peak RSS {cp['child_rss']:.1f} MiB, wall {cp['wall']:.2f} s; cache {Path(cp['cache']).name} "
        f"({Path(cp['cache']).stat().st_size / 2**20:.0f} MiB)"
    )
    reference = interpreters(src, 1, "compiled")
    idle = interpreters(src, 1, "idle")
    rows = [
        ("original, CompiledModel, no cache", src, "compiled"),
        ("original, Interpreter, XNNPACK (default)", src, "xnnpack"),
        ("converted, Interpreter, XNNPACK (default)", conv, "xnnpack"),
        ("converted, Interpreter, no delegate", conv, "none"),
        ("converted --prepack, weightshare.litert.compiled_model", conv, "helper"),
    ]
    print(
        f"\nPSS above an idle process that imported the runtime ({idle['pss']:.0f} MiB), MiB; latency of one run "
        "(median of 10) and load + first run of one instance (median)\n"
    )
    print(
        "| runtime | " + " | ".join(f"{n} inst." for n in counts) + f" | {counts[-1]} / 1 | load + first run s | "
        "run ms | outputs = original (CompiledModel, no cache) |\n|---|" + "---|" * (len(counts) + 4)
    )
    for label, model, mode in rows:
        res = [interpreters(model, n, mode) for n in counts]
        same = "yes" if res[0]["out_sha"] == reference["out_sha"] else "NO"
        print(
            f"| {label} | "
            + " | ".join(f"{r['pss_delta']:.0f}" for r in res)
            + f" | {res[-1]['pss_delta'] / res[0]['pss_delta']:.2f}x | {res[0]['load_s']:.2f} | "
            f"{res[0]['run_ms']:.1f} | {same} |",
            flush=True,
        )
    print("\nk processes with one instance each: sum of PSS minus k idle processes (that imported the runtime), MiB\n")
    ks = [1, 2, 4]
    base = {k: processes(src, k, "idle") for k in ks}
    print("| runtime | " + " | ".join(f"{k} proc." for k in ks) + " | 4 / 1 |\n|---|" + "---|" * (len(ks) + 1))
    for label, model, mode in rows:
        d = {k: processes(model, k, mode) - base[k] for k in ks}
        print(f"| {label} | " + " | ".join(f"{d[k]:.0f}" for k in ks) + f" | {d[4] / d[1]:.2f}x |", flush=True)


def cache_sections(src: Path, work: Path, args) -> None:
    cache_section(src, work, [int(v) for v in args.sessions.split(",") if int(v) in (1, 4, 8)] or [1])
    sizes = [int(v) for v in args.prepack_sizes.split(",") if v]
    if sizes:
        print(
            "\n| model (fp32 weights) | converter peak RSS MiB | cache builder peak RSS MiB | wall s |\n"
            "|---|---|---|---|"
        )
    for mib in sizes:
        model = generate(work / f"prepack_{mib}.tflite", mib, seed=2)
        r = convert_prepack(model, work / f"prepack_{mib}_out")
        print(f"| {mib} MiB | {r['peak_rss']:.1f} | {r['child_rss']:.1f} | {r['wall']:.2f} |", flush=True)
        shutil.rmtree(work / f"prepack_{mib}_out", ignore_errors=True)
        model.unlink()


def main() -> None:
    if sys.argv[1:2] == ["--recipes"]:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_tflite_recipes

        sys.argv = [str(Path(bench_tflite_recipes.__file__)), *sys.argv[2:]]
        bench_tflite_recipes.main()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--fp32-mib", type=int, default=256)
    ap.add_argument("--big-gib", type=float, default=0, help="also measure conversion of a model this big (fp16 file)")
    ap.add_argument("--sessions", default="1,2,4,8")
    ap.add_argument("--only-cache", action="store_true", help="only the --prepack / XNNPACK weight cache sections")
    ap.add_argument(
        "--prepack-sizes",
        default="128,1024",
        help="fp32 MiB of the models whose `convert --prepack` peak RSS is measured (empty: skip)",
    )
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_interpreters(args.child[0], int(args.child[1]), args.child[2])
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_tflite_"))
    work.mkdir(parents=True, exist_ok=True)
    src = generate(work / "model.tflite", args.fp32_mib)
    if args.only_cache:
        cache_sections(src, work, args)
        return
    out_dir = work / "out"
    shutil.rmtree(out_dir, ignore_errors=True)
    size = src.stat().st_size / 2**20
    cp_rss, cp_wall = measured(["cp", str(src), str(work / "copy.tflite")])
    cv_rss, cv_wall = measured(convert_cmd(src, out_dir))
    conv = out_dir / src.name
    print(
        f"model: {src} ({size:.0f} MiB fp16 file, {args.fp32_mib} MiB fp32-equivalent weights); "
        f"converted: {conv.stat().st_size / 2**20:.0f} MiB"
    )
    print("\n| conversion | peak RSS MiB | wall s |\n|---|---|---|")
    print(f"| cp | {cp_rss:.1f} | {cp_wall:.2f} |\n| weightshare convert | {cv_rss:.1f} | {cv_wall:.2f} |")
    print(
        "\n| instances | runtime | original PSS MiB | converted PSS MiB | original RSS MiB | "
        "converted RSS MiB | original / converted PSS |\n|---|---|---|---|---|---|---|"
    )
    modes = {"none": "Interpreter, no delegate", "xnnpack": "Interpreter, XNNPACK (default)"}
    for mode, label in modes.items():
        for n in [int(v) for v in args.sessions.split(",")]:
            a, b = interpreters(src, n, mode), interpreters(conv, n, mode)
            print(
                f"| {n} | {label} | {a['pss']:.0f} | {b['pss']:.0f} | {a['rss']:.0f} | {b['rss']:.0f} | "
                f"{a['pss'] / b['pss']:.2f}x |",
                flush=True,
            )
    for model in (src, conv):  # the first instance writes the XNNPACK weight cache; measure with it in place
        interpreters(model, 1, f"cache:{model}.xnn_cache")
    for n in [int(v) for v in args.sessions.split(",")]:
        a, b = (interpreters(m, n, f"cache:{m}.xnn_cache") for m in (src, conv))
        print(
            f"| {n} | CompiledModel, XNNPACK weight cache | {a['pss']:.0f} | {b['pss']:.0f} | {a['rss']:.0f} | "
            f"{b['rss']:.0f} | {a['pss'] / b['pss']:.2f}x |",
            flush=True,
        )
    p_orig, p_conv = two_processes(src), two_processes(conv)
    print(
        f"\ntwo processes, one interpreter each, no delegate: PSS sum original {p_orig:.0f} MiB, "
        f"converted {p_conv:.0f} MiB"
    )
    cache_sections(src, work, args)
    if args.big_gib:
        big = generate(work / "big.tflite", int(args.big_gib * 2048), seed=1)
        shutil.rmtree(work / "big_out", ignore_errors=True)
        cp_rss, cp_wall = measured(["cp", str(big), str(work / "big_copy.tflite")])
        b_rss, b_wall = measured(convert_cmd(big, work / "big_out"))
        print(
            f"\n{big.stat().st_size / 2**30:.2f} GiB model -> "
            f"{(work / 'big_out' / big.name).stat().st_size / 2**30:.2f} GiB: convert peak RSS {b_rss:.1f} MiB, "
            f"{b_wall:.1f} s; cp peak RSS {cp_rss:.1f} MiB, {cp_wall:.1f} s"
        )
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
