"""4 sessions against 1 of one process, each with its own CPU arena (ORT's default) and sharing one
(``weightshare.ort.session(..., share_arena=True)``): PSS above the process's baseline and latency per run.

    python scripts/bench_share_arena.py [RUNS]

Models, built here: a Whisper-encoder-like one (Conv1d stem over 80 x 3000 mel frames, stride 2, then MLP blocks
over 1500 x 384) and a ViT-like one (1024 patches x 256, MLP blocks), both converted with --prepack so that the
weights are shared and what remains per session is the arena. Each configuration runs in a fresh process started
with MALLOC_MMAP_THRESHOLD_=1048576; sessions run one after another (RUNS rounds over all sessions).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders)

MiB = 1 << 20


def whisper_encoder_like(path: Path, dim: int = 384, layers: int = 4) -> Path:
    """Whisper-base's encoder shape: 80 mel bins x 3000 frames (the one builder, ``model_forms.whisper_encoder``)."""
    from model_forms import whisper_encoder

    return whisper_encoder(path, dim=dim, layers=layers, mel_bins=80, positions=1500, dynamic=False)


def vit_like(path: Path, tokens: int = 1024, dim: int = 256, layers: int = 4) -> Path:
    """A ViT-like encoder (the one builder, ``model_forms.vit_like``)."""
    from model_forms import vit_like as build

    return build(path, tokens=tokens, dim=dim, layers=layers)


def probe(path: str, sessions: int, share_arena: bool, runs: int) -> dict:
    """In this (child) process: open ``sessions`` sessions, run each once, then ``runs`` rounds; PSS and latency."""
    import time

    from weightshare._runtimes.memory import data_pss
    from weightshare._runtimes.ort import random_feeds
    from weightshare.ort import session

    base = data_pss()
    opened = [session(path, share_arena=share_arena) for _ in range(sessions)]
    feeds = random_feeds(opened[0], 0, {"*": 1}, {})
    for s in opened:
        s.run(None, feeds)
    t = time.perf_counter()
    for _ in range(runs):
        for s in opened:
            s.run(None, feeds)
    ms = (time.perf_counter() - t) / (runs * sessions) * 1000
    return {"pss_mib": round((data_pss() - base) / MiB, 1), "ms_per_run": round(ms, 1)}


def _in_child(model: str, n: int, share: bool, runs: int) -> dict:
    import json
    import os

    from weightshare.formats.onnx.measure import MALLOC_ENV

    cmd = [sys.executable, __file__, "--probe", model, str(n), str(int(share)), str(runs)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **MALLOC_ENV}, check=True)
    got: dict = json.loads(res.stdout.strip().splitlines()[-1])
    return got


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        rows = []
        for name, build in (("whisper-encoder-like", whisper_encoder_like), ("vit-like", vit_like)):
            src = build(d / f"{name}.onnx")
            out = d / f"{name}-out"
            cmd = [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q", "--prepack"]
            subprocess.run(cmd, check=True)
            model = str(out / src.name)
            got = {}
            for share in (False, True):
                for n in (1, 4):
                    got[share, n] = _in_child(model, n, share, runs)
            for share in (False, True):
                one, four = got[share, 1], got[share, 4]
                rows.append(
                    f"| {name} | {'shared arena' if share else 'arena per session'} | {one['pss_mib']} | "
                    f"{four['pss_mib']} | {four['pss_mib'] / one['pss_mib']:.2f}x | {one['ms_per_run']} | "
                    f"{four['ms_per_run']} |"
                )
    print("| model | arena | 1 session PSS MiB | 4 sessions PSS MiB | 4/1 | ms/run, 1 | ms/run, 4 |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        import json

        path, n, share, runs = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
        print(json.dumps(probe(path, n, share, runs)))
    else:
        main()
