"""weightshare.ort.session on plain conversions: PSS of 1..4 sessions, against ORT's default options, side by side.

Usage: python scripts/bench_ort_session.py [--workdir DIR]
For a MatMul/Gemm model (64 MiB of weights) and a Conv model (54 MiB), converted without --prepack, prints the
PSS (MiB above the interpreter's own) after each session and the ratio 4 sessions / 1 session, for
``onnxruntime.InferenceSession(path)`` (default options) and ``weightshare.ort.session(path)``, each in a fresh
process started with MALLOC_MMAP_THRESHOLD_=1048576.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from weightshare.api import convert
from weightshare.formats.onnx.prepack_samples import mixed_onnx

PROBE = """
import json, sys
import onnxruntime as ort
import weightshare.ort as wort
from weightshare.runtimes.memory import memory_now
from weightshare.formats.onnx.prepack_samples import sample_input
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = args.workdir or Path(tmp)
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


if __name__ == "__main__":
    main()
