"""Multifunction merge: coremltools' save_multifunction vs ``weightshare merge``, side by side.

Builds one fp16 ML Program (default 8 blocks of two 2048x8192 linears: 512 MiB of weights) exported at four
input lengths with coremltools, as one exports a model per sequence length, then merges the first 1..4 of them
into one multifunction .mlpackage with each tool. Every merge runs in a fresh process; a small runner process
starts it and reads ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``, so each figure is that merge alone.

    .venv/bin/python scripts/bench_merge.py [--blocks 8] [--dim 2048] [--lengths 1,64,128,256] [--workdir DIR]

Sources are read from the page cache in both cases (they were just built); wall times include interpreter
start-up and imports for both tools.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def build(path: Path, length: int, blocks: int, dim: int) -> None:
    """One fp16 model with fixed weights (seeded) and input length ``length``."""
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    import coremltools as ct
    import numpy as np
    from coremltools.converters.mil.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    rng = np.random.default_rng(0)
    layers = []
    for _ in range(blocks):
        up = (rng.standard_normal((4 * dim, dim), dtype=np.float32) * 0.02).astype(np.float16)
        down = (rng.standard_normal((dim, 4 * dim), dtype=np.float32) * 0.02).astype(np.float16)
        bias = (rng.standard_normal(4 * dim, dtype=np.float32) * 0.02).astype(np.float16)
        layers.append((up, bias, down))

    @mb.program(input_specs=[mb.TensorSpec(shape=(length, dim), dtype=types.fp16)], opset_version=ct.target.iOS18)
    def prog(x):
        for up, bias, down in layers:
            x = mb.add(x=x, y=mb.linear(x=mb.relu(x=mb.linear(x=x, weight=up, bias=bias)), weight=down))
        return x

    model = ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT16,
        skip_model_load=True,
    )
    model.save(str(path))


def coremltools_merge(out: Path, sources: list[str]) -> None:
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    import coremltools as ct

    desc = ct.utils.MultiFunctionDescriptor()
    for i, src in enumerate(sources):
        desc.add_function(src, "main", f"f{i}")
    desc.default_function_name = "f0"
    ct.utils.save_multifunction(desc, str(out))


def measure(cmd: list[str]) -> dict:
    """Run ``cmd`` in a fresh child of a fresh runner; return its peak RSS and wall time."""
    runner = (
        "import json, resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)\n"
        "wall = time.perf_counter() - t\n"
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
        "print(json.dumps({'rc': r.returncode, 'err': r.stderr[-2000:], 'wall': wall, 'rss_kib': rss}))\n"
    )
    out = subprocess.run([sys.executable, "-c", runner, *cmd], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    if result["rc"] != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed:\n{result['err']}")
    return result


def weight_bin_size(pkg: Path) -> int:
    return (pkg / "Data/com.apple.CoreML/weights/weight.bin").stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--lengths", default="1,64,128,256")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the built models and outputs")
    ap.add_argument("--no-coremltools", action="store_true", help="skip save_multifunction runs")
    args = ap.parse_args()

    lengths = [int(v) for v in args.lengths.split(",")]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_merge_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        sources = []
        for n in lengths:
            src = work / f"model_len{n}.mlpackage"
            if not src.exists():
                t = time.perf_counter()
                subprocess.run(
                    [sys.executable, str(HERE), "_build", str(src), str(n), str(args.blocks), str(args.dim)],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                print(
                    f"built {src.name}: {weight_bin_size(src) / 2**20:.1f} MiB of weights "
                    f"in {time.perf_counter() - t:.1f} s",
                    flush=True,
                )
            sources.append(str(src))

        rows = []
        for k in range(1, len(sources) + 1):
            row = {"functions": k}
            tools = [("ws", ["-m", "weightshare", "merge"]), ("ws64", ["-m", "weightshare", "merge"])]
            if not args.no_coremltools:
                tools.insert(0, ("ct", [str(HERE), "_ct"]))
            for tool, head in tools:
                out = work / f"merged_{tool}_{k}.mlpackage"
                shutil.rmtree(out, ignore_errors=True)
                if tool == "ct":
                    cmd = [sys.executable, *head, str(out), *sources[:k]]
                else:
                    cmd = [sys.executable, *head, *sources[:k], "-o", str(out)]
                    for i in range(k):
                        cmd += ["--function-name", f"f{i}"]
                    if tool == "ws64":
                        cmd += ["--align", "64"]
                m = measure(cmd)
                row[tool] = {"rss_mib": m["rss_kib"] / 1024, "wall_s": m["wall"], "bin": weight_bin_size(out)}
                if not args.keep:
                    shutil.rmtree(out, ignore_errors=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
        print_table(rows, weight_bin_size(Path(sources[0])))
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def print_table(rows: list[dict], source_bin: int) -> None:
    has_ct = "ct" in rows[0]
    print()
    print(f"source weight.bin: {source_bin:,} bytes ({source_bin / 2**20:.1f} MiB) per model")
    head = "| functions |"
    line = "|---|"
    if has_ct:
        head += " save_multifunction RSS MiB | wall s | weight.bin bytes |"
        line += "---|---|---|"
    head += " weightshare RSS MiB | wall s | weight.bin bytes | weightshare --align 64: weight.bin bytes |"
    line += "---|---|---|---|"
    if has_ct:
        head += " RSS ratio ct/ws | speed-up |"
        line += "---|---|"
    print(head)
    print(line)
    for r in rows:
        cells = [str(r["functions"])]
        if has_ct:
            c = r["ct"]
            cells += [f"{c['rss_mib']:.0f}", f"{c['wall_s']:.1f}", f"{c['bin']:,}"]
        w = r["ws"]
        cells += [f"{w['rss_mib']:.0f}", f"{w['wall_s']:.1f}", f"{w['bin']:,}", f"{r['ws64']['bin']:,}"]
        if has_ct:
            cells += [f"{r['ct']['rss_mib'] / w['rss_mib']:.1f}x", f"{r['ct']['wall_s'] / w['wall_s']:.1f}x"]
        print("| " + " | ".join(cells) + " |")
    ws_rss = [r["ws"]["rss_mib"] for r in rows]
    print()
    print(
        f"weightshare peak RSS from 1 to {len(rows)} functions: {ws_rss[0]:.0f} -> {ws_rss[-1]:.0f} MiB "
        f"({(ws_rss[-1] / ws_rss[0] - 1) * 100:+.1f}%), max {max(ws_rss):.0f} MiB"
    )
    if has_ct:
        extra = [r["ws"]["bin"] - r["ct"]["bin"] for r in rows]
        print(
            f"weight.bin weightshare - coremltools: {', '.join(f'{e:+,}' for e in extra)} bytes "
            "(64 KiB alignment of payloads >= 1 MiB; --align 64 column: coremltools' own 64-byte layout)"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_build":
        build(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_ct":
        coremltools_merge(Path(sys.argv[2]), sys.argv[3:])
    else:
        main()
