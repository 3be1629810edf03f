"""What a cold `check` of a `--prepack` output costs, this checkout against another, side by side in one run.

    python scripts/bench_check_cpu.py --forms /work/forms --baseline /path/to/old/checkout [--repeat 2] FORM...

Each form (a model or model folder under ``--forms``) is converted once with `convert --prepack` by this checkout;
then `check OUT` runs cold (a fresh ``XDG_CACHE_HOME``: nothing measured is reused) with this checkout and with the
baseline's, interleaved, ``--repeat`` times each. Per run: the process tree's CPU time (user + system, from
``wait4``) and its largest process (``ru_maxrss`` of the tree: the measuring child's peak, not the parent's); the
least CPU of the runs is kept (a shared machine adds, never takes away). The conversion's CPU is printed as the
target's anchor (check's CPU <= it, largest process <= 1 GiB).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tree: Path, args: list[str]) -> tuple[int, float, float]:
    """(exit code, CPU seconds of the process tree, its largest process in MiB) of ``python -m weightshare ARGS``
    with ``tree``'s weightshare."""
    cache = tempfile.mkdtemp(prefix="bench-check-cpu-")
    env = {**os.environ, "PYTHONPATH": str(tree), "XDG_CACHE_HOME": cache}
    pid = os.fork()
    if pid == 0:
        os.chdir(tree)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.execve(sys.executable, [sys.executable, "-m", "weightshare", *args], env)
    _, status, ru = os.wait4(pid, 0)
    shutil.rmtree(cache, ignore_errors=True)
    return os.waitstatus_to_exitcode(status), ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("forms", nargs="+")
    ap.add_argument("--forms", dest="root", default="/work/forms")
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    trees = [("this", ROOT), ("baseline", Path(a.baseline).resolve())]
    print(f"# this: {ROOT}; baseline: {trees[1][1]}; least CPU of {a.repeat} cold runs each, interleaved")
    print(f"{'form':18} {'convert --prepack':>18} {'check (this)':>22} {'check (baseline)':>22}")
    with tempfile.TemporaryDirectory(prefix="bench-check-cpu-", dir="/tmp") as tmp:
        for form in a.forms:
            out = Path(tmp) / form
            code, convert_cpu, _ = _run(ROOT, ["convert", str(Path(a.root) / form), "-o", str(out), "--prepack", "-q"])
            if code:
                print(f"{form:18} convert exit {code}")
                continue
            best: dict[str, tuple[float, float, int]] = {}
            for _ in range(a.repeat):
                for name, tree in trees:
                    code, cpu, peak = _run(tree, ["-q", "check", str(out)])
                    seen = best.get(name)
                    if seen is None or cpu < seen[0]:
                        best[name] = (cpu, max(peak, seen[1] if seen else 0.0), code)
                    else:
                        best[name] = (seen[0], max(peak, seen[1]), seen[2])
            cells = [f"{best[n][0]:5.1f} s {best[n][1]:5.0f} MiB exit {best[n][2]}" for n, _t in trees]
            print(f"{form:18} {convert_cpu:16.1f} s {cells[0]:>22} {cells[1]:>22}", flush=True)
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
