"""A decoder family in one `--prepack --shared-blob` blob: does one session of each model cost one model?

    python scripts/bench_family.py [--mib 120] [--workdir DIR]

optimum's decoder export (``model_forms.decoder_family``: decoder_model.onnx, decoder_with_past_model.onnx,
decoder_model_merged.onnx, the same fp32 weights in three data files) is built at ``--mib`` per model and
converted with ``--prepack --shared-blob family``. In a child started with MALLOC_MMAP_THRESHOLD_=1048576, PSS
above a process that imported onnxruntime: one default-option session of the largest model (the merged decoder,
both branches run) vs one session of each of the three, for the originals and the converted family. Also the
blob's size against the unique plain + unique packed bytes it holds, and whether every output is bit-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders)
import model_forms as mf
import numpy as np

from weightshare._runtimes.memory import memory_now

NAMES = ("decoder_model_merged.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")  # largest first
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


def probe(folder: str, count: int) -> dict:
    """Child: PSS above the baseline after one session of each of the first ``count`` models (each run)."""
    import onnxruntime as ort

    from weightshare.ort import malloc_trim

    base, sessions = memory_now()["pss_mib"], []
    for name in NAMES[:count]:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        s = ort.InferenceSession(str(Path(folder) / name), so, providers=["CPUExecutionProvider"])
        for branch in (True, False):
            s.run(None, mf.feeds(Path(folder) / name, batch=1, seq=8, use_cache_branch=branch))
        sessions.append(s)
    malloc_trim()
    return {"pss_mib": round(memory_now()["pss_mib"] - base, 1)}


def _child(folder: Path, count: int) -> float:
    cmd = [sys.executable, __file__, "--probe", str(folder), str(count)]
    out = subprocess.run(cmd, env={**os.environ, **MALLOC}, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out.splitlines()[-1])["pss_mib"])


def identical(src: Path, out: Path) -> bool:
    import onnxruntime as ort

    ok = True
    for name in NAMES:
        a, b = ort.InferenceSession(str(src / name)), ort.InferenceSession(str(out / name))
        for batch in (1, 8):
            for branch in (True, False):
                feeds = mf.feeds(src / name, batch=batch, use_cache_branch=branch)
                ok = ok and all(np.array_equal(x, y) for x, y in zip(a.run(None, feeds), b.run(None, feeds)))
    return ok


def unique_bytes(src: Path, blob: Path) -> tuple[int, int]:
    import onnx

    from weightshare._safetensors import read_safetensors_metadata

    plain = {}
    for name in NAMES:
        for t in onnx.load(str(src / name)).graph.initializer:
            data = onnx.numpy_helper.to_array(t).tobytes()
            plain[hashlib.blake2b(data).digest()] = len(data)
    start, header, _meta = read_safetensors_metadata(blob)
    packed = {}
    with open(blob, "rb") as f:
        for name, v in header.items():
            if "ort.prepacked/" in name:
                a, b = v["data_offsets"]
                f.seek(start + a)
                packed[hashlib.blake2b(f.read(b - a)).digest()] = b - a
    return sum(plain.values()), sum(packed.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=120.0, help="weights per model (>= 100 for the figures)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--probe", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe[0], int(args.probe[1]))))
        return
    import onnxruntime as ort

    print(f"onnxruntime {ort.__version__}, {os.cpu_count()} CPUs (shared)")
    with tempfile.TemporaryDirectory(prefix="bench-family-", dir=args.workdir) as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "out"
        mf.decoder_family(src, mib=args.mib)
        cmd = [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q", "--json"]
        res = subprocess.run([*cmd, "--prepack", "--shared-blob", "family"], capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(res.stderr)
        blob = Path(json.loads(res.stdout)["reports"][0]["zoo"]["blob"])  # the zoo's one blob, in every record
        plain, packed = unique_bytes(src, blob)
        weights = sum(f.stat().st_size for f in src.glob("*.data")) / 2**20
        print(f"\n== decoder family, {weights / 3:.1f} MiB of fp32 weights per model, 3 models ==")
        print(
            f"blob {blob.stat().st_size / 2**20:.1f} MiB = {blob.stat().st_size / (plain + packed):.3f}x "
            f"(unique plain {plain / 2**20:.1f} MiB + unique packed {packed / 2**20:.1f} MiB); "
            f"the sources hold {weights:.1f} MiB in three data files"
        )
        print(f"{'':44}{'1 session of the merged':>26}{'1 session of each of 3':>26}{'ratio':>8}")
        for label, folder in (("original, default options", src), ("--prepack --shared-blob, default options", out)):
            one, three = _child(folder, 1), _child(folder, 3)
            print(f"{label:44}{one:>22.1f} MiB{three:>22.1f} MiB{three / one:>7.2f}x")
        print(f"outputs bit-identical to the originals (both branches, batch 1 and 8): {identical(src, out)}")


if __name__ == "__main__":
    main()
