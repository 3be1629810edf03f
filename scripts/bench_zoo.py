#!/usr/bin/env python3
"""Benchmark: a model zoo (one network exported at several input lengths) into one shared blob.

Measures in one run:
  - total input bytes vs blob bytes (dedupe),
  - peak RSS of `weightshare convert --shared-blob` with 1, 2, 4, 8 models (each in a fresh process),
  - PSS of one process holding one ONNX Runtime session of each of 4 models, before vs after conversion
    (session.disable_prepacking=1).

    python scripts/bench_zoo.py [--workdir /tmp/ws-zoo] [--layers 8] [--dim 2048]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from weightshare._runtimes.memory import run_child_peak
from weightshare._runtimes.ort import measure_models
from weightshare._samples import mlp_onnx

LENGTHS = [1, 16, 64, 128, 256, 512, 1024, 2048]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ws-zoo"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=2048)
    args = ap.parse_args()
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    src = work / "src"
    src.mkdir(parents=True)
    models = []
    for n in LENGTHS:
        print(f"exporting input length {n} ...", file=sys.stderr, flush=True)
        models.append(
            mlp_onnx(src / f"mlp_len{n}.onnx", layers=args.layers, dim=args.dim, weights="float16", seed=0, batch=n)
        )

    print(f"{'models':>6} {'input MiB':>10} {'blob MiB':>9} {'dedupe':>7} {'peak RSS MiB':>13} {'wall s':>7}")
    peaks = {}
    for k in (1, 2, 4, 8):
        out = work / f"out{k}"
        res, peak = run_child_peak(
            [
                sys.executable,
                "-m",
                "weightshare",
                "convert",
                *map(str, models[:k]),
                "-o",
                str(out),
                "--shared-blob",
                "zoo.safetensors",
                "--json",
                "-q",
            ]
        )
        if res.returncode != 0:
            raise SystemExit(res.stderr)
        import json

        rep = json.loads(res.stdout)["reports"][0]["zoo"]  # the --json document: the run's one blob, per record
        peaks[k] = peak
        input_mib = sum(m.stat().st_size for m in models[:k]) / (1 << 20)
        print(
            f"{k:>6} {input_mib:>10.1f} {rep['blob_bytes'] / (1 << 20):>9.1f} {rep['dedupe_ratio']:>6.2f}x "
            f"{peak:>13.1f} {rep['wall_time_s']:>7.2f}"
        )
    print(f"peak RSS 8 models / 1 model: {peaks[8] / peaks[1]:.3f}x")

    four = [str(m) for m in models[:4]]
    converted = [str(work / "out4" / m.name) for m in models[:4]]
    before = measure_models(four)
    after = measure_models(converted)
    print()
    print(f"{'ORT sessions (one per model)':>30} {'PSS before MiB':>15} {'PSS after MiB':>14}")
    for b, a in zip(before, after):
        print(f"{b['models']:>30} {b['pss_mib']:>15.1f} {a['pss_mib']:>14.1f}")
    print(
        f"4 models / 1 model PSS: before {before[-1]['pss_mib'] / before[0]['pss_mib']:.2f}x, "
        f"after {after[-1]['pss_mib'] / after[0]['pss_mib']:.2f}x"
    )


if __name__ == "__main__":
    main()
