"""ONNX Runtime at default settings: does `convert --prepack` share every weight, at full speed?

    python scripts/bench_prepack.py [--models matmul,conv,mixed] [--convert-gib 1,4]
                                    [--convert-conv-gib 0.25,1,2,4] [--convert-resnet-gib 0.5,1] [--whole-graph]
                                    [--workdir DIR]

For each model, four variants side by side:
  original default | converted default | converted + disable_prepacking | --prepack default
- PSS above a process that imported onnxruntime and holds no session, after 1/2/4/8 sessions in one
  process (started with MALLOC_MMAP_THRESHOLD_=1048576), and summed over 4 processes of one session;
- median and best latency at batch 1/4/16/64, the variants interleaved in one process (on a shared
  machine read them as ratios; the best-of figures are the least disturbed by other load);
- whether outputs are bit-identical to the original at default settings.
--cost-gib 1 / --cost-form llama:1536 (form:MiB[:unpack]): what --prepack costs on a MatMul+Conv model of that
size (or a model_forms form of that many MiB) next to its anchors (the plain conversion; ORT's own save-prepacked
session on the same model): CPU s and wall s, converter and ORT child peak RSS, OUTDIR's temporary disk peak (the
report's, and `du` polled every 20 ms), final outputs, ratios; and the load peak (max RSS of a process that opens the
original or the --prepack output at default options and runs it once).
--convert-gib: peak RSS of `convert --prepack` (the converter and its ORT child) on MatMul models of that size;
--convert-conv-gib / --convert-resnet-gib: the same on Conv-chain / ResNet-like models (--whole-graph: also with ORT
optimizing the graph in one piece, as --prepack did before it cut the graph into segments).
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
import threading
import time
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders)
import numpy as np
from prepack_samples import cnn_onnx, mixed_onnx, sample_input

from weightshare._disk import allocated_bytes
from weightshare._runtimes.memory import memory_now, run_child_peak, smaps_rollup
from weightshare.formats.onnx.ort.segments import BUDGET_ENV

MODELS = {  # weights: matmul 272 MiB, conv 72 MiB, mixed 276 MiB
    "matmul": dict(conv_layers=0, channels=2048, mm_layers=16, dim=2048),
    "conv": dict(conv_layers=8, channels=512, mm_layers=0, spatial=4),
    "mixed": dict(conv_layers=8, channels=512, mm_layers=12, dim=2048, spatial=4),
    "tiny": dict(conv_layers=2, channels=64, mm_layers=2, dim=256),  # a smoke test of this script
}
VARIANTS = ("original default", "converted default", "converted disable_prepacking", "--prepack default")
BATCHES = (1, 4, 16, 64)
COUNTS = (1, 2, 4, 8)
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


def _options(variant: str):
    import onnxruntime as ort

    so = ort.SessionOptions()
    if variant == "converted disable_prepacking":
        so.add_session_config_entry("session.disable_prepacking", "1")
    so.log_severity_level = 3
    return so


def probe_sessions(path: str, variant: str, src: str) -> list[float]:
    """Child: PSS above the no-session baseline after each count of sessions."""
    import onnxruntime as ort  # noqa: F401 - part of the baseline

    from weightshare.ort import malloc_trim

    base, rows, sessions = memory_now()["pss_mib"], [], []
    for n in range(1, max(COUNTS) + 1):
        s = ort.InferenceSession(path, _options(variant), providers=["CPUExecutionProvider"])
        s.run(None, sample_input(src, 1))
        malloc_trim()
        sessions.append(s)
        if n in COUNTS:
            rows.append(round(memory_now()["pss_mib"] - base, 1))
    return rows


def probe_hold(path: str, variant: str, src: str) -> None:
    """Child: one session, report the baseline, hold until stdin closes."""
    import onnxruntime as ort

    from weightshare.ort import malloc_trim

    base = memory_now()["pss_mib"]
    s = ort.InferenceSession(path, _options(variant), providers=["CPUExecutionProvider"])
    s.run(None, sample_input(src, 1))
    malloc_trim()
    print(json.dumps({"baseline": base}), flush=True)
    sys.stdin.read()


def _child(func: str, *args: str, **popen):
    cmd = [sys.executable, __file__, "--probe", func, *args]
    return subprocess.Popen(cmd, env={**os.environ, **MALLOC}, stdout=subprocess.PIPE, text=True, **popen)


def four_processes(path: str, variant: str, src: str) -> float:
    procs = [_child("hold", path, variant, src, stdin=subprocess.PIPE) for _ in range(4)]
    try:
        bases = [json.loads(p.stdout.readline())["baseline"] for p in procs]
        total = sum(smaps_rollup(p.pid)["Pss"] / 2**20 for p in procs)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()
    return round(total - sum(bases), 1)


def latency(paths: dict[str, str], src: str) -> tuple[dict, dict]:
    """Median ms per variant and batch, interleaved; and bit-identity with the original per batch."""
    import onnxruntime as ort

    sessions = {v: ort.InferenceSession(p, _options(v), providers=["CPUExecutionProvider"]) for v, p in paths.items()}
    times: dict[str, dict[int, float]] = {v: {} for v in paths}
    best: dict[str, dict[int, float]] = {v: {} for v in paths}
    same: dict[str, dict[int, bool]] = {v: {} for v in paths}
    for batch in BATCHES:
        feeds = sample_input(src, batch)
        ref = sessions["original default"].run(None, feeds)[0]
        samples: dict[str, list[float]] = {v: [] for v in paths}
        for v, s in sessions.items():  # warm-up, and the outputs
            out = s.run(None, feeds)[0]
            same[v][batch] = out.dtype == ref.dtype and out.shape == ref.shape and out.tobytes() == ref.tobytes()
        reps = max(5, 48 // batch)
        for _ in range(reps):
            for v, s in sessions.items():
                t0 = time.perf_counter()
                s.run(None, feeds)
                samples[v].append((time.perf_counter() - t0) * 1000)
        for v in paths:
            times[v][batch] = round(statistics.median(samples[v]), 2)
            best[v][batch] = round(min(samples[v]), 2)
    return {"median": times, "best": best}, same


def _convert(src: Path, out: Path, *flags: str, env: dict | None = None) -> dict:
    res, peak = run_child_peak(
        [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q", "--json", *flags],
        env={**os.environ, **(env or {})},
    )
    if res.returncode != 0:
        raise SystemExit(res.stderr)
    report = _report(res.stdout)
    report["process_peak_mib"] = peak
    return report


def bench_model(name: str, work: Path) -> dict:
    src = mixed_onnx(work / f"{name}.onnx", **MODELS[name])
    weights = (work / f"{name}.data").stat().st_size / 2**20
    plain = _convert(src, work / "plain")
    pre = _convert(src, work / "prepack", "--prepack")
    paths = {
        "original default": str(src),
        "converted default": plain["outputs"][0],
        "converted disable_prepacking": plain["outputs"][0],
        "--prepack default": pre["outputs"][0],
    }
    result = {"model": name, "weights_mib": round(weights, 1), "pss": {}, "four_processes": {}}
    for v, p in paths.items():
        child = _child("sessions", p, v, str(src))
        result["pss"][v] = json.loads(child.communicate()[0].splitlines()[-1])
        result["four_processes"][v] = four_processes(p, v, str(src))
    result["latency_ms"], result["bit_identical"] = latency(paths, str(src))
    result["prepack_convert"] = {
        "wall_s": pre["wall_time_s"],
        "peak_mib": round(pre["process_peak_mib"]),
        "notes": pre["notes"],
    }
    return result


def convert_memory(gib: float, work: Path, kind: str = "mm", whole: bool = False) -> dict:
    """Peak RSS of `convert --prepack` on a MatMul (``mm``), Conv chain (``conv``, 512x512x3x3 layers) or
    ResNet-like (``resnet``, ``cnn_onnx``: BatchNorm/Clip residual blocks and branches, 1024 channels) model.

    ``whole``: ORT optimizes the whole graph in one session (what --prepack did before it cut the graph
    into segments), through the segment budget's environment variable.
    """
    name = f"{kind}{gib}g"
    if kind == "mm":
        src = mixed_onnx(work / f"{name}.onnx", conv_layers=0, channels=4096, mm_layers=round(16 * gib) - 1, dim=4096)
    elif kind == "conv":
        src = mixed_onnx(
            work / f"{name}.onnx",
            conv_layers=round(gib * 2**30 / (512 * 512 * 9 * 4)),
            channels=512,
            mm_layers=0,
            spatial=4,
        )
    else:  # ResNet-like: 36 MiB 3x3 Convs, residual blocks of 72 MiB that no cut can split
        src = cnn_onnx(
            work / f"{name}.onnx", channels=1024, blocks=round(gib * 2**30 / (1024 * 1024 * 9 * 4 * 1.6)), spatial=8
        )
    size = (work / f"{name}.data").stat().st_size / 2**30
    env = {BUDGET_ENV: str(1 << 50)} if whole else {}
    report = _convert(src, work / f"{name}-out", "--prepack", env=env)
    child = next((n.rsplit("ORT child peak RSS ", 1)[1] for n in report["notes"] if "ORT child" in n), "?")
    segments = next((n.split(": ", 1)[1] for n in report["notes"] if "optimized the graph" in n), "?")
    shutil.rmtree(work / f"{name}-out")
    for f in (src, work / f"{name}.data"):
        f.unlink()
    return {
        "kind": kind,
        "whole_graph": whole,
        "weights_gib": round(size, 2),
        "converter_peak_mib": round(report["peak_rss_mib"]),
        "process_peak_mib": round(report["process_peak_mib"]),
        "ort_child_peak": child,
        "wall_s": report["wall_time_s"],
        "segments": segments,
    }


ORT_SAVE_PREPACKED = """
import sys, onnxruntime as ort
so = ort.SessionOptions()
so.optimized_model_filepath = sys.argv[2]
so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "ort.bin")
so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
so.log_severity_level = 3
ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
"""

# Session creation + first run at ORT's default options; the child's max RSS is the load peak.
LOAD_PEAK = """
import sys, onnxruntime as ort
from model_forms import feeds
so = ort.SessionOptions()
so.log_severity_level = 3
s = ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
s.run(None, feeds(sys.argv[2]))
"""


def load_peak(model: Path, src: Path) -> float:
    """Peak RSS (MiB) of a fresh process that opens ``model`` at default options and runs it once."""
    return round(_timed([sys.executable, "-c", LOAD_PEAK, str(model), str(src)])["peak_mib"], 1)


def _report(stdout: str) -> dict:
    """The one model's report of ``convert --json`` (the document lists one report per model)."""
    return json.loads(stdout)["reports"][0]


