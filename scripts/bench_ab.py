"""A/B latency of the original and its `--prepack` conversion: is a ratio noise or real?

    python scripts/bench_ab.py [--form qdq] [--mib 100] [--batch 8] [--seq 1] [--reps 200] [--rounds 3]

Builds a ``model_forms`` form, converts it with ``--prepack``, opens both at default options (and a second
original session, an A/A control that runs the same graph), then runs them interleaved, in a new random order
each repetition, and records per run the wall time and the CPU time of the process (user + system, all of ORT's
threads). Prints per round the medians and the ratios to the original. With ``--threads 1`` the sessions use one
intra-op thread (no spinning worker burning CPU between runs), which makes CPU time the kernel's own.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders)
import model_forms as mf
import numpy as np


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--form", default="qdq")
    ap.add_argument("--mib", type=float, default=100.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT's default)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="bench-ab-", dir=args.workdir) as tmp:
        src = mf.build(args.form, Path(tmp) / "src" / "model.onnx", mib=args.mib)
        cmd = [sys.executable, "-m", "weightshare", "convert", str(src), "-o", f"{tmp}/out", "-q", "--json"]
        res = subprocess.run([*cmd, "--prepack"], capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(res.stderr)
        out = json.loads(res.stdout)["reports"][0]["outputs"][0]  # the --json document: one report per model
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if args.threads:
            so.intra_op_num_threads = args.threads
        sessions = {
            "original": ort.InferenceSession(str(src), so),
            "original again (A/A)": ort.InferenceSession(str(src), so),
            "--prepack": ort.InferenceSession(out, so),
        }
        feeds = mf.feeds(src, batch=args.batch, seq=args.seq)
        ref = sessions["original"].run(None, feeds)[0]
        same = {k: bool(np.array_equal(s.run(None, feeds)[0], ref)) for k, s in sessions.items()}
        print(
            f"onnxruntime {ort.__version__}; {args.form} {args.mib:g} MiB, batch {args.batch} seq {args.seq}, "
            f"{args.reps} interleaved runs a round, threads {args.threads or 'default'}; bit-identical: {same}"
        )
        rng = random.Random(0)
        for r in range(args.rounds):
            wall: dict[str, list[float]] = {k: [] for k in sessions}
            cpu: dict[str, list[float]] = {k: [] for k in sessions}
            for _ in range(args.reps):
                order = list(sessions)
                rng.shuffle(order)
                for k in order:
                    t0, c0 = time.perf_counter(), _cpu()
                    sessions[k].run(None, feeds)
                    wall[k].append((time.perf_counter() - t0) * 1000)
                    cpu[k].append((_cpu() - c0) * 1000)
            base_w, base_c = statistics.median(wall["original"]), statistics.median(cpu["original"])
            cells = []
            for k in sessions:
                w, c = statistics.median(wall[k]), statistics.median(cpu[k])
                cells.append(f"{k}: wall {w:.2f} ms ({w / base_w:.2f}x), CPU {c:.2f} ms ({c / base_c:.2f}x)")
            print(f"round {r + 1}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
