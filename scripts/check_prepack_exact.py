"""convert --prepack against ONNX Runtime on the ORIGINAL, over many random layered models.

    python scripts/check_prepack_exact.py [--seeds 200] [--first 0] [--budget BYTES] [--forms] [--fp16]
                                          [--unpack ort-cpu]

Each model of ``tests/random_layered.py`` (one weight read by several nodes, tied MatMul / Gemm(transB=1) weights,
tensors derived from the inputs read by far-apart layers, decomposed Gelu and LayerNorm, identical nodes CSE
merges, a symbolic batch) is converted with ``--prepack`` under a segment budget small enough to cut it (two
weights per segment by default), and a default-option session of the result is compared with one of the original
at batch 1, 8, 32 and 64 with ``np.array_equal``. ``--forms`` also runs every corpus form of ``model_forms``.
``--fp16``: the generated models with fp16 weights, inputs and outputs (ORT's CPU provider runs most of their ops
in fp32 between Casts it inserts; two fp16 weights per segment by default).
Prints one line per model that differs (or whose conversion failed) and the counts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [sys.path[0], os.environ.get("PYTHONPATH")]))

import random_layered as rl  # noqa: E402


def _forms_differences(tmp: Path, name: str) -> tuple[list[str], bool]:
    import model_forms as mf
    import numpy as np
    import onnxruntime as ort

    import weightshare

    src = mf.build(name, tmp / "src" / "model.onnx", mib=1)
    report = weightshare.convert(src, tmp / "out", prepack=True)
    a = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    c = ort.InferenceSession(str(tmp / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    found = []
    for batch in rl.BATCHES:
        for branch in (True, False) if name == "merged_decoder" else (True,):
            feeds = mf.feeds(src, batch=batch, use_cache_branch=branch)
            for want, got in zip(a.run(None, feeds), c.run(None, feeds)):
                if want.dtype != got.dtype or not np.array_equal(want, got):
                    found.append(f"batch {batch} branch {branch}")
    return found, report.prepack.get("segments", {}).get("segments", 1) > 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--budget", help="WEIGHTSHARE_ORT_SEGMENT_BYTES for the conversions (default: two weights)")
    ap.add_argument("--forms", action="store_true", help="also every corpus form (model_forms), at the same budget")
    ap.add_argument("--fp16", action="store_true", help="the generated models in fp16")
    ap.add_argument("--unpack", choices=["ort-cpu"], help="convert with --prepack --unpack ort-cpu")
    args = ap.parse_args()
    os.environ["WEIGHTSHARE_ORT_SEGMENT_BYTES"] = args.budget or (
        rl.SEGMENT_BUDGET_FP16 if args.fp16 else rl.SEGMENT_BUDGET
    )
    import weightshare

    jobs: list[tuple[str, object]] = [(f"seed {s}", s) for s in range(args.first, args.first + args.seeds)]
    if args.forms:
        import model_forms as mf

        jobs += [(f"form {f}", f) for f in sorted(mf.FORMS)]
    differ = failed = segmented = 0
    start = time.monotonic()
    for label, what in jobs:
        tmp = Path(tempfile.mkdtemp(prefix="check_prepack_"))
        try:
            if isinstance(what, int):
                src = rl.save(rl.random_model(what, fp16=args.fp16), tmp / "src" / "model.onnx")
                report = weightshare.convert(
                    src, tmp / "out", prepack=True, **({"unpack": args.unpack} if args.unpack else {})
                )
                cut = report.prepack.get("segments", {}).get("segments", 1) > 1
                found = rl.differences(src, tmp / "out" / "model.onnx")
            else:
                found, cut = _forms_differences(tmp, str(what))
            segmented += cut
        except weightshare.WeightshareError as e:  # a refusal is allowed (exit 2, nothing written), not a wrong result
            failed += 1
            print(f"{label}: refused: {e}", flush=True)
            continue
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if found:
            differ += 1
            print(f"{label}: DIFFERS: {'; '.join(found)}", flush=True)
    print(
        f"{len(jobs)} models ({args.seeds} generated{' in fp16' if args.fp16 else ''}; {segmented} optimized in "
        "segments), batches "
        f"{'/'.join(map(str, rl.BATCHES))}: {differ} differ from ORT on the original, {failed} refused "
        f"({time.monotonic() - start:.0f} s)"
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
