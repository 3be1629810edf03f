"""The least CPU a measured `check` of a `--prepack` output can spend, beside the conversion and check itself.

    python scripts/bench_check_floor.py --forms /work/forms [--repeat 2] [FORM...]

check's figure of a setting is the PSS growth from one session to four (the sharing criterion of a PSS benchmark),
each session run once; a packed model is measured at the sharing setting and at default options (one more session
with the arena on for its activations), a portable twin at the sharing setting (its default-options figure is its
packed model's record). This opens exactly those sessions and runs, nothing else (no readings, no breakdown, no
static rules, no parent), in one child per form: the floor of that protocol. The same with two sessions per setting
(a growth needs two) is the floor of any measurement. Each beside the `--prepack` conversion's CPU and a cold
check's, all children of this process (user + sys from wait4).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import sys
from pathlib import Path
from weightshare._runtimes.ort import new_session
from weightshare.formats.onnx.decode import session_feeds
out, n = Path(sys.argv[1]), int(sys.argv[2])
for p in sorted(out.rglob("*.onnx")):
    twin = p.name.endswith(".portable.onnx")
    for share in (True,) if twin else (True, False):
        held = []
        for arena in [False] * n + ([] if share else [True]):
            s = new_session(str(p), share=share, log_level=4, arena=arena, spinning=False)
            feeds, _ = session_feeds(p, s, {}, {})
            s.run(None, feeds)
            held.append(s)
        del held
"""


def _cpu(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    """User + sys CPU seconds of ``cmd``'s process tree, and its exit code."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _pid, status, usage = os.wait4(proc.pid, 0)
    return usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forms", required=True, type=Path, help="what build_exporter_forms.py built")
    ap.add_argument("forms_", nargs="*", metavar="FORM", default=["optimum-t5", "genai-phi3-int4", "matmul-conv"])
    ap.add_argument("--repeat", type=int, default=1, help="runs of each step, interleaved, the least CPU kept")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    py = sys.executable
    print(f"{'form':<18}{'convert --prepack':>19}{'sessions only, 2/setting':>26}{'4/setting':>11}{'check cold':>12}")
    for form in args.forms_:
        best: list[float] = []
        rcc = 0
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory(dir="/tmp") as work:
                out = Path(work) / "out"
                env["XDG_CACHE_HOME"] = str(Path(work) / "cache")
                cmd = [py, "-m", "weightshare", "convert", str(args.forms / form), "-o", str(out), "--prepack", "-q"]
                conv, rc = _cpu(cmd, env)
                assert rc == 0, form
                two, rc2 = _cpu([py, "-c", _CHILD, str(out), "2"], env)
                four, rc4 = _cpu([py, "-c", _CHILD, str(out), "4"], env)
                check, rcc = _cpu([py, "-m", "weightshare", "-q", "check", str(out)], env)
                assert rc2 == rc4 == 0, form
                run = [conv, two, four, check]
                best = [min(a, b) for a, b in zip(best, run, strict=True)] if best else run
        conv, two, four, check = best
        print(
            f"{form:<18}{conv:>17.1f} s{two:>17.1f} s ({two / conv:.2f}x){four:>6.1f} s ({four / conv:.2f}x)"
            f"{check:>6.1f} s ({check / conv:.2f}x, exit {rcc})"
        )


if __name__ == "__main__":
    main()
