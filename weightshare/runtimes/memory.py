"""Memory figures that mean what they say.

RSS counts a shared mapping once per process *and* once per mapping, so it
cannot show sharing; PSS (proportional set size) splits each shared page among
the processes mapping it. Both come from ``/proc/<pid>/smaps_rollup`` (Linux).
Peak RSS of a finished child comes from ``getrusage(RUSAGE_CHILDREN)``.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """Fields of /proc/<pid>/smaps_rollup in bytes (Rss, Pss, Shared_Clean, Private_Dirty, ...)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def memory_now(pid: int | str = "self") -> dict[str, float]:
    s = smaps_rollup(pid)
    mib = 1 << 20
    return {
        "rss_mib": round(s.get("Rss", 0) / mib, 1),
        "pss_mib": round(s.get("Pss", 0) / mib, 1),
        "private_mib": round((s.get("Private_Clean", 0) + s.get("Private_Dirty", 0)) / mib, 1),
        "shared_mib": round((s.get("Shared_Clean", 0) + s.get("Shared_Dirty", 0)) / mib, 1),
    }


def run_child_peak(cmd: list[str], **kwargs: Any) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``cmd`` to completion; return (result, its peak RSS in MiB).

    The peak is read from RUSAGE_CHILDREN in a fresh Python process that only
    spawns ``cmd``, so earlier children of the caller cannot inflate it.
    """
    wrapper = (
        "import resource, subprocess, sys, json\n"
        "r = subprocess.run(sys.argv[1:], capture_output=True)\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
        "sys.stderr.buffer.write(r.stderr)\n"
        "sys.stdout.buffer.write(r.stdout)\n"
        "sys.stdout.write('\\n__peak_mib__ %f\\n' % peak)\n"
        "sys.exit(r.returncode)\n"
    )
    res = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, **kwargs)
    lines = res.stdout.rstrip("\n").split("\n")
    peak = float(lines[-1].split()[1]) if lines and lines[-1].startswith("__peak_mib__") else float("nan")
    res.stdout = "\n".join(lines[:-2]) if len(lines) >= 2 else ""
    return res, peak


def in_child(module: str, func: str, args: list[object]) -> Any:
    """Call ``module.func(*args)`` in a fresh Python process and return its JSON result (as ``json.loads`` does).

    Memory probes run in their own process so that nothing loaded before (another
    model, another runtime) is counted, and so that PSS is per process.
    """
    import json

    code = f"import json, sys; from {module} import {func}; print(json.dumps({func}(*json.loads(sys.argv[1]))))"
    res = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True)
    if res.returncode != 0:
        tail = res.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{module}.{func} failed in a child process: {tail[0]}")
    return json.loads(res.stdout.strip().splitlines()[-1])
