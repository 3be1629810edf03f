"""Readers during re-conversion, at a larger scale than the test: sessions loaded while OUT is re-converted.

Usage: python scripts/bench_reader_race.py [--swaps 1000] [--prepack-swaps 40] [--modes plain,zoo,prepack]
Prints, per mode, the sessions that computed v1, v2, a mix (neither) and the failed loads.
prepack: ``convert --prepack`` re-conversions (each runs ORT's optimizer in a child: ~1-2 s), the reader opening
``weightshare.ort.session`` (the helper checks the blob, then ORT loads: the check-then-load gap).
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
from weightshare.options import ConvertOptions  # noqa: E402

# the test's reader, opening sessions through weightshare.ort.session (batch 1: the packed and the portable
# path compute the same bytes, so a fallback is not counted as a mix)
HELPER_READER = rr.READER.replace(
    "import numpy as np, onnxruntime as ort", "import numpy as np, weightshare.ort as wort"
)
HELPER_READER = HELPER_READER.replace(
    'ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])', "wort.session(model)"
).replace("so = ort.SessionOptions()\nso.log_severity_level = 4\n", "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--swaps", type=int, default=1000)
    ap.add_argument("--prepack-swaps", type=int, default=40)
    ap.add_argument("--modes", default="plain,zoo,prepack")
    args = ap.parse_args()
    for mode in args.modes.split(","):
        rr.SWAPS = args.prepack_swaps if mode == "prepack" else args.swaps
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            t = time.perf_counter()
            if mode == "prepack":
                v1, v2 = rr.mlp(d / "v1" / "a.onnx", 1), rr.mlp(d / "v2" / "a.onnx", 2)
                prepack = ConvertOptions(prepack=True)
                result = rr.race(
                    d,
                    lambda out: weightshare.convert(v1, out, prepack),  # noqa: B023
                    lambda out: weightshare.convert(v2, out, prepack),  # noqa: B023
                    v1,
                    v2,
                    HELPER_READER,
                )
            elif mode == "plain":
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
                f"{mode}: {rr.SWAPS} swaps, {time.perf_counter() - t:.1f} s, sessions {result['counts']}, "
                f"first errors {result['errors']}"
            )


if __name__ == "__main__":
    main()
