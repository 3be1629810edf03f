"""Readers during re-conversion, at a larger scale than the test: sessions loaded while OUT is re-converted.

Usage: python scripts/bench_reader_race.py [--swaps 1000]
Prints, per mode (plain, zoo), the sessions that computed v1, v2, a mix (neither) and the failed loads.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_reader_race as rr  # noqa: E402  (the test's fixtures and reader loop, reused)

import weightshare  # noqa: E402
from weightshare.api import convert_zoo  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--swaps", type=int, default=1000)
    args = ap.parse_args()
    rr.SWAPS = args.swaps
    for mode in ("plain", "zoo"):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            t = time.perf_counter()
            if mode == "plain":
                v1, v2 = rr.mlp(d / "v1" / "a.onnx", 1), rr.mlp(d / "v2" / "a.onnx", 2)
                # The lambdas run inside race(), in this iteration: B023's late binding cannot bite.
                result = rr.race(
                    d,
                    lambda out: weightshare.convert(v1, out),  # noqa: B023
                    lambda out: weightshare.convert(v2, out),  # noqa: B023
                    v1,
                    v2,
                )  # noqa: B023
            else:
                z1 = [rr.mlp(d / "v1" / "a.onnx", 1), rr.mlp(d / "v1" / "b.onnx", 3)]
                z2 = [rr.mlp(d / "v2" / "a.onnx", 2), rr.mlp(d / "v2" / "b.onnx", 3)]
                result = rr.race(
                    d,
                    lambda out: convert_zoo(z1, out, "zoo.safetensors"),  # noqa: B023
                    lambda out: convert_zoo(z2, out, "zoo.safetensors"),  # noqa: B023
                    z1[0],
                    z2[0],
                )  # noqa: B023
            print(
                f"{mode}: {args.swaps} swaps, {time.perf_counter() - t:.1f} s, sessions {result['counts']}, "
                f"first errors {result['errors']}"
            )


if __name__ == "__main__":
    main()
