"""TFLite recipes side by side: which way of loading a converted model shares its weights, and at what speed.

For five models of >= 64 MiB built in code (fp32, fp16 + DEQUANTIZE, full int8, dynamic-range int8, weight-only
int8 = DEQUANTIZE of int8 weights), each FULLY_CONNECTED 2048x2048 layers on a [1, 2048] input:

  recipe                                   model it loads
  default Interpreter (XNNPACK)            the original                    (the baseline)
  default Interpreter (XNNPACK)            `convert` output
  BUILTIN_WITHOUT_DEFAULT_DELEGATES        `convert` output
  weightshare.litert.interpreter           `convert --prepack` output

(weight-only int8: both conversions with --unpack dequantize). Measured per recipe, each in fresh processes:
PSS of 1 and 4 instances in one process, the PSS sum of 1 and 3 processes with one instance each (PSS of the
model's own memory: every mapping but shared libraries, minus what the process had before loading; shared
libraries are the same for every recipe and are split by however many processes run), latency (median of
interleaved runs of all recipes in one process, ratio to the default Interpreter on the original) and whether
the outputs are the bytes the default Interpreter gives on the original.

Usage: python scripts/bench_tflite_recipes.py [--workdir DIR] [--layers-mib 64] [--runs 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
D = 2048  # FULLY_CONNECTED D x D: 4 MiB as int8, 8 MiB fp16, 16 MiB fp32
RECIPES = ("default, original", "default, converted", "no delegate, converted", "weightshare.litert.interpreter")


def build(kind: str, path: Path, file_mib: int) -> Path:
    """A stack of FULLY_CONNECTED layers whose weights are stored as ``kind``; the file holds >= file_mib MiB."""
    import numpy as np
    from ai_edge_litert import schema_py_generated as s

    sys.path.insert(0, str(REPO / "tests"))
    from tflite_fixtures import OP, ModelBuilder

    per_layer = {"fp32": 16, "fp16": 8, "int8": 4, "dynamic int8": 4, "weight-only int8": 4}[kind]
    layers = max(1, -(-file_mib // per_layer))
    rng = np.random.default_rng(0)
    mb = ModelBuilder()
    g = mb.subgraph("main")
    fc = (s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    if kind == "int8":
        h = g.input("x", [1, D], "int8", quant=(0.05, 0))
    else:
        h = g.input("x", [1, D])
    for i in range(layers):
        w32 = (rng.standard_normal((D, D)) * (1 / np.sqrt(D))).astype(np.float32)
        q = np.clip(np.round(w32 / 0.002), -127, 127).astype(np.int8)
        if kind == "fp32":
            w, b = g.const(f"w{i}", w32), g.const(f"b{i}", np.zeros(D, np.float32))
        elif kind == "fp16":
            w, b = g.dequantize(f"w{i}", w32.astype(np.float16)), g.const(f"b{i}", np.zeros(D, np.float32))
        elif kind == "weight-only int8":
            scales = (np.abs(w32).max(axis=1) / 127).astype(np.float32)
            qc = np.clip(np.round(w32 / scales[:, None]), -127, 127).astype(np.int8)
            wq = g.const(f"w{i}_q", qc, quant=(scales, np.zeros(D, np.int64)))
            w = g.tensor(f"w{i}", [D, D], "float32")
            g.op(OP.DEQUANTIZE, [wq], [w])
            b = g.const(f"b{i}", np.zeros(D, np.float32))
        elif kind == "dynamic int8":
            w, b = g.const(f"w{i}", q, quant=(0.002, 0)), g.const(f"b{i}", np.zeros(D, np.float32))
        else:  # full int8
            w = g.const(f"w{i}", q, quant=(0.002, 0))
            b = g.const(f"b{i}", np.zeros(D, np.int32), quant=(0.05 * 0.002, 0))
        quant = (0.05, 0) if kind == "int8" else None
        out = g.tensor(f"h{i}", [1, D], "int8" if kind == "int8" else "float32", quant=quant)
        g.op(OP.FULLY_CONNECTED, [h, w, b], [out], *fc)
        h = out
    g.outputs = [h]
    mb.signature("serving_default", g)
    return mb.save(path)


# ---------------------------------------------------------------------------------------------- child side


def own_pss_kib() -> int:
    """PSS of every mapping but shared libraries (anonymous memory, heap, the model and cache files)."""
    total, counting = 0, True
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if not head:
                continue
            if "-" in head[0] and len(head[0]) > 8 and not head[0].endswith(":"):  # a mapping's first line
                name = head[5] if len(head) > 5 else ""
                counting = ".so" not in name
            elif head[0] == "Pss:" and counting:
                total += int(head[1])
    return total


def load(recipe: str, paths: dict[str, str]):
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    if recipe == "default, original":
        it = Interpreter(model_path=paths["original"])
    elif recipe == "default, converted":
        it = Interpreter(model_path=paths["converted"])
    elif recipe == "no delegate, converted":
        it = Interpreter(
            model_path=paths["converted"],
            experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        )
    else:
        from weightshare.litert import interpreter

        it = interpreter(paths["prepacked"])
    it.allocate_tensors()
    return it


def feed(it):
    import numpy as np

    d = it.get_input_details()[0]
    rng = np.random.default_rng(1)
    if np.dtype(d["dtype"]).kind == "f":
        return rng.standard_normal([int(x) for x in d["shape"]]).astype(d["dtype"])
    return rng.integers(-100, 100, [int(x) for x in d["shape"]]).astype(d["dtype"])


def run_once(it, x):
    it.set_tensor(it.get_input_details()[0]["index"], x)
    it.invoke()
    return it.get_tensor(it.get_output_details()[0]["index"]).copy()


def child_instances(recipe: str, paths: dict[str, str], n: int) -> None:
    """PSS after 1 and after n instances (each run once), above what the process had before loading."""
    import ai_edge_litert.interpreter  # noqa: F401 -- imported before the baseline, as in a serving process

    import weightshare.litert  # noqa: F401

    base = own_pss_kib()
    kept, rows = [], {}
    for i in range(1, n + 1):
        it = load(recipe, paths)
        run_once(it, feed(it))
        kept.append(it)
        if i in (1, n):
            rows[i] = round((own_pss_kib() - base) / 1024, 1)
    print(json.dumps(rows))


def child_process(recipe: str, paths: dict[str, str]) -> None:
    """One instance; answers each line on stdin with its PSS above its own baseline."""
    import ai_edge_litert.interpreter  # noqa: F401

    import weightshare.litert  # noqa: F401

    base = own_pss_kib()
    it = load(recipe, paths)
    run_once(it, feed(it))
    print("ready", flush=True)
    for _line in sys.stdin:
        print(round((own_pss_kib() - base) / 1024, 1), flush=True)


def child_latency(paths: dict[str, str], runs: int) -> None:
    """All recipes in this process, one instance each, runs interleaved; median ms and output digests."""
    its = {r: load(r, paths) for r in RECIPES}
    x = feed(its[RECIPES[0]])
    digests = {r: hashlib.sha256(run_once(it, x).tobytes()).hexdigest() for r, it in its.items()}
    for _ in range(3):
        for it in its.values():
            run_once(it, x)
    times: dict[str, list[float]] = {r: [] for r in its}
    for _ in range(runs):
        for r, it in its.items():
            t = time.perf_counter()
            run_once(it, x)
            times[r].append(time.perf_counter() - t)
    print(json.dumps({r: [round(statistics.median(t) * 1000, 3), digests[r]] for r, t in times.items()}))


# ---------------------------------------------------------------------------------------------- parent side


def _child(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--child", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        **kw,
    )


def instances(recipe: str, paths: dict[str, str], n: int) -> dict[str, float]:
    p = _child(["instances", recipe, json.dumps(paths), str(n)])
    out, _ = p.communicate()
    return json.loads(out.strip().splitlines()[-1])


def processes(recipe: str, paths: dict[str, str], k: int) -> tuple[float, float]:
    """(PSS of 1 process, PSS sum of k processes), one instance each."""
    procs = []
    try:
        one = 0.0
        for i in range(k):
            p = _child(["process", recipe, json.dumps(paths)], stdin=subprocess.PIPE)
            procs.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "ready", recipe
            if i == 0:
                one = _ask(p)
        return one, sum(_ask(p) for p in procs)
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
            p.wait()


def _ask(p: subprocess.Popen) -> float:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write("pss\n")
    p.stdin.flush()
    return float(p.stdout.readline())


def convert(src: Path, out: Path, *flags: str) -> None:
    cmd = [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q", *flags]
    subprocess.run(cmd, check=True, capture_output=True)


def measure(kind: str, work: Path, file_mib: int, runs: int) -> dict:
    src = build(kind, work / f"{kind.replace(' ', '_')}.tflite", file_mib)
    extra = ["--unpack", "dequantize"] if kind == "weight-only int8" else []
    convert(src, work / "plain", *extra)
    convert(src, work / "prepack", *extra, "--prepack")
    paths = {
        "original": str(src),
        "converted": str(work / "plain" / src.name),
        "prepacked": str(work / "prepack" / src.name),
    }
    row: dict = {"model": kind, "file_mib": round(src.stat().st_size / 2**20, 1), "recipes": {}}
    lat = _child(["latency", json.dumps(paths), str(runs)])
    out, _ = lat.communicate()
    latency = json.loads(out.strip().splitlines()[-1])
    base_ms, base_digest = latency[RECIPES[0]]
    for recipe in RECIPES:
        inst = instances(recipe, paths, 4)
        one_proc, three_proc = processes(recipe, paths, 3)
        ms, digest = latency[recipe]
        row["recipes"][recipe] = {
            "pss_1": inst["1"],
            "pss_4": inst["4"],
            "proc_1": one_proc,
            "proc_3": three_proc,
            "ms": ms,
            "latency_ratio": round(ms / base_ms, 2),
            "outputs_equal": digest == base_digest,
        }
        print(f"  {kind}: {recipe}: {row['recipes'][recipe]}", file=sys.stderr, flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| model | recipe | PSS 1 inst. | 4 inst. | 4 / 1 | 1 proc. | 3 proc. | 3 / 1 | run ms | vs default | "
        "outputs = default on original |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for recipe, r in row["recipes"].items():
            lines.append(
                f"| {row['model']} ({row['file_mib']:.0f} MiB) | {recipe} | {r['pss_1']:.0f} | {r['pss_4']:.0f} | "
                f"{r['pss_4'] / max(r['pss_1'], 1e-9):.2f}x | {r['proc_1']:.0f} | {r['proc_3']:.0f} | "
                f"{r['proc_3'] / max(r['proc_1'], 1e-9):.2f}x | {r['ms']:.2f} | {r['latency_ratio']:.2f}x | "
                f"{'yes' if r['outputs_equal'] else 'no'} |"
            )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        what, rest = sys.argv[2], sys.argv[3:]
        if what == "instances":
            child_instances(rest[0], json.loads(rest[1]), int(rest[2]))
        elif what == "process":
            child_process(rest[0], json.loads(rest[1]))
        else:
            child_latency(json.loads(rest[0]), int(rest[1]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--file-mib", type=int, default=64)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--models", default="fp32,fp16,int8,dynamic int8,weight-only int8")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-tflite-recipes-", dir=args.workdir) as tmp:
        for kind in args.models.split(","):
            work = Path(tmp) / kind.replace(" ", "_")
            work.mkdir()
            rows.append(measure(kind, work, args.file_mib, args.runs))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
