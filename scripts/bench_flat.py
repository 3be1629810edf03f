"""Does plain `convert --prepack` stay flat on fp16 decoders and ViTs as they grow? Before and after, side by side.

    python scripts/bench_flat.py [--sizes 64,256,1024] [--models decoder,vit] [--before /work/wt/base-flat]
                                 [--workdir DIR]

Each model (``model_forms.causal_llama_fp16``: a decoder whose every layer reads a causal mask and rotary tables
computed from the inputs; ``model_forms.vit_fp16``: an ORT-optimizer fp16 ViT whose every layer reads a mask built
from the pixels' shape) is built once per size and converted with `--prepack` (default segment budget) by the
checkout given as ``--before`` and by this one, each in its own process tree. Printed per run: the report's
``peak_rss_mib`` (the process tree's sampled RSS: the converter and its ORT children), CPU seconds of the tree
(user + sys of every waited child), how many segments ORT optimized the graph in and the largest one's weights
(what one ORT session is handed). At the smallest size both outputs are compared with the original at batch 1
and 4 (np.array_equal). CPU seconds, not wall: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders)
import model_forms as mf

HERE = Path(__file__).resolve().parents[1]
BUILDERS = {"decoder": mf.causal_llama_fp16, "vit": mf.vit_fp16}


def _convert(tree: Path, src: Path, out: Path) -> dict:
    """`convert --prepack` of ``src`` by the checkout ``tree``: its report, and the tree's CPU seconds."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(HERE / "tests")])}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "--prepack", "--json", "-q"]
    # from the checkout's own directory: `python -m` puts the working directory first on the path
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1:] or [f"exit {res.returncode}"], "cpu_s": cpu}
    (report,) = json.loads(res.stdout)["reports"]
    seg = report.get("prepack", {}).get("segments", {})
    return {
        "peak": report["peak_rss_mib"],
        "cpu_s": cpu,
        "segments": seg.get("segments", 1),
        "largest": seg.get("largest_segment_bytes", 0) / 2**20,
        "reason": seg.get("single_reason", ""),
        "output": out / src.name,
    }


def _exact(src: Path, out: Path) -> str:
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3  # the --prepack output's overridable initializers draw a warning per session
    a = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    for batch in (1, 4):
        feeds = mf.feeds(src, batch=batch, seq=16)
        if not all(np.array_equal(x, y) for x, y in zip(a.run(None, feeds), b.run(None, feeds), strict=True)):
            return "differs"
    return "exact"


def _cell(r: dict) -> str:
    if "error" in r:
        return f"failed: {r['error'][0][:60]}"
    return f"{r['peak']:7.0f} MiB {r['cpu_s']:6.1f} s  {r['segments']:3d} seg, largest {r['largest']:6.1f} MiB"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="64,256,1024", help="MiB of fp16 weights")
    p.add_argument("--models", default="decoder,vit")
    p.add_argument("--before", default="/work/wt/base-flat", help="a checkout of the code before (d9d5adc)")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    before = Path(args.before)
    rev = subprocess.run(["git", "-C", str(before), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(f"convert --prepack (default segment budget): before = {before} ({rev.stdout.strip()}), after = this tree")
    print("per run: process-tree peak RSS, CPU s of the tree, segments ORT optimized, the largest one's weights\n")
    print(f"{'model':8} {'MiB':>5}  {'before':54}  {'after':54}  outputs")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_flat_", dir="/work"))
    try:
        for name in args.models.split(","):
            for mib in sizes:
                src = BUILDERS[name](work / f"{name}{mib}" / "model.onnx", mib=mib)
                runs = {
                    label: _convert(tree, src, work / f"{name}{mib}_{label}")
                    for label, tree in (("before", before), ("after", HERE))
                }
                exact = "-"
                if mib == min(sizes):
                    exact = "/".join(
                        _exact(src, r["output"]) if "error" not in r else "-" for r in runs.values()
                    )  # fmt: skip
                print(f"{name:8} {mib:5d}  {_cell(runs['before']):54}  {_cell(runs['after']):54}  {exact}", flush=True)
                for label in runs:
                    shutil.rmtree(work / f"{name}{mib}_{label}", ignore_errors=True)
                shutil.rmtree(work / f"{name}{mib}", ignore_errors=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
