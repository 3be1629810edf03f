#!/usr/bin/env python3
"""Regenerate every figure in docs/, each from its recipe below, measured on this machine.

    pip install -e ".[plot,runtimes]"
    python scripts/make_docs_figures.py [--only bench-demo.png] [--workdir /tmp/ws-figures]

Every PNG in docs/ must have a recipe in FIGURES: the script refuses to run when one has none, so that no figure
is left that nothing can make again. Each recipe prints the figures it plotted (JSON) and writes its caption into
the image: what was measured, with which versions, on how many CPUs.

bench-demo.png: `weightshare bench` on the demo model (12 fp16 2048x2048 MLP layers, 96 MiB, what `weightshare demo`
builds): PSS of one process after 1, 2, 4 and 8 ONNX Runtime sessions of the original and of the converted model,
with and without session.disable_prepacking, and of the `convert --prepack` output at default options.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def bench_demo(path: Path, workdir: Path) -> dict:
    from weightshare._bench import bench, plot
    from weightshare._samples import mlp_onnx

    model = mlp_onnx(workdir / "mlp_fp16.onnx", layers=12, dim=2048, weights="float16")
    result = bench(model, [1, 2, 4, 8], workdir=workdir, progress=lambda m: print(f"  {m}", file=sys.stderr))
    caption = (
        f"PSS (/proc/<pid>/smaps_rollup) of one process after N ONNX Runtime {metadata.version('onnxruntime')} CPU "
        f"sessions of a 12-layer fp16 MLP (2048x2048, 96 MiB): original, converted and converted --prepack; each "
        f"line in a fresh process. weightshare {metadata.version('weightshare')}, {os.cpu_count()} CPUs; "
        "scripts/make_docs_figures.py."
    )
    plot(result, path, caption)
    return result


FIGURES: dict[str, Callable[[Path, Path], dict]] = {"bench-demo.png": bench_demo}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", help="a figure's file name; repeatable (default: every figure)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ws-figures"))
    args = ap.parse_args()
    orphans = sorted(p.name for p in DOCS.glob("*.png") if p.name not in FIGURES)
    if orphans:
        raise SystemExit(f"docs/ has figures without a recipe in {Path(__file__).name}: {', '.join(orphans)}")
    names = args.only or sorted(FIGURES)
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise SystemExit(f"no recipe for {', '.join(unknown)}; known: {', '.join(sorted(FIGURES))}")
    for name in names:
        work = args.workdir / name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        print(f"{name}:", file=sys.stderr)
        try:
            result = FIGURES[name](DOCS / name, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({"figure": f"docs/{name}", "measured": result}, indent=1))


if __name__ == "__main__":
    main()
