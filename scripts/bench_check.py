"""Does `check` agree with measured sharing? The model-form corpus at a given size, converted plain and with
--prepack, side by side in one run.

For every form and variant: `check --target ort-default --json`'s exit code and its figure for one more session
at default options, against an independent measurement (``weightshare.runtimes.ort.measure_sessions``: 1 and 4
sessions in a fresh process started with MALLOC_MMAP_THRESHOLD_=1048576, as the sharing criterion says): the PSS
ratio of 4 sessions to 1 and the PSS per extra session.
"agree" means: exit 0 exactly when 4 sessions <= 1.10x one, and the figure within 2x of the measured cost (or
both under 1 MiB).

    python scripts/bench_check.py 100                    # every form, ~100 MiB of weights each
    python scripts/bench_check.py 100 fp32 conv qdq      # some of them
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from weightshare.formats.onnx.measure import MALLOC_ENV
from weightshare.formats.onnx.model_forms import FORMS, build
from weightshare.runtimes.ort import measure_sessions

MiB = 1 << 20


def _check(model: Path) -> tuple[int, int]:
    res = subprocess.run(
        [sys.executable, "-m", "weightshare", "check", str(model), "--target", "ort-default", "--json"],
        capture_output=True,
        text=True,
    )
    doc = json.loads(res.stdout)
    (summary,) = [m for m in doc["models"] if m["model"] == str(model)]
    return res.returncode, summary["copied_per_session_by_setting"].get("ort-default", 0)


def main() -> None:
    mib = float(sys.argv[1]) if len(sys.argv) > 1 else 100.0
    names = sys.argv[2:] or list(FORMS)
    print(f"{'form':28s} {'variant':8s} {'exit':>4s} {'check MiB/s':>11s} {'PSS MiB/s':>9s} {'ratio 4/1':>9s}  agree")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            src = build(name, Path(tmp) / name / "m.onnx", mib)
            for variant, extra in (("plain", []), ("prepack", ["--prepack"])):
                out = Path(tmp) / name / variant
                conv = subprocess.run(
                    [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q", *extra],
                    capture_output=True,
                    text=True,
                )
                if conv.returncode != 0:
                    print(f"{name:28s} {variant:8s} convert failed: {conv.stderr.strip()[:100]}")
                    continue
                code, figure = _check(out / "m.onnx")
                rows = {
                    r["sessions"]: r["pss_mib"]
                    for r in measure_sessions(str(out / "m.onnx"), [1, 4], False, MALLOC_ENV)
                }
                ratio, per = rows[4] / rows[1], (rows[4] - rows[1]) / 3
                agree = code == (0 if ratio <= 1.10 else 1) and (
                    (per < 1 and figure < MiB) or per / 2 <= figure / MiB <= 2 * per
                )
                print(
                    f"{name:28s} {variant:8s} {code:4d} {figure / MiB:11.1f} {per:9.1f} {ratio:9.2f}  "
                    f"{'yes' if agree else 'NO'}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