def _du(path: Path) -> int:
    return allocated_bytes(str(path))  # the converter's own meter (``--json`` temp_disk_peak_bytes)


def _timed(cmd: list[str], out: Path | None = None) -> dict:
    """``cmd`` in a child: wall s, CPU s (user + system of its whole tree), peak RSS, ``out``'s peak disk use."""
    peak_disk, done = [0], threading.Event()

    def poll() -> None:
        while not done.wait(0.02):
            peak_disk[0] = max(peak_disk[0], _du(out)) if out is not None else 0

    t = threading.Thread(target=poll)
    t.start()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        res, peak = run_child_peak(cmd)
    finally:
        done.set()
        t.join()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(res.stderr)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "peak_mib": peak, "stdout": res.stdout, "du_peak": peak_disk[0]}


def cost(src: Path, work: Path, label: str, unpack: tuple[str, ...] = ()) -> dict:
    """One row: --prepack's cost next to the plain conversion's and ORT's own save-prepacked session's
    (``unpack``: --unpack values for both conversions)."""
    weights = sum(f.stat().st_size for f in src.parent.iterdir() if f.is_file())
    conv = [sys.executable, "-m", "weightshare", "convert", str(src), "-q", "--json"]
    conv += [a for u in unpack for a in ("--unpack", u)]
    plain = _timed([*conv, "-o", str(work / "plain")])
    shutil.rmtree(work / "plain")
    (work / "ort").mkdir()
    anchor = _timed([sys.executable, "-c", ORT_SAVE_PREPACKED, str(src), str(work / "ort" / "ort.onnx")])
    shutil.rmtree(work / "ort")
    (work / "pre").mkdir()
    pre = _timed([*conv, "-o", str(work / "pre"), "--prepack"], work / "pre")
    report = _report(pre["stdout"])
    final = _du(work / "pre")
    load = {"original": load_peak(src, src), "prepack": load_peak(work / "pre" / src.name, src)}
    shutil.rmtree(work / "pre")
    info = report.get("prepack", {})
    seg = info.get("segments", {})
    return {
        "model": label,
        "weights_mib": round(weights / 2**20),
        "plain": {"cpu_s": round(plain["cpu_s"], 2), "wall_s": round(plain["wall_s"], 2)},
        "ort_save_prepacked": {
            "cpu_s": round(anchor["cpu_s"], 2),
            "wall_s": round(anchor["wall_s"], 2),
            "peak_mib": round(anchor["peak_mib"]),
        },
        "prepack": {
            "cpu_s": round(pre["cpu_s"], 2),
            "wall_s": round(pre["wall_s"], 2),
            "converter_peak_mib": report["peak_rss_mib"],
            "ort_child_peak_mib": info.get("ort_child_peak_rss_mib"),
            "temp_disk_peak_mib": round(info.get("temp_disk_peak_bytes", 0) / 2**20),
            "du_temp_disk_peak_mib": round(pre["du_peak"] / 2**20),
            "final_mib": round(final / 2**20),
            "segments": seg.get("segments", 1),
            "largest_segment_mib": round(seg.get("largest_segment_bytes", 0) / 2**20, 1),
            "single_reason": seg.get("single_reason", ""),
        },
        "load_peak_mib": load,
    }


