#!/usr/bin/env python3
"""Mutation fuzzing outside the test suite, with a time budget per format.

    python scripts/fuzz.py --minutes 10 [--format onnx --format tflite --format coreml] [--seed N]
    python scripts/fuzz.py --mode structure --minutes 10 [--format onnx --format tflite] [--seed N]
    python scripts/fuzz.py [--mode structure] --convert prepack|ort-cpu --format onnx --minutes 10

--mode bytes (the default) damages the file's bytes. Same harness as the tests (tests/fuzz_harness.py):
every damaged model must convert or fail with a one-line
WeightshareError naming the file, leave nothing in OUTDIR, and allocate no more than its size plus a fixed
slack. A failing input is saved under --save and the run stops with exit code 1.

--mode structure mutates fields of the parsed model (ONNX ModelProto, TFLite ModelT): dims, data types,
names, attributes, node inputs, external data entries, fp16 payload bits; it re-serialises, converts, and
whenever the original runs (ORT CPU / LiteRT builtin kernels, in a worker process) compares the outputs of
original and converted byte for byte (tests/fuzz_structure.py). It keeps going after a finding (saving each)
and prints the counts: converted / rejected / internal errors / output mismatches.

--convert prepack / ort-cpu (ONNX) fuzzes ``convert --prepack`` / ``convert --unpack ort-cpu`` instead of the plain
conversion, with seeds that exercise them (MatMul, Gemm, Conv; fp16 weights for ort-cpu). The structure mode then
compares the prepacked model at default options and the portable one under session.disable_prepacking=1 (prepack),
or the converted model under both (ort-cpu), each with the original under the same options.
--convert prepack --format tflite fuzzes ``convert --prepack`` of TFLite models (XNNPACK weight cache, seeds with
CONV_2D / FULLY_CONNECTED, fp32 and fp16+DEQUANTIZE); the structure mode compares the original under XNNPACK with
the converted model opened by ``weightshare.litert.compiled_model``, which must use its cache.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from coreml_fuzz import check_package, coreml_seeds, mutate_package, save_package  # noqa: E402
from fuzz_harness import FuzzStats, check_one, mutate, scratch_dir  # noqa: E402


def seeds(fmt: str, d: Path, convert: str = "plain") -> list:
    """(name, bytes, extra files) per seed model; for Core ML, ``coreml_fuzz.PackageSeed`` objects."""
    if fmt == "onnx" and convert != "plain":
        from fuzz_structure import seeds as struct_seeds

        return [(name, model.SerializeToString(), extra) for name, model, extra in struct_seeds(fmt, d, convert)]
    if fmt == "onnx":
        from onnx_fixtures import fuzz_seed_model, kitchen_sink

        out = []
        for build in (fuzz_seed_model, kitchen_sink):
            m = build(d)
            extra = {p.name: p.read_bytes() for p in d.iterdir() if p.suffix == ".data"}
            out.append((m.name, m.read_bytes(), extra))
        return out
    if fmt == "tflite" and convert == "prepack":
        from tflite_fixtures import sample_model

        return [("m.tflite", sample_model(d / "m.tflite", fc_out=64).read_bytes(), {})]
    if fmt == "tflite":
        from tflite_fixtures import sample_model, sparse_model

        return [
            ("m.tflite", sample_model(d / "m.tflite", fc_out=64).read_bytes(), {}),
            ("s.tflite", sparse_model(d / "s.tflite").read_bytes(), {}),
        ]
    if fmt == "coreml":
        return coreml_seeds(d)  # PackageSeed objects: packages are directories, mutated one file at a time
    raise SystemExit(f"unknown format {fmt}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="time budget per format")
    ap.add_argument("--format", action="append", choices=("onnx", "tflite", "coreml"))
    ap.add_argument("--seed", type=int, default=int(time.time()))
    ap.add_argument("--save", type=Path, default=Path("fuzz-failures"))
    ap.add_argument("--mode", choices=("bytes", "structure"), default="bytes")
    ap.add_argument(
        "--convert", choices=("plain", "prepack", "ort-cpu"), default="plain", help="ONNX: which conversion"
    )
    args = ap.parse_args()
    if args.convert == "ort-cpu" and (args.format or ["onnx"]) != ["onnx"]:
        raise SystemExit("--convert ort-cpu is an ONNX mode: add --format onnx")
    if args.convert == "prepack" and not set(args.format or ["onnx"]) <= {"onnx", "tflite"}:
        raise SystemExit("--convert prepack: add --format onnx or --format tflite")
    if args.mode == "structure":
        return structure(args)
    formats = args.format or ["onnx", "tflite"]
    from fuzz_structure import MODES

    options = MODES[args.convert]
    print(f"seed {args.seed} (convert: {args.convert})")
    failed = False
    for fmt in formats:
        with tempfile.TemporaryDirectory() as tmp:
            corpus = seeds(fmt, Path(tmp), args.convert)
            rng = random.Random(args.seed)
            stats = FuzzStats()
            work = scratch_dir(Path(tmp) / "w")
            deadline = time.monotonic() + args.minutes * 60
            try:
                while time.monotonic() < deadline:
                    if fmt == "coreml":  # a package: one of its files damaged, the others as they were
                        seed = rng.choice(corpus)
                        name = seed.name
                        kind, mutated = mutate_package(seed, rng)
                        run = lambda: check_package(name, mutated, work, stats, kind)  # noqa: B023 (run just below)
                    else:
                        name, data, extra = rng.choice(corpus)
                        kind, mutated = mutate(data, rng)
                        if rng.random() < 0.3:  # stack a second mutation now and then
                            kind2, mutated = mutate(mutated, rng)
                            kind = f"{kind}+{kind2}"
                        run = lambda: check_one(mutated, name, work, stats, kind, extra, options)  # noqa: B023
                    try:
                        run()
                    except Exception as e:  # a broken invariant (AssertionError) or a traceback: what fuzzing seeks
                        args.save.mkdir(parents=True, exist_ok=True)
                        path = args.save / f"{fmt}-{stats.inputs}-{name}"
                        if fmt == "coreml":
                            save_package(mutated, path)
                        else:
                            path.write_bytes(mutated)
                        what = "FAIL" if isinstance(e, AssertionError) else f"CRASH {type(e).__name__}:"
                        print(f"{fmt}: {what} on input {stats.inputs} ({kind}): {e} (saved {path})")
                        failed = True
                        break
            finally:
                shutil.rmtree(work, ignore_errors=True)
            print(
                f"{fmt}: {stats.inputs} inputs, {stats.converted} converted, {stats.rejected} rejected cleanly, "
                f"max traced allocation {stats.max_alloc / (1 << 20):.1f} MiB"
            )
    return 1 if failed else 0


def structure(args) -> int:
    from fuzz_structure import Finding, Runner, StructStats, one_input
    from fuzz_structure import seeds as struct_seeds

    formats = [f for f in (args.format or ["onnx", "tflite"]) if f != "coreml"]
    print(f"seed {args.seed} (structure, convert: {args.convert})", flush=True)
    findings = 0
    for fmt in formats:
        runner = Runner()
        stats = StructStats()
        with tempfile.TemporaryDirectory() as tmp:
            corpus = struct_seeds(fmt, Path(tmp), args.convert)
            rng = random.Random(args.seed)
            work = scratch_dir(Path(tmp) / "w")
            deadline = time.monotonic() + args.minutes * 60
            try:
                while time.monotonic() < deadline:
                    name, model, extra = rng.choice(corpus)
                    try:
                        one_input(fmt, model, name, rng, work, extra, runner, stats, args.convert)
                    except Finding as e:
                        findings += 1
                        args.save.mkdir(parents=True, exist_ok=True)
                        saved = args.save / f"{fmt}-{args.convert}-structure-{args.seed}-{stats.inputs}-{name}"
                        src = work / "in" / name
                        if src.exists():
                            shutil.copyfile(src, saved)
                        print(f"{fmt}: FINDING on input {stats.inputs}: {str(e)[:2000]} (saved {saved})", flush=True)
            finally:
                runner.close()
                shutil.rmtree(work, ignore_errors=True)
        print(stats.line(fmt), flush=True)
        print(f"{fmt}: mutations {dict(sorted(stats.kinds.items()))}", flush=True)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
