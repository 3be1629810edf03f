"""The forms LLM teams ship, at ONNX Runtime's default settings: does `convert --prepack` share them?

    python scripts/bench_llm.py [--forms matmulnbits4,qdq,...] [--mib 100] [--workdir DIR] [--json]

Each form of ``tests/model_forms.py`` is built in code at ``--mib`` of weights, converted
plainly and with ``--prepack``, and measured in five variants side by side:
  original default | plain default | plain disable_prepacking | --prepack default | --prepack helper
(the last through ``weightshare.ort.session``). Per variant:
- PSS above a process that imported onnxruntime and holds no session, after 1 and 4 sessions in one
  process, and summed over 3 processes of one session each (children started with
  MALLOC_MMAP_THRESHOLD_=1048576, as the sharing criterion says);
- median latency, variants interleaved in one process: a decode step (batch 1, seq 1), a prefill
  (batch 1, seq 32) and batch 8 (seq 1); on a shared machine read them as ratios;
- whether outputs are bit-identical to the original at default options (both If branches for a merged decoder).
Per form: `convert --prepack` wall time, the converter's and its ORT child's peak RSS, the peak disk use
of OUTDIR while it ran (polled), and the final outputs' size.
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
import threading
import time
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders)
import model_forms as mf
import numpy as np

from weightshare._disk import allocated_bytes
from weightshare._runtimes.memory import memory_now, run_child_peak, smaps_rollup

FORMS = ("matmulnbits4", "matmulnbits8_sym_b64_acc4", "qdq", "dynamic", "attention", "merged_decoder")
VARIANTS = ("original default", "plain default", "plain disable_prepacking", "--prepack default", "--prepack helper")
SHAPES = ((1, 1), (1, 32), (8, 1))  # (batch, seq): decode step, prefill, batch 8
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


def _open(path: str, variant: str):
    import onnxruntime as ort

    import weightshare.ort as wort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if variant == "plain disable_prepacking":
        so.add_session_config_entry("session.disable_prepacking", "1")
    if variant == "--prepack helper":
        return wort.session(path, so)
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def probe_sessions(path: str, variant: str) -> list[float]:
    """Child: PSS above the no-session baseline after 1..4 sessions."""
    import onnxruntime as ort  # noqa: F401 - part of the baseline

    from weightshare.ort import malloc_trim

    base, rows, sessions = memory_now()["pss_mib"], [], []
    for _ in range(4):
        s = _open(path, variant)
        s.run(None, mf.feeds(path, batch=1, seq=1))
        malloc_trim()
        sessions.append(s)
        rows.append(round(memory_now()["pss_mib"] - base, 1))
    return rows


def probe_hold(path: str, variant: str) -> None:
    """Child: one session; print the baseline, hold until stdin closes."""
    import onnxruntime as ort  # noqa: F401

    from weightshare.ort import malloc_trim

    base = memory_now()["pss_mib"]
    s = _open(path, variant)
    s.run(None, mf.feeds(path, batch=1, seq=1))
    malloc_trim()
    print(json.dumps({"baseline": base}), flush=True)
    sys.stdin.read()


def _child(func: str, *args: str, **popen):
    cmd = [sys.executable, __file__, "--probe", func, *args]
    return subprocess.Popen(cmd, env={**os.environ, **MALLOC}, stdout=subprocess.PIPE, text=True, **popen)


def processes(path: str, variant: str, n: int = 3) -> float:
    procs = [_child("hold", path, variant, stdin=subprocess.PIPE) for _ in range(n)]
    try:
        bases = [json.loads(p.stdout.readline())["baseline"] for p in procs]
        total = sum(smaps_rollup(p.pid)["Pss"] / 2**20 for p in procs)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()
    return round(total - sum(bases), 1)


def latency(paths: dict[str, str], src: str, reps: int = 48) -> tuple[dict, dict]:
    """Median (and best) ms per variant and shape, interleaved; bit-identity with the original per shape and branch."""
    sessions = {v: _open(p, v) for v, p in paths.items()}
    times: dict[str, dict[str, float]] = {v: {} for v in paths}
    best: dict[str, dict[str, float]] = {v: {} for v in paths}
    same: dict[str, bool] = dict.fromkeys(paths, True)
    for batch, seq in SHAPES:
        key = f"b{batch}s{seq}"
        for branch in (True, False):
            feeds = mf.feeds(src, batch=batch, seq=seq, use_cache_branch=branch)
            ref = sessions["original default"].run(None, feeds)[0]
            for v, s in sessions.items():
                out = s.run(None, feeds)[0]
                same[v] = same[v] and out.dtype == ref.dtype and np.array_equal(out, ref)
        feeds = mf.feeds(src, batch=batch, seq=seq)
        samples: dict[str, list[float]] = {v: [] for v in paths}
        for _ in range(max(8, reps // (batch * seq))):
            for v, s in sessions.items():
                t0 = time.perf_counter()
                s.run(None, feeds)
                samples[v].append((time.perf_counter() - t0) * 1000)
        for v in paths:
            times[v][key] = round(statistics.median(samples[v]), 3)
            best[v][f"{key} best"] = round(min(samples[v]), 3)
    return {v: {**times[v], **best[v]} for v in paths}, same


def _du(path: Path) -> int:
    return allocated_bytes(str(path))  # the converter's own meter (``--json`` temp_disk_peak_bytes)


def convert(src: Path, out: Path, *flags: str) -> dict:
    """`weightshare convert` in a child: its report, the process tree's peak RSS, OUTDIR's peak disk use."""
    out.mkdir(parents=True, exist_ok=True)
    peak_disk, done = [0], threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak_disk[0] = max(peak_disk[0], _du(out))
            time.sleep(0.05)

    t = threading.Thread(target=poll)
    t.start()
    try:
        res, peak = run_child_peak(
            [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q", "--json", *flags]
        )
    finally:
        done.set()
        t.join()
    if res.returncode != 0:
        raise SystemExit(res.stderr)
    report = json.loads(res.stdout)["reports"][0]  # the --json document: one report per model
    report["tree_peak_mib"] = peak
    report["disk_peak_mib"] = round(max(peak_disk[0], _du(out)) / 2**20, 1)
    report["final_mib"] = round(_du(out) / 2**20, 1)
    return report


def bench_form(
    name: str, mib: float, work: Path, variants: tuple[str, ...] = VARIANTS, reps: int = 48, unpack: str = ""
) -> dict:
    t0 = time.perf_counter()
    src = mf.build(name, work / "src" / "model.onnx", mib=mib)
    built = time.perf_counter() - t0
    weights = _du(src.parent) / 2**20
    flags = [a for u in filter(None, unpack.split(",")) for a in ("--unpack", u)]
    plain = convert(src, work / "plain", *flags)
    pre = convert(src, work / "prepack", "--prepack", *flags)
    paths = {
        "original default": str(src),
        "plain default": plain["outputs"][0],
        "plain disable_prepacking": plain["outputs"][0],
        "--prepack default": pre["outputs"][0],
        "--prepack helper": pre["outputs"][0],
    }
    paths = {v: p for v, p in paths.items() if v in variants}
    r: dict = {"form": name, "unpack": unpack, "weights_mib": round(weights, 1), "build_s": round(built, 1)}
    r.update(pss={}, procs={})
    for v, p in paths.items():
        r["pss"][v] = json.loads(_child("sessions", p, v).communicate()[0].splitlines()[-1])
        r["procs"][v] = processes(p, v)
    r["latency_ms"], r["bit_identical"] = latency(paths, str(src), reps)
    info = pre.get("prepack", {})
    r["convert"] = {
        "wall_s": pre["wall_time_s"],
        "converter_peak_mib": info.get("converter_peak_rss_mib", pre["peak_rss_mib"]),
        "ort_child_peak_mib": info.get("ort_child_peak_rss_mib"),
        "tree_peak_mib": round(pre["tree_peak_mib"]),
        "disk_peak_mib": pre["disk_peak_mib"],
        "final_mib": pre["final_mib"],
        "ops": {op: f"{t['packed']}/{t['nodes']}" for op, t in info.get("ops", {}).items()},
        "segments": next((n.split(": ", 1)[1] for n in pre["notes"] if "optimized the graph" in n), "?"),
    }
    return r


def show(r: dict) -> None:
    variants = list(r["pss"])
    how = f" (--unpack {r['unpack']})" if r.get("unpack") else ""
    print(f"\n== {r['form']}{how}: {r['weights_mib']} MiB on disk (built in {r['build_s']} s) ==")
    w = 26
    print(f"{'':30}" + "".join(f"{v:>{w}}" for v in variants))
    rows = [
        ("PSS 1 session, MiB", lambda v: f"{r['pss'][v][0]}"),
        ("PSS 4 sessions, MiB", lambda v: f"{r['pss'][v][3]}"),
        ("PSS 4 sessions / 1", lambda v: f"{r['pss'][v][3] / r['pss'][v][0]:.2f}"),
        ("PSS 3 processes, MiB", lambda v: f"{r['procs'][v]}"),
        ("PSS 3 processes / 1", lambda v: f"{r['procs'][v] / r['pss'][v][0]:.2f}"),
    ]
    for key in r["latency_ms"]["original default"]:
        base = r["latency_ms"]["original default"][key]
        rows.append(
            (
                f"latency {key}, ms (x orig)",
                lambda v, k=key, b=base: f"{r['latency_ms'][v][k]:.2f} ({r['latency_ms'][v][k] / b:.2f}x)",
            )
        )
    rows.append(("bit-identical to original", lambda v: str(r["bit_identical"][v])))
    for label, cell in rows:
        print(f"{label:30}" + "".join(f"{cell(v):>{w}}" for v in variants))
    c = r["convert"]
    print(
        f"convert --prepack: {c['wall_s']} s; peak RSS converter {c['converter_peak_mib']} MiB, ORT child "
        f"{c['ort_child_peak_mib']} MiB (process tree max {c['tree_peak_mib']} MiB); OUTDIR disk peak "
        f"{c['disk_peak_mib']} MiB for {c['final_mib']} MiB of final outputs "
        f"({c['disk_peak_mib'] / c['final_mib']:.2f}x)"
    )
    print(f"  packed nodes per op: {c['ops']}; {c['segments']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forms", default=",".join(FORMS), help=f"of {', '.join(mf.FORMS)}")
    ap.add_argument("--mib", type=float, default=100.0, help="weights per model (the done-when rows say >= 100)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="a subset, for a focused latency A/B")
    ap.add_argument("--reps", type=int, default=48, help="timed runs per shape at batch*seq 1")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--unpack", default="", help="--unpack values for both conversions, e.g. ort-cpu (fp16 forms)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--probe", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        func, *rest = args.probe
        if func == "sessions":
            print(json.dumps(probe_sessions(*rest)))
        else:
            probe_hold(*rest)
        return
    import onnxruntime as ort

    print(f"onnxruntime {ort.__version__}, {os.cpu_count()} CPUs (shared with other work: latency is noisy)")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-llm-", dir=args.workdir) as tmp:
        for name in filter(None, args.forms.split(",")):
            work = Path(tmp) / name
            variants = tuple(v for v in args.variants.split(",") if v)
            results.append(bench_form(name, args.mib, work, ("original default", *variants), args.reps, args.unpack))
            shutil.rmtree(work)
            show(results[-1])
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