def show_cost(r: dict) -> None:
    p, a, b = r["prepack"], r["ort_save_prepacked"], r["plain"]
    print(
        f"\n== --prepack cost, {r['model']} ({r['weights_mib']} MiB) ==\n"
        f"{'':26}{'CPU s':>8}{'wall s':>8}{'peak MiB':>10}\n"
        f"{'plain conversion':26}{b['cpu_s']:>8}{b['wall_s']:>8}\n"
        f"{'ORT save-prepacked':26}{a['cpu_s']:>8}{a['wall_s']:>8}{a['peak_mib']:>10}\n"
        f"{'--prepack':26}{p['cpu_s']:>8}{p['wall_s']:>8}{p['converter_peak_mib']:>10} (ORT child "
        f"{p['ort_child_peak_mib']})\n"
        f"CPU --prepack / (ORT save-prepacked + plain) = {p['cpu_s'] / (a['cpu_s'] + b['cpu_s']):.2f}x; "
        f"CPU / plain = {p['cpu_s'] / b['cpu_s']:.1f}x\n"
        f"temp disk peak {p['temp_disk_peak_mib']} MiB (du every 20 ms: {p['du_temp_disk_peak_mib']} MiB), final "
        f"outputs {p['final_mib']} MiB: {p['du_temp_disk_peak_mib'] / max(p['final_mib'], 1):.2f}x; "
        f"{p['segments']} segment(s), largest {p['largest_segment_mib']} MiB {p['single_reason']}\n"
        f"load peak (session + first run, defaults, max RSS): original {r['load_peak_mib']['original']} MiB, "
        f"--prepack {r['load_peak_mib']['prepack']} MiB: "
        f"{r['load_peak_mib']['prepack'] / r['load_peak_mib']['original']:.2f}x",
        flush=True,
    )


