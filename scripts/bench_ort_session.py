"""Session start of --prepack outputs, the cost of weightshare.ort.session, and PSS of 1..4 sessions, side by side.

Usage: python scripts/bench_ort_session.py [--workdir DIR] [--cases start,pss] [--gib 1] [--repeat 3]

start  A MatMul/Gemm model of --gib GiB of fp32 weights in external data (``mixed_onnx``), converted with
       --prepack. Each row is a fresh process (interpreter start, ``import onnxruntime``, session creation with
       default options, one run of a batch of 4); rows run round-robin --repeat times and the medians are
       printed: wall and CPU s of the whole child (getrusage of a wrapper that only spawns it), CPU s of the
       session creation + first run alone (process_time inside the child), its private memory after the run
       (Anonymous in smaps_rollup: heap and other memory no file backs; mapped weights are not in it) and peak
       RSS. Rows:
         python -c pass / python -c "import onnx"       the interpreter's and onnx's own start (anchors)
         original                                        InferenceSession of the source model
         --prepack, plain InferenceSession               InferenceSession of the prepacked model
         --prepack, helper, first process                weightshare.ort.session, empty verdict cache
         --prepack, helper, next process                 weightshare.ort.session, the verdict cached
       and cold (the model's files dropped from the page cache with posix_fadvise(DONTNEED) before the run),
       with the MiB of the blob / data file resident afterwards (fincore): what the session read.
pss    For a MatMul/Gemm model (64 MiB of weights) and a Conv model (54 MiB), converted without --prepack, the
       PSS (MiB above the interpreter's own) after each session and the ratio 4 sessions / 1 session, for
       ``onnxruntime.InferenceSession(path)`` (default options) and ``weightshare.ort.session(path)``, each in a
       fresh process started with MALLOC_MMAP_THRESHOLD_=1048576.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders)
from prepack_samples import mixed_onnx, sample_input

from weightshare.api import convert
from weightshare.options import ConvertOptions

PROBE = """
import json, sys
import onnxruntime as ort
import weightshare.ort as wort
from weightshare._runtimes.memory import memory_now
from prepack_samples import sample_input
path, src, how = sys.argv[1:]
rows, sessions = [], []
base = memory_now()["pss_mib"]
for _ in range(4):
    s = wort.session(path) if how == "helper" else ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    s.run(None, sample_input(src, 4))
    sessions.append(s)
    rows.append(round(memory_now()["pss_mib"] - base, 1))
print(json.dumps(rows))
"""

START = """
import sys, time
how, path, inputs = sys.argv[1:]
cpu0 = time.process_time()
import numpy as np
import onnxruntime as ort
x = dict(np.load(inputs))
cpu1 = time.process_time()
if how == "helper":
    import weightshare.ort as wort
    s = wort.session(path)
else:
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
s.run(None, x)
cpu2 = time.process_time()
import json
from weightshare._runtimes.memory import smaps_rollup
print(json.dumps({"session_cpu": cpu2 - cpu1, "anon_mib": smaps_rollup()["Anonymous"] / 2**20,
                  "onnx_imported": "onnx" in sys.modules}))
"""

WRAPPER = """
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
wall = time.perf_counter() - t0
u = resource.getrusage(resource.RUSAGE_CHILDREN)
sys.stderr.write(r.stderr)
last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "{}"
print(json.dumps({"rc": r.returncode, "wall": wall, "cpu": u.ru_utime + u.ru_stime, "peak": u.ru_maxrss / 1024,
                  "child": json.loads(last) if last.startswith("{") else {}}))
"""


def drop_cache(files: list[Path]) -> None:
    """Evict these files' clean pages from the page cache (no root needed)."""
    os.sync()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_mib(f: Path) -> float:
    """MiB of ``f`` in the page cache (util-linux fincore)."""
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", str(f)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0]) / (1 << 20)


def run_row(cmd: list[str], env: dict[str, str]) -> dict:
    res = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True, env=env)
    fig = json.loads(res.stdout.strip().splitlines()[-1])
    if fig["rc"] != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{res.stderr}")
    return fig


