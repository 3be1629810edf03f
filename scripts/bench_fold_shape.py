#!/usr/bin/env python3
"""Benchmark: a tied head's Transpose folded into the blob (``formats/onnx/fold_shape.py``).

onnxruntime-genai's float models with tied embeddings (Gemma2 fp32) read the embedding as
``Transpose(lm_head.MatMul.weight)``; ONNX Runtime constant-folds it into a heap tensor in every session, so the
portable model of a ``--prepack`` conversion (the loader's fallback, opened with ``session.disable_prepacking=1``)
paid the embedding's size per session. Builds that form (``tests/model_forms.tied_head``), converts it with
``--prepack`` twice, without the fold (before) and with it (after), and measures, side by side in one run:

  - PSS of 1 and 4 sessions of each portable model at ``session.disable_prepacking=1`` (a fresh child each);
  - the blob's size (what the fold adds: the transposed copy of the tied weight);
  - peak RSS of ``weightshare convert`` (plain) at two weight sizes: the slab-by-slab transpose keeps it flat.

    python scripts/bench_fold_shape.py [--vocab 16384] [--hidden 1024] [--workdir /tmp/ws-bench-fold-shape]

Run from the checkout root with PYTHONPATH=$PWD so that this weightshare is imported.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

MiB = 1 << 20
NO_FOLD = (
    "import sys, weightshare\n"
    "import weightshare.formats.onnx.convert as c\n"
    "from weightshare.formats.onnx.fold_shape import ShapeFolds\n"
    "c.fold_shape_ops = lambda *a, **k: ShapeFolds()  # the conversion as it was before the fold\n"
    "weightshare.convert(sys.argv[1], sys.argv[2], prepack=True)\n"
)
FOLD = "import sys, weightshare\nweightshare.convert(sys.argv[1], sys.argv[2], prepack=True)\n"


def convert(code: str, src: Path, out: Path) -> None:
    res = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"convert failed: {res.stderr.strip().splitlines()[-1:]}")


def pss(model: Path) -> tuple[float, float]:
    """(PSS MiB with 1 session, with 4), sessions at session.disable_prepacking=1, arena off, in a fresh child."""
    from weightshare._runtimes.ort import measure_sessions

    rows = measure_sessions(str(model), [1, 4], share=True, env={"MALLOC_MMAP_THRESHOLD_": "1048576"}, arena=False)
    return float(rows[0]["pss_mib"]), float(rows[-1]["pss_mib"])


def convert_peak(src: Path, out: Path) -> float:
    from weightshare._runtimes.memory import run_child_peak

    res, peak = run_child_peak([sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q"])
    if res.returncode:
        raise SystemExit(res.stderr)
    return peak


def main() -> None:
    import model_forms as mf

    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--workdir", default="/tmp/ws-bench-fold-shape")
    args = ap.parse_args()
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    src = mf.tied_head(work / "src" / "model.onnx", vocab=args.vocab, hidden=args.hidden)
    weight = args.vocab * args.hidden * 4 / MiB
    print(f"tied head: lm_head.MatMul.weight [{args.hidden}, {args.vocab}] fp32, {weight:.1f} MiB")
    rows = []
    for label, code in (("before (no fold)", NO_FOLD), ("after (folded)", FOLD)):
        out = work / label.split()[0]
        convert(code, src, out)
        portable = out / "model.portable.onnx"
        blob = sum(p.stat().st_size for p in out.glob("*.safetensors")) / MiB
        one, four = pss(portable)
        rows.append((label, blob, one, four))
    head = f"{'blob MiB':>9} {'PSS 1':>8} {'PSS 4':>8} {'4/1':>6} {'+/session':>10}"
    print(f"\n{'portable model, disable_prepacking':<36} {head}")
    for label, blob, one, four in rows:
        print(f"{label:<36} {blob:>9.1f} {one:>8.1f} {four:>8.1f} {four / one:>6.2f} {(four - one) / 3:>10.1f}")
    print("\nconvert (plain) peak RSS as the tied weight grows (the transpose is streamed slab by slab):")
    for scale in (1, 4):
        big = mf.tied_head(work / f"x{scale}" / "model.onnx", vocab=args.vocab * scale, hidden=args.hidden)
        peak = convert_peak(big, work / f"x{scale}" / "out")
        print(f"  weight {weight * scale:>7.1f} MiB: peak RSS {peak:.1f} MiB")
        shutil.rmtree(big.parent)


if __name__ == "__main__":
    main()