def show(r: dict) -> None:
    print(f"\n== {r['model']} model: {r['weights_mib']} MiB of weights ==")
    w = 30
    print(f"{'':34}" + "".join(f"{v:>{w}}" for v in VARIANTS))
    for i, n in enumerate(COUNTS):
        print(f"{f'PSS {n} session(s), MiB':34}" + "".join(f"{r['pss'][v][i]:>{w}}" for v in VARIANTS))
    print(f"{'PSS 8 / 1':34}" + "".join(f"{r['pss'][v][3] / r['pss'][v][0]:>{w}.2f}" for v in VARIANTS))
    print(f"{'PSS 4 processes, MiB':34}" + "".join(f"{r['four_processes'][v]:>{w}}" for v in VARIANTS))
    print(
        f"{'PSS 4 processes / 1':34}" + "".join(f"{r['four_processes'][v] / r['pss'][v][0]:>{w}.2f}" for v in VARIANTS)
    )
    for stat in ("median", "best"):
        lat = r["latency_ms"][stat]
        for b in BATCHES:
            base = lat["original default"][b]
            print(
                f"{f'{stat} latency b={b}, ms (x orig)':34}"
                + "".join(f"{lat[v][b]:>{w - 8}} ({lat[v][b] / base:.2f}x)" for v in VARIANTS)
            )
    print(
        f"{'bit-identical to original, b=1..64':34}"
        + "".join(f"{str(all(r['bit_identical'][v].values())):>{w}}" for v in VARIANTS)
    )
    print(
        f"convert --prepack: {r['prepack_convert']['wall_s']} s, peak RSS {r['prepack_convert']['peak_mib']} MiB; "
        f"{r['prepack_convert']['notes'][-1]}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="matmul,conv,mixed")
    ap.add_argument("--convert-gib", default="", help="e.g. 1,4: conversion peak RSS on MatMul models of that size")
    ap.add_argument("--convert-conv-gib", default="", help="e.g. 0.25,1,2,4: the same on Conv models")
    ap.add_argument("--convert-resnet-gib", default="", help="e.g. 0.5,1: the same on ResNet-like models")
    ap.add_argument(
        "--whole-graph",
        action="store_true",
        help="with --convert-conv/resnet-gib: also without segments (ORT optimizing the whole graph at once)",
    )
    ap.add_argument("--cost-gib", default="", help="e.g. 1,4: --prepack's cost on MatMul+Conv models of that size")
    ap.add_argument(
        "--cost-form",
        default="",
        help="e.g. llama:1536,qdq:1600,llama_fp16:1600:ort-cpu: model_forms form:MiB[:--unpack value]",
    )
    ap.add_argument("--workdir", default=None)
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
    with tempfile.TemporaryDirectory(prefix="bench-prepack-", dir=args.workdir) as tmp:
        for name in filter(None, args.models.split(",")):
            work = Path(tmp) / name
            work.mkdir()
            results.append(bench_model(name, work))
            shutil.rmtree(work)
            show(results[-1])
        for gib in filter(None, args.cost_gib.split(",")):
            work = Path(tmp) / f"cost{gib}"
            work.mkdir()
            g = float(gib)  # 3/4 MatMul (64 MiB layers), 1/4 Conv (9 MiB 512x512x3x3 layers)
            src = mixed_onnx(
                work / "src" / "model.onnx" if (work / "src").mkdir() is None else "",
                conv_layers=round(g * 2**30 / 4 / (512 * 512 * 9 * 4)),
                channels=512,
                mm_layers=round(g * 2**30 * 3 / 4 / (4096 * 4096 * 4)),
                dim=4096,
                spatial=4,
            )
            results.append({"cost": cost(src, work, f"{gib} GiB MatMul+Conv")})
            shutil.rmtree(work)
            show_cost(results[-1]["cost"])
        for spec in filter(None, args.cost_form.split(",")):
            import model_forms

            form, mib, *unpack = spec.split(":")
            work = Path(tmp) / f"cost-{form}"
            (work / "src").mkdir(parents=True)
            src = model_forms.build(form, work / "src" / "model.onnx", mib=float(mib))
            how = "".join(f" --unpack {u}" for u in unpack)
            results.append({"cost": cost(src, work, f"{form} {mib} MiB{how}", tuple(unpack))})
            shutil.rmtree(work)
            show_cost(results[-1]["cost"])
        for kind, sizes in (
            ("mm", args.convert_gib),
            ("conv", args.convert_conv_gib),
            ("resnet", args.convert_resnet_gib),
        ):
            for gib in filter(None, sizes.split(",")):
                for whole in (False, True) if kind != "mm" and args.whole_graph else (False,):
                    row = convert_memory(float(gib), Path(tmp), kind, whole)
                    results.append({"convert_gib": row})
                    how = "whole graph in one ORT session" if whole else "ORT in segments"
                    print(
                        f"\nconvert --prepack, {row['weights_gib']} GiB {kind} model ({how}): converter peak RSS "
                        f"{row['converter_peak_mib']} MiB, ORT child peak RSS {row['ort_child_peak']}, "
                        f"{row['wall_s']} s; {row['segments']}",
                        flush=True,
                    )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
