"""``weightshare bench`` for ExecuTorch: PSS of 1..N loaded programs in a fresh process.

The child imports the runtime, reads its own PSS (the baseline), then loads the program N times
(``load_program`` + ``load_method`` + one ``execute`` each, every method), and reports PSS above the baseline after
each count. ``share=False``: ``executorch.runtime`` as a user calls it; ``share=True``: ``loader.program``
(XNNPACK's weights cache, keys bound to content). Started with ``MALLOC_MMAP_THRESHOLD_=1048576`` so that buffers
freed after a load go back to the kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from ...errors import Unsupported

_CHILD = r"""
import json, sys, time
path, counts, share = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
from executorch.runtime import Runtime
from weightshare.formats.executorch.loader import program
from weightshare.formats.executorch.verify import _inputs, data_path_for

def memory():
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Pss", "Private_Clean", "Private_Dirty", "Shared_Clean", "Shared_Dirty"):
                out[k] = int(v.split()[0]) / 1024
    return out

rt = Runtime.get()
data = data_path_for(__import__("pathlib").Path(path))
base = memory()
held, rows, t0 = [], [], time.perf_counter()
for n in range(1, max(counts) + 1):
    if share:
        p = program(path, data)
    else:
        p = rt.load_program(path, **({"data_path": str(data)} if data else {}))
    for name in sorted(p.method_names):
        m = p.load_method(name)
        m.execute(_inputs(m.metadata, 0, 0))
        held.append(m)
    held.append(p)
    if n in counts:
        now = memory()
        rows.append({
            "sessions": n,
            "pss_mib": round(now["Pss"] - base["Pss"], 2),
            "private_mib": round(sum(now[k] - base[k] for k in ("Private_Clean", "Private_Dirty")), 2),
            "shared_mib": round(sum(now[k] - base[k] for k in ("Shared_Clean", "Shared_Dirty")), 2),
            "load_s": round(time.perf_counter() - t0, 3),
        })
print("ROWS " + json.dumps(rows), flush=True)
"""


def measure_programs(path: str, counts: list[int], share: bool = True) -> list[dict[str, Any]]:
    """Rows of ``{"sessions", "pss_mib", "private_mib", "shared_mib", "load_s"}`` for each count."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    try:
        res = subprocess.run(
            [sys.executable, "-c", _CHILD, path, json.dumps(sorted(counts)), "1" if share else "0"],
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
        )
    except subprocess.TimeoutExpired:
        raise Unsupported("the ExecuTorch measuring process did not finish within an hour", path) from None
    for line in res.stdout.splitlines():
        if line.startswith("ROWS "):
            rows: list[dict[str, Any]] = json.loads(line[5:])
            return rows
    last = (res.stderr.strip().splitlines() or ["no output"])[-1][:300]
    raise Unsupported(f"ExecuTorch could not load and run the program: {last}", path)
