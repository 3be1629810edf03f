"""--prepack writes each byte once: bytes written against the outputs' size on every route, before and after.

    python scripts/bench_bytes.py --baseline DIR [--mib 48] [--workdir DIR]

``--baseline DIR``: a checkout of the code before this work (``git worktree add DIR d9d5adc``), whose CLI runs
with ``PYTHONPATH=DIR`` from DIR; the current tree is "after". Both convert the same models, side by side:
- a single model ORT optimizes in segments (optimum's ``decoder_model.onnx``, ``model_forms.decoder_family``);
- a model in one piece (``decoder_model_merged.onnx``: the decoder in an If, packed node by node);
- the family folder (decoder, decoder_with_past, merged: the same weights in each);
- the same three models as a zoo (``--shared-blob``);
- ``--prepack --unpack ort-cpu`` of an fp16 llama-like decoder (``model_forms.llama_fp16``);
- a MatMul+Conv model (``prepack_samples.mixed_onnx``: Conv 3x3 chain, then Gemm/MatMul layers).
Per route: bytes written (the process tree's ``ru_oublock`` x 512, from ``wait4``: page-cache bytes dirtied,
temporaries included, with the work directory on disk), the outputs' size and their ratio (the target: <= 1.3x),
the tree's CPU seconds (user + system), the process tree's peak RSS (the report's ``peak_rss_mib``) and, after,
the most bytes ORT's own files held in the memory-backed scratch at a time (``ort_scratch_peak_mib``: memory the
RSS does not show).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders)

REPO = Path(__file__).resolve().parents[1]
LIMIT = 1.3


def measured(root: Path, args: list[str]) -> dict[str, float]:
    """``python -m weightshare convert ARGS`` with the package at ``root``: bytes written, CPU, the reports."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(REPO / "tests")]),
        "PYTHONDONTWRITEBYTECODE": "1",  # a .pyc written on first import is not the conversion's
    }
    cmd = [sys.executable, "-m", "weightshare", "convert", *args, "-q", "--json"]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=root)
        _pid, status, ru = os.wait4(p.pid, 0)
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{cmd[3:6]}... failed: {err.read().decode()[-2000:]}")
        reports = json.loads(out.read())["reports"]
    peak = max(max(r["peak_rss_mib"], (r.get("folder") or {}).get("peak_rss_mib", 0)) for r in reports)
    scratch = max((r.get("prepack") or {}).get("ort_scratch_peak_mib", 0) for r in reports)
    return {
        "written": ru.ru_oublock * 512 / 2**20,
        "cpu": ru.ru_utime + ru.ru_stime,
        "peak": peak,
        "scratch": scratch,
    }


def size_mib(out: Path) -> float:
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and not f.name.startswith(".")) / 2**20


def linked(src: Path, stem: str, where: Path) -> Path:
    """``stem``'s model and data files of ``src`` alone in ``where`` (hard links)."""
    where.mkdir()
    for f in src.iterdir():
        if f.name.startswith(f"{stem}."):
            os.link(f, where / f.name)
    return where / f"{stem}.onnx"


def routes(t: Path, mib: float) -> list[tuple[str, list[str]]]:
    import model_forms as mf
    from prepack_samples import mixed_onnx

    fam = t / "family"
    mf.decoder_family(fam, mib=mib)
    names = ("decoder_model", "decoder_with_past_model", "decoder_model_merged")
    one = linked(fam, "decoder_model", t / "one")
    merged = linked(fam, "decoder_model_merged", t / "merged")
    fp16 = mf.build("llama_fp16", t / "fp16" / "model.onnx", mib=mib)
    (t / "mixed").mkdir()
    # Conv 512x512x3x3 (9 MiB each) and 1024x1024 Gemm/MatMul (4 MiB each), about ``mib`` of each kind
    conv = max(2, round(mib / 9))
    mixed = mixed_onnx(t / "mixed" / "model.onnx", conv_layers=conv, channels=512, mm_layers=round(mib / 4), dim=1024)
    return [
        ("one model cut in segments", [str(one)]),
        ("one model in one piece (an If)", [str(merged)]),
        ("family folder (3 decoders)", [str(fam)]),
        ("zoo --shared-blob (3 decoders)", [*(str(fam / f"{n}.onnx") for n in names), "--shared-blob", "fam"]),
        ("--unpack ort-cpu, fp16 decoder", [str(fp16), "--unpack", "ort-cpu"]),
        ("MatMul+Conv model", [str(mixed)]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="a checkout of the code before (git worktree add DIR d9d5adc)")
    ap.add_argument("--mib", type=float, default=48.0, help="weights per model")
    ap.add_argument("--workdir", default=None, help="where the models are built (a disk, not tmpfs: bytes written)")
    args = ap.parse_args()
    base = Path(args.baseline).resolve()
    rev = subprocess.run(["git", "-C", str(base), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    import onnxruntime as ort

    before = rev.stdout.strip() or base
    print(f"onnxruntime {ort.__version__}, {os.cpu_count()} CPUs; before: {before}, after: this tree")
    print(f"bytes written (the tree's ru_oublock x 512) / the outputs' size; target <= {LIMIT}x")
    head = f"{'route':34}{'outputs':>9}{'written before':>16}{'after':>14}{'CPU s':>12}{'peak MiB':>13}{'scratch':>9}"
    print(head)
    with tempfile.TemporaryDirectory(prefix="bench-bytes-", dir=args.workdir) as tmp:
        t = Path(tmp)
        met = True
        for n, (label, argv) in enumerate(routes(t, args.mib)):
            got = {}
            for side, root in (("before", base), ("after", REPO)):
                out = t / f"out{n}-{side}"
                got[side] = measured(root, [*argv[:1], "-o", str(out), "--prepack", *argv[1:]])
                got[side]["outputs"] = size_mib(out)
            b, a = got["before"], got["after"]
            ratio_b, ratio_a = b["written"] / b["outputs"], a["written"] / a["outputs"]
            met = met and ratio_a <= LIMIT
            print(
                f"{label:34}{a['outputs']:>7.0f} M{b['written']:>8.0f} M {ratio_b:4.2f}x{a['written']:>7.0f} M "
                f"{ratio_a:4.2f}x{b['cpu']:>6.1f}/{a['cpu']:<5.1f}{b['peak']:>6.0f}/{a['peak']:<6.0f}"
                f"{a['scratch']:>6.0f} M"
            )
        print(f"target met on every route (written <= {LIMIT}x the outputs): {met}")


if __name__ == "__main__":
    main()
