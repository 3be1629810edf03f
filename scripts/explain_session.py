"""What one more ONNX Runtime session of a model keeps, broken down: per mapping kind and by the content of its pages.

    PYTHONPATH=$PWD python scripts/explain_session.py MODEL.onnx [MODEL.onnx ...] [--sessions 4]

For each model and each setting check measures (session.disable_prepacking=1, default options; the CPU arena off, as
check measures weight copies), in a fresh child started as check starts its measuring children: the PSS growth per
session without code (what check weighs), per mapping kind (heap, anonymous, weight files, other files), and the
pages the added sessions made resident classified by content (``weightshare/_runtimes/remainder.py``): byte copies
of the model's weights (named), ONNX Runtime's own state (pointer-dense pages), zero-filled, unclassified; then
what check counted as weights and copies before (the whole growth but a one-node model's) and what it counts now
(the growth but ORT's own state); and the allocator's free pages the measuring child handed back before reading
each figure (``measure._trim``: held by no session, never counted). Figures in MiB per session;
scripts/explain_session.txt is one run's output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from weightshare._runtimes.memory import in_child
from weightshare.formats.onnx.measure import MALLOC_ENV, SETTINGS


def _mib(n: float) -> str:
    return f"{n / (1 << 20):6.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--sessions", type=int, default=4)
    args = ap.parse_args()
    print(
        "| model | setting | PSS/session | heap | anonymous | weight files | runtime state | weights | zero | "
        "unclassified | check counted before | counted as weights now | freed heap | weights found copied |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for setting, share in SETTINGS:
            res = in_child(
                "weightshare.formats.onnx.measure",
                "probe",
                [str(model), share, args.sessions, False, False, {}, {}, True],
                MALLOC_ENV,
            )
            if "pss" not in res:
                print(f"| {model} | {setting} | not measured: {res} |")
                continue
            data = res["data_pss"]
            growth = max(0, (data[-1] - data[0]) // (res["sessions"] - 1))  # data: after the first and the last
            b = res.get("breakdown")
            if b is None:
                print(f"| {model} | {setting} | {_mib(growth)} | (below the breakdown's floor) |")
                continue
            state = b["pages"]["runtime objects"]
            counted = max(0, growth - max(res["overhead"], min(growth, state)))
            shown = b["tensors"][:3] if b["pages"]["weights"] >= 65536 else []
            named = ", ".join(f"{n} ({'/'.join(ops)}) {_mib(k).strip()}" for n, k, ops in shown)
            pss, pages = b["pss"], b["pages"]
            print(
                f"| {model} | {setting} | {_mib(growth)} | {_mib(pss['heap'])} | {_mib(pss['anonymous'])} | "
                f"{_mib(pss['weight files'])} | {_mib(state)} | {_mib(pages['weights'])} | {_mib(pages['zero'])} | "
                f"{_mib(pages['unclassified'])} | {_mib(max(0, growth - res['overhead']))} | {_mib(counted)} | "
                f"{_mib(res.get('freed', 0))} | {named or '-'} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