def case_start(d: Path, gib: float, repeat: int) -> None:
    dim = 8192
    layers = max(1, round(gib * (1 << 30) / (dim * dim * 4)))
    (d / "src").mkdir(parents=True, exist_ok=True)
    src = mixed_onnx(d / "src" / "m.onnx", conv_layers=0, channels=1024, mm_layers=layers, dim=dim)
    out = d / "out"
    if not (out / "m.onnx").exists():
        convert(src, out, ConvertOptions(prepack=True))
    inputs = d / "x.npz"
    import numpy as np

    np.savez(inputs, **sample_input(src, 4))
    blob = next(out.glob("*.safetensors"))
    cache = d / "cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    py = sys.executable
    originals = [src, src.with_suffix(".data")]
    prepacked = [out / "m.onnx", out / "m.portable.onnx", blob]

    def helper_first() -> list[str]:
        shutil.rmtree(cache, ignore_errors=True)
        return [py, "-c", START, "helper", str(out / "m.onnx"), str(inputs)]

    rows = {
        "python -c pass": (lambda: [py, "-c", "pass"], None, None),
        'python -c "import onnx"': (lambda: [py, "-c", "import onnx"], None, None),
        "original, warm": (lambda: [py, "-c", START, "plain", str(src), str(inputs)], None, None),
        "--prepack, plain InferenceSession, warm": (
            lambda: [py, "-c", START, "plain", str(out / "m.onnx"), str(inputs)],
            None,
            None,
        ),
        "--prepack, helper, first process, warm": (helper_first, None, None),
        "--prepack, helper, next process, warm": (
            lambda: [py, "-c", START, "helper", str(out / "m.onnx"), str(inputs)],
            None,
            None,
        ),
        "original, cold": (
            lambda: [py, "-c", START, "plain", str(src), str(inputs)],
            originals,
            src.with_suffix(".data"),
        ),
        "--prepack, plain InferenceSession, cold": (
            lambda: [py, "-c", START, "plain", str(out / "m.onnx"), str(inputs)],
            prepacked,
            blob,
        ),
    }
    got: dict[str, list[dict]] = {name: [] for name in rows}
    for _ in range(repeat):
        for name, (cmd, cold, data) in rows.items():
            c = cmd()
            if cold:
                drop_cache(cold)
            else:
                for f in originals + prepacked:  # warm: every file read once
                    subprocess.run(["cat", str(f)], stdout=subprocess.DEVNULL, check=True)
            fig = run_row(c, env)
            if data is not None:
                fig["resident"] = resident_mib(data)
            got[name].append(fig)
    size = sum(f.stat().st_size for f in originals[1:]) / (1 << 30)
    blob_gib = blob.stat().st_size / (1 << 30)
    print(
        f"\nsession start, MatMul/Gemm model of {size:.2f} GiB fp32 (data file), blob {blob_gib:.2f} GiB; "
        f"median of {repeat} round-robin run(s); load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"  {'':44} {'wall s':>7} {'CPU s':>7} {'session CPU s':>14} {'private MiB':>12} {'peak MiB':>9}"
        f" {'resident MiB':>13}"
    )
    med: dict[str, dict[str, float]] = {}
    for name, runs in got.items():
        m = {
            "wall": statistics.median(r["wall"] for r in runs),
            "cpu": statistics.median(r["cpu"] for r in runs),
            "peak": max(r["peak"] for r in runs),
        }
        if runs[0]["child"]:
            m["session_cpu"] = statistics.median(r["child"]["session_cpu"] for r in runs)
            m["private"] = max(r["child"]["anon_mib"] for r in runs)
        if "resident" in runs[0]:
            m["resident"] = statistics.median(r["resident"] for r in runs)
        med[name] = m

        def col(key: str, width: int, fmt: str = ".2f", m: dict[str, float] = m) -> str:
            return f"{m[key]:>{width}{fmt}}" if key in m else " " * (width - 1) + "-"

        print(
            f"  {name:44} {m['wall']:>7.2f} {m['cpu']:>7.2f} {col('session_cpu', 14)} {col('private', 12, '.1f')}"
            f" {m['peak']:>9.0f} {col('resident', 13, '.0f')}"
        )
    o, p = med["original, warm"], med["--prepack, plain InferenceSession, warm"]
    print(f"  --prepack plain / original, warm, session CPU (target <= 1.0): {p['session_cpu'] / o['session_cpu']:.2f}")
    oc, pc = med["original, cold"], med["--prepack, plain InferenceSession, cold"]
    print(f"  --prepack plain / original, cold, wall (target <= 1.0): {pc['wall'] / oc['wall']:.2f}")
    for which in ("first", "next"):
        h = med[f"--prepack, helper, {which} process, warm"]
        print(f"  helper ({which} process) - plain, CPU s of the child (target <= 0.1): {h['cpu'] - p['cpu']:.2f}")


def case_pss(d: Path) -> None:
    models = {
        "matmul": dict(conv_layers=0, channels=1024, mm_layers=4, dim=2048),
        "conv": dict(conv_layers=6, channels=512, mm_layers=0, dim=16, spatial=4),
    }
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    for name, kw in models.items():
        (d / name).mkdir(parents=True, exist_ok=True)
        src = mixed_onnx(d / name / f"{name}.onnx", **kw)
        convert(src, d / f"{name}-out")
        out = d / f"{name}-out" / src.name
        for how in ("default", "helper"):
            res = subprocess.run(
                [sys.executable, "-c", PROBE, str(out), str(src), how], capture_output=True, text=True, env=env
            )
            rows = json.loads(res.stdout.splitlines()[-1])
            print(f"{name:7s} {how:8s} PSS MiB after 1..4 sessions {rows}  4/1 = {rows[3] / rows[0]:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=None, help="kept (and reused by --cases start) when given")
    ap.add_argument("--cases", default="start,pss")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        d = args.workdir or Path(tmp)
        if "start" in cases:
            case_start(d / f"start-{args.gib:g}gib", args.gib, max(1, args.repeat))
        if "pss" in cases:
            case_pss(d / "pss")


if __name__ == "__main__":
    main()
