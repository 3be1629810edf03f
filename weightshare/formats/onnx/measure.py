"""What ONNX Runtime copies per session, measured: the PSS an extra session costs, per setting, in a child.

Static rules cannot keep up with ORT: MatMulNBits, DynamicQuantizeMatMul, the QDQ kernels fused at
ORT_ENABLE_ALL, Attention and every kernel inside an ``If`` branch pre-pack their weights per session, and the
transformers optimizer's fp16 graphs cast per session (measured +44 to +344 MiB per session on forms
the rules said cost nothing). ORT itself is the one authority on what it copies, so ``check`` and ``inspect``
ask it: a fresh child process per setting opens sessions one by one, runs each once (seeded random inputs,
when the signature allows) so that mapped weights are paged in as in serving, and reads its PSS after each.
The child starts with ``MALLOC_MMAP_THRESHOLD_=1048576`` (``MALLOC_ENV``), as serving processes that share
weights are told to (``weightshare.ort``): buffers of 1 MiB or more that ORT allocates and frees at load (the
plain weight a pre-pack replaced, validation copies) are then mmapped and returned to the kernel when freed,
so what remains is what ORT keeps per session. Without it glibc's heap keeps some of them and the figure
depends on the sizes involved (measured, 4 MiB MatMulNBits int8: 0.5 MiB per session with it, 2.9 MiB
without; docs/ci.md). The cost of one more session is the growth from the first to the fourth session, over
3, of the PSS of everything but program code (``data_pss``: code is not per session, and its PSS moves with
other processes): form-agnostic, subgraphs included, and what a PSS benchmark would show.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from ...report import JsonDict

SESSIONS = 4  # growth from 1 to 4 sessions, over 3: the sharing criterion of a PSS benchmark (4 vs 1), less noisy
SETTINGS = (("ort-disable-prepacking", True), ("ort-default", False))
ENV_SKIP = "WEIGHTSHARE_NO_MEASURE"  # set to 1: inspect/check use the static estimate only
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576"}  # the measuring child's glibc setting (see above)


def probe(model_path: str, share: bool, sessions: int = SESSIONS) -> JsonDict:
    """In this (child) process: PSS after each of ``sessions`` sessions under the setting; or why ORT refused."""
    from ..._runtimes.memory import data_pss, smaps_rollup
    from ..._runtimes.ort import index_bounds, new_session, random_feeds

    opened: list[Any] = []
    pss: list[int] = []
    data: list[int] = []
    feeds: dict[str, Any] | None = None
    ran = True
    for _ in range(sessions):
        try:
            s = new_session(model_path, share=share, log_level=4)
        except Exception as e:  # noqa: BLE001 -- any refusal is the answer
            return {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
        if feeds is None and ran:
            try:
                feeds = random_feeds(s, 0, {}, {}, index_bounds(model_path))
            except Exception:  # noqa: BLE001 -- inputs it cannot make up: sessions are measured unrun
                ran = False
        if feeds is not None:
            try:
                s.run(None, feeds)
            except Exception:  # noqa: BLE001
                feeds, ran = None, False
        opened.append(s)
        pss.append(smaps_rollup()["Pss"])
        data.append(data_pss())
    return {"pss": pss, "data_pss": data, "ran": ran}


def available() -> bool:
    return importlib.util.find_spec("onnxruntime") is not None and os.environ.get(ENV_SKIP, "") != "1"


def measure_copies(path: Path) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """(setting id -> bytes one more session costs, setting id -> PSS of the child with one session (what
    `check` weighs the growth against), notes); ({}, {}, [why not]) when ORT is not installed."""
    if not available():
        return (
            {},
            {},
            ["per-session copies are the static estimate: onnxruntime is not installed (or measuring is off)"],
        )
    from ..._runtimes.memory import in_child

    out: dict[str, int] = {}
    one: dict[str, int] = {}
    notes: list[str] = []
    for setting, share in SETTINGS:
        try:
            res: JsonDict = in_child(__name__, "probe", [str(path), share], MALLOC_ENV)
        except RuntimeError as e:
            notes.append(f"could not measure {setting}: {e}")
            continue
        if "error" in res:
            notes.append(f"onnxruntime CPU refuses the model under {setting}: {res['error']}")
            continue
        pss = res["pss"]
        data = res["data_pss"]  # the growth without code's PSS, which other processes move
        out[setting] = max(0, (data[-1] - data[0]) // (len(data) - 1))
        one[setting] = pss[0]
        if not res["ran"]:
            notes.append(f"{setting}: sessions measured without a run (inputs could not be generated)")
    return out, one, notes
