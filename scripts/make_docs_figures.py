#!/usr/bin/env python3
"""Regenerate every figure in README.md and docs/: the measured text blocks from committed benchmark output, and
the PNGs from their recipes below, measured on this machine.

    python scripts/make_docs_figures.py --blocks     # rewrite the text blocks only (fast, no measuring)
    pip install -e ".[plot,runtimes]"
    python scripts/make_docs_figures.py [--only bench-demo.png] [--workdir /tmp/ws-figures]

A measured figure in the docs lives in a marked block, written from a benchmark's committed output:

    <!-- figures: scripts/demo.txt lines=3-12 -->
    ```text
    (lines 3 to 12 of scripts/demo.txt, verbatim)
    ```
    <!-- /figures -->

`lines=A-B` is optional (default: the whole file). tests/test_docs.py fails when a block differs from what this
script writes, and when a measured-looking number stands outside every block and its allow-list, so a figure
changes only by re-running its benchmark and committing the output.

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
import re
import shutil
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BLOCK = re.compile(
    r"(?P<open><!-- figures: (?P<source>\S+)(?: lines=(?P<first>\d+)-(?P<last>\d+))? -->\n)"
    r"(?P<body>.*?)(?P<close><!-- /figures -->)",
    re.S,
)


def documents() -> list[Path]:
    """Every document the figure blocks may live in: README.md and docs/*.md."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def block_body(source: str, first: int | None, last: int | None) -> str:
    """The body of a figure block: the source's lines first..last (1-based, inclusive), fenced as text."""
    path = ROOT / source
    if not path.is_file():
        raise SystemExit(f"figure block names {source}, which is not a file of the repository")
    lines = path.read_text(encoding="utf-8").splitlines()
    if first is not None and last is not None:
        if not 1 <= first <= last <= len(lines):
            raise SystemExit(f"figure block asks for lines {first}-{last} of {source}, which has {len(lines)}")
        lines = lines[first - 1 : last]
    return "```text\n" + "".join(line + "\n" for line in lines) + "```\n"


def write_blocks(text: str) -> str:
    """`text` with every figure block's body rewritten from its source."""

    def body(m: re.Match[str]) -> str:
        first, last = m["first"], m["last"]
        new = block_body(m["source"], int(first) if first else None, int(last) if last else None)
        return m["open"] + new + m["close"]

    return BLOCK.sub(body, text)


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
    ap.add_argument("--blocks", action="store_true", help="rewrite the text figure blocks only, then stop")
    args = ap.parse_args()
    for doc in documents():
        text = doc.read_text(encoding="utf-8")
        new = write_blocks(text)
        if new != text:
            doc.write_text(new, encoding="utf-8")
            print(f"{doc.relative_to(ROOT)}: figure blocks rewritten", file=sys.stderr)
    if args.blocks:
        return
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
