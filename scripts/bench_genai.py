"""onnxruntime-genai folders: do `og.Model`s of a converted folder share their weights?

    python scripts/bench_genai.py [--mib 150] [--fp32] [--folder GENAI_DIR] [--workdir DIR] [--json]

A genai-builder-like llama decoder (``tests/genai_model.py``: GroupQueryAttention, MatMulNBits int4
block 32 accuracy 4, or fp32 MatMul with ``--fp32``) is built in code at ``--mib`` of weights, converted plainly and
with ``--prepack``, and measured in four variants:
  original | plain | --prepack | --prepack helper (``weightshare.genai.model``)
Per variant: PSS above a process that imported onnxruntime_genai and holds no model, after 1 and 4 ``og.Model``s
in one process (each generated 4 tokens), and summed over 3 processes of one model each (all children started with
MALLOC_MMAP_THRESHOLD_=1048576; the baseline imports onnxruntime's Python module too, as the helper
does); CPU seconds (user + system of the process, all threads) of a 32-token prompt and
of 32 decode steps, variants interleaved, median of ``--reps``; whether tokens and every step's logits equal the
original's. ``--folder`` measures an existing genai folder instead (the model builder's real output, e.g. from
``scripts/build_exporter_forms.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders)
import genai_model as gm
import numpy as np

from weightshare._runtimes.memory import memory_now, run_child_peak, smaps_rollup

VARIANTS = ("original", "plain", "--prepack", "--prepack helper")
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 250, 32)]  # inside a test folder's vocabulary too


def _open(folder: str, variant: str):
    import onnxruntime_genai as og

    import weightshare.genai as wgenai

    return wgenai.model(folder) if variant == "--prepack helper" else og.Model(folder)


def probe_models(folder: str, variant: str) -> list[float]:
    """Child: PSS above the no-model baseline after 1..4 og.Models."""
    import onnxruntime  # noqa: F401 - what weightshare.genai.model imports (~24 MiB of PSS, see the docs)
    import onnxruntime_genai  # noqa: F401 - part of the baseline, with what the helper imports

    import weightshare.genai  # noqa: F401
    from weightshare.ort import malloc_trim

    base, rows, models = memory_now()["pss_mib"], [], []
    for _ in range(4):
        m = _open(folder, variant)
        gm.generate(m, PROMPT[:4], 4)
        malloc_trim()
        models.append(m)
        rows.append(round(memory_now()["pss_mib"] - base, 1))
    return rows


def probe_hold(folder: str, variant: str) -> None:
    import onnxruntime  # noqa: F401 - what weightshare.genai.model imports (~24 MiB of PSS, see the docs)
    import onnxruntime_genai  # noqa: F401

    import weightshare.genai  # noqa: F401
    from weightshare.ort import malloc_trim

    base = memory_now()["pss_mib"]
    m = _open(folder, variant)
    gm.generate(m, PROMPT[:4], 4)
    malloc_trim()
    print(json.dumps({"baseline": base}), flush=True)
    sys.stdin.read()


def _child(func: str, folder: str, variant: str, **popen):
    cmd = [sys.executable, __file__, "--probe", func, folder, str(VARIANTS.index(variant))]  # no "--" in argv
    return subprocess.Popen(cmd, env={**os.environ, **MALLOC}, stdout=subprocess.PIPE, text=True, **popen)


def processes(folder: str, variant: str, n: int = 3) -> float:
    procs = [_child("hold", folder, variant, stdin=subprocess.PIPE) for _ in range(n)]
    try:
        bases = [json.loads(p.stdout.readline())["baseline"] for p in procs]
        total = sum(smaps_rollup(p.pid)["Pss"] / 2**20 for p in procs)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()
    return round(total - sum(bases), 1)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timing(folders: dict[str, str], reps: int) -> tuple[dict[str, dict[str, float]], dict[str, bool]]:
    """Median CPU ms of prefill (32 tokens) and of one decode step, interleaved; identity with the original."""
    import onnxruntime_genai as og

    models = {v: _open(f, v) for v, f in folders.items()}
    ref = gm.generate(models["original"], PROMPT, 32)
    same = {}
    for v, m in models.items():
        got = gm.generate(m, PROMPT, 32)
        same[v] = got[0] == ref[0] and all(np.array_equal(a, b) for a, b in zip(got[1], ref[1], strict=True))
    samples: dict[str, dict[str, list[float]]] = {v: {"prefill": [], "decode": []} for v in models}
    for _ in range(reps):
        for v, m in models.items():
            params = og.GeneratorParams(m)
            params.set_search_options(do_sample=False, max_length=len(PROMPT) + 33)
            gen = og.Generator(m, params)
            t0 = _cpu()
            gen.append_tokens(np.array(PROMPT, dtype=np.int32))
            t1 = _cpu()
            for _ in range(32):
                gen.generate_next_token()
            t2 = _cpu()
            samples[v]["prefill"].append((t1 - t0) * 1000)
            samples[v]["decode"].append((t2 - t1) * 1000 / 32)
    return {v: {k: round(statistics.median(s), 2) for k, s in d.items()} for v, d in samples.items()}, same


def convert(src: Path, out: Path, *flags: str) -> dict:
    res, peak = run_child_peak(
        [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q", "--json", *flags]
    )
    if res.returncode != 0:
        raise SystemExit(res.stderr)
    report = json.loads(res.stdout)["reports"][0]  # a folder: one report per model, here its one model
    report["tree_peak_mib"] = peak
    return report


def bench(mib: float, work: Path, int4: bool, reps: int, folder: str | None = None) -> dict:
    t0 = time.perf_counter()
    src = Path(folder) if folder else gm.genai_folder(work / "src", mib=mib, int4=int4)
    built = time.perf_counter() - t0
    weights = (src / "model.onnx.data").stat().st_size / 2**20
    plain = convert(src, work / "plain")
    pre = convert(src, work / "prepack", "--prepack")
    folders = {"original": str(src), "plain": str(work / "plain"), "--prepack": str(work / "prepack")}
    folders["--prepack helper"] = folders["--prepack"]
    r: dict = {"weights_mib": round(weights, 1), "build_s": round(built, 1), "int4": int4, "pss": {}, "procs": {}}
    if folder:
        r["folder"] = str(folder)
    for v, f in folders.items():
        r["pss"][v] = json.loads(_child("models", f, v).communicate()[0].splitlines()[-1])
        r["procs"][v] = processes(f, v)
    r["cpu_ms"], r["identical"] = timing(folders, reps)
    info = pre.get("prepack", {})
    r["convert"] = {
        "plain_wall_s": plain["wall_time_s"],
        "ort_child_peak_mib": info.get("ort_child_peak_rss_mib"),
        "prepack_wall_s": pre["wall_time_s"],
        "prepack_tree_peak_mib": round(pre["tree_peak_mib"]),
        "packed_mib": round(info.get("packed_bytes", 0) / 2**20, 1),
        "ops": {op: f"{t['packed']}/{t['nodes']}" for op, t in info.get("ops", {}).items()},
    }
    return r


def _ratio(value: float, base: float) -> str:
    return f"{value} ({value / base:.2f}x)"


def show(r: dict) -> None:
    variants = list(r["pss"])
    kind = r.get("folder") or ("MatMulNBits int4" if r["int4"] else "fp32 MatMul")
    print(f"\n== genai llama-like decoder, {kind}: {r['weights_mib']} MiB of weights (built in {r['build_s']} s) ==")
    w = 20
    print(f"{'':30}" + "".join(f"{v:>{w}}" for v in variants))
    base = r["cpu_ms"]["original"]
    rows = [
        ("PSS 1 og.Model, MiB", lambda v: f"{r['pss'][v][0]}"),
        ("PSS 4 og.Models, MiB", lambda v: f"{r['pss'][v][3]}"),
        ("PSS 4 og.Models / 1", lambda v: f"{r['pss'][v][3] / r['pss'][v][0]:.2f}"),
        ("PSS 3 processes, MiB", lambda v: f"{r['procs'][v]}"),
        ("PSS 3 processes / 1", lambda v: f"{r['procs'][v] / r['pss'][v][0]:.2f}"),
        ("prefill 32, CPU ms (x orig)", lambda v: _ratio(r["cpu_ms"][v]["prefill"], base["prefill"])),
        ("decode step, CPU ms (x orig)", lambda v: _ratio(r["cpu_ms"][v]["decode"], base["decode"])),
        ("tokens+logits = original", lambda v: str(r["identical"][v])),
    ]  # fmt: skip
    for label, cell in rows:
        print(f"{label:30}" + "".join(f"{cell(v):>{w}}" for v in variants))
    c = r["convert"]
    print(
        f"convert: plain {c['plain_wall_s']} s; --prepack {c['prepack_wall_s']} s, process tree peak "
        f"{c['prepack_tree_peak_mib']} MiB (ORT child {c['ort_child_peak_mib']} MiB), {c['packed_mib']} MiB packed; "
        f"packed nodes per op: {c['ops']}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=150.0, help="weights of the decoder (>= 100 for the figures)")
    ap.add_argument("--fp32", action="store_true", help="fp32 MatMul projections instead of MatMulNBits int4")
    ap.add_argument("--reps", type=int, default=9, help="interleaved timed generations per variant")
    ap.add_argument("--folder", default=None, help="an existing genai folder to measure (nothing is built)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--probe", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        func, folder, index = args.probe
        if func == "models":
            print(json.dumps(probe_models(folder, VARIANTS[int(index)])))
        else:
            probe_hold(folder, VARIANTS[int(index)])
        return
    import onnxruntime as ort
    import onnxruntime_genai as og

    print(f"onnxruntime {ort.__version__}, onnxruntime-genai {og.__version__}, {os.cpu_count()} CPUs (shared)")
    with tempfile.TemporaryDirectory(prefix="bench-genai-", dir=args.workdir) as tmp:
        r = bench(args.mib, Path(tmp), not args.fp32, args.reps, args.folder)
        shutil.rmtree(tmp, ignore_errors=True)
    show(r)
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
