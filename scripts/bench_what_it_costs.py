"""What a user pays for TFLite `--prepack` outputs, beside `check`'s verdict: PSS of 1/2/4 instances in one
process and 1/2/4 processes (one instance each), through `weightshare.litert` and under LiteRT's default Interpreter.

The models are the test fixtures built as the exporters lay them out (tests/tflite_fixtures.py): MediaPipe
members (no SignatureDef, 0-d activations; `mediapipe_member` at three widths), the litert-torch LM layout
(`two_signature_lm`, prefill + decode over one copy of the weights) and a sparse (DENSIFY) FULLY_CONNECTED. Each is
converted with `--prepack`; every figure is what the model and its runtime add to fresh processes (PSS less the
clean pages of shared libraries, which any process on the machine loading LiteRT shares), the processes of one
row alive at once (`weightshare._runtimes.memory.in_children`, as `check` measures). `check` then gives its own
figures (4 instances in one process, 2 processes) and its verdict. docs/tflite.md quotes the output
(scripts/bench_what_it_costs.txt).

Usage: python scripts/bench_what_it_costs.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import _builders  # noqa: F401 -- tests/ on sys.path: the fixture builders

MiB = 1 << 20


def models(root: Path) -> dict[str, Path]:
    from tflite_fixtures import mediapipe_member, sparse_model, two_signature_lm

    return {
        "mediapipe member, 0.6 MiB": mediapipe_member(root / "member_small.tflite", width=256),
        "mediapipe member, 5.6 MiB": mediapipe_member(root / "member_mid.tflite", width=1024),
        "mediapipe member, 19 MiB": mediapipe_member(root / "member_large.tflite", width=2048),
        "litert-torch LM, 8.3 MiB": two_signature_lm(root / "lm.tflite", vocab=8192, width=128, scalar=True),
        "sparse FC (DENSIFY), 1.2 MiB": sparse_model(root / "sparse.tflite", rows=1024, cols=512),
    }


def measure(path: Path, loader: str, share: bool) -> dict[str, float]:
    """MiB the model and its runtime add: 1/2/4 instances in one process, 2/4 processes with one each (in all)."""
    from weightshare._runtimes.memory import in_children
    from weightshare.formats.onnx.measure import MALLOC_ENV
    from weightshare.formats.tflite.measure import LOADER_PROBES
    from weightshare.formats.tflite.signatures import signature_bounds

    bounds = signature_bounds(str(path))
    out = {}
    for processes, instances in ((1, 1), (1, 2), (1, 4), (2, 1), (4, 1)):
        pss = in_children(
            LOADER_PROBES,
            "hold",
            [str(path), share, loader, bounds, {}, {}, instances],
            processes,
            MALLOC_ENV,
            count_import=loader == "helper",
        )
        key = f"{instances} inst" if processes == 1 else f"{processes} proc"
        out[key] = sum(pss) / MiB
    return out


def check(path: Path) -> tuple[dict, list[dict], int]:
    res = subprocess.run(
        [sys.executable, "-m", "weightshare", "check", str(path), "--json"], capture_output=True, text=True
    )
    doc = json.loads(res.stdout)
    paid = {(p["instances"], p["processes"]): p for p in doc["reports"][0]["paid"]}
    found = [f for f in doc["findings"] if f["code"] in ("costs-more-than-original", "what-it-costs")]
    return paid, found, res.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="what-it-costs-"))
    work.mkdir(parents=True, exist_ok=True)
    import ai_edge_litert

    print(f"ai-edge-litert {ai_edge_litert.__version__}; MiB the model and its runtime add (PSS, see above)")
    cols = ["1 inst", "2 inst", "4 inst", "1 proc", "2 proc", "4 proc"]
    print(f"{'model':30} {'loader':27} " + " ".join(f"{c:>7}" for c in cols) + "   check (4 inst / 2 proc)")
    for name, src in models(work).items():
        res = subprocess.run(
            [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(work / "out"), "--prepack", "-q"],
            capture_output=True,
            text=True,
        )
        if res.returncode:
            sys.exit(f"{src}: convert failed: {res.stderr.strip()}")
        out = work / "out" / src.name
        paid, found, code = check(out)
        for label, loader, share, role in (
            ("converted, weightshare.litert", "helper", True, "converted"),
            ("original, default Interpreter", "interpreter", False, "original"),
        ):
            row = measure(out, loader, share)
            row["1 proc"] = row["1 inst"]
            cells = " ".join(f"{row[c]:7.1f}" for c in cols)
            mine = " / ".join(f"{paid[k][role] / MiB:.1f}" for k in ((4, 1), (2, 2)) if k in paid)
            print(f"{name:30} {label:29} {cells}   {mine}")
        verdict = found[0]["code"] if found else "(not measured)"
        even = found[0]["message"].split("break-even: ")[-1] if found and "break-even" in found[0]["message"] else ""
        print(f"{'':30} check: exit {code}, {verdict}" + (f"; break-even: {even}" if even else ""))


if __name__ == "__main__":
    main()
