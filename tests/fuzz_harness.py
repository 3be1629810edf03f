"""Mutation fuzzing shared by the test suite and scripts/fuzz.py.

Every mutated model must give either a conversion or a ``WeightshareError`` whose
message is one line naming the file, leave nothing behind in OUTDIR on failure,
and never allocate much more than the file's size (tracemalloc, which numpy
reports into, measures the Python-side peak).
"""

from __future__ import annotations

import os
import random
import shutil
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

from weightshare import api
from weightshare.errors import WeightshareError
from weightshare.options import ConvertOptions


def scratch_dir(fallback: Path) -> Path:
    """A RAM-backed directory when the machine has one: thousands of tiny conversions are I/O-bound."""
    import tempfile

    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="weightshare-fuzz-", dir=shm))
    return fallback


MUTATIONS = ("truncate", "flip", "byte", "varint", "zero", "duplicate", "splice")
ALLOC_SLACK = 48 << 20  # chunk buffers (4 MiB), varint decode temporaries, the skeleton: all far below this


def mutate(data: bytes, rng: random.Random, kind: str | None = None) -> tuple[str, bytes]:
    kind = kind or rng.choice(MUTATIONS)
    n = len(data)
    if n == 0:  # a stacked mutation after a truncation to nothing
        return "empty", data
    pos = rng.randrange(max(1, n))
    if kind == "truncate":
        return kind, data[:pos]
    if kind == "flip":
        out = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(n)
            out[i] ^= 1 << rng.randrange(8)
        return kind, bytes(out)
    if kind == "byte":
        out = bytearray(data)
        out[pos] = rng.choice((0x00, 0xFF, 0x7F, 0x80, rng.randrange(256)))
        return kind, bytes(out)
    if kind == "varint":  # a lying length or count: huge, negative as a 64-bit varint, or max
        value = rng.choice((0xFFFFFFFF, 1 << 40, (1 << 64) - 1, (1 << 63), 1 << 31, rng.randrange(1 << 32)))
        enc = bytearray()
        while True:
            b, value = value & 0x7F, value >> 7
            enc.append(b | (0x80 if value else 0))
            if not value:
                break
        return kind, data[:pos] + bytes(enc) + data[pos + len(enc):]
    if kind == "zero":
        end = min(n, pos + rng.randint(1, 64))
        return kind, data[:pos] + bytes(end - pos) + data[end:]
    if kind == "duplicate":
        end = min(n, pos + rng.randint(1, 256))
        return kind, data[:end] + data[pos:end] + data[end:]
    other = rng.randrange(max(1, n))
    return kind, data[:pos] + data[other:other + rng.randint(1, 512)] + data[pos:]


@dataclass
class FuzzStats:
    inputs: int = 0
    converted: int = 0
    rejected: int = 0
    by_kind: dict = field(default_factory=dict)
    max_alloc: int = 0


def check_one(data: bytes, name: str, workdir: Path, stats: FuzzStats, kind: str = "",
              extra: dict[str, bytes] | None = None, options: ConvertOptions | None = None) -> None:
    """Convert ``data`` as ``workdir/in/name``; raise AssertionError on any broken invariant."""
    src_dir, out = workdir / "in", workdir / "out"
    src_dir.mkdir(parents=True, exist_ok=True)
    if out.exists():  # reuse the directories: creating and removing them dominates on overlay filesystems
        for p in out.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    src = src_dir / name
    src.write_bytes(data)
    for rel, content in (extra or {}).items():
        if not (src_dir / rel).exists():
            (src_dir / rel).write_bytes(content)
    convert_and_check(src, out, len(data), stats, kind, options)


def convert_and_check(src: Path, out: Path, size: int, stats: FuzzStats, kind: str = "",
                      options: ConvertOptions | None = None) -> None:
    """Convert ``src`` into ``out`` and assert the invariants for an input of ``size`` bytes."""
    tracemalloc.start()
    try:
        api.convert(src, out, options)
        outcome = "converted"
    except WeightshareError as e:
        line = e.line()
        assert "\n" not in line, line
        assert e.path, f"error without a file: {line}"
        leftovers = sorted(p.name for p in out.iterdir()) if out.exists() else []
        assert leftovers == [], f"{line}; left behind {leftovers}"
        outcome = "rejected"
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= size + ALLOC_SLACK, f"allocated {peak} bytes for a {size}-byte input"
    stats.inputs += 1
    stats.max_alloc = max(stats.max_alloc, peak)
    setattr(stats, outcome, getattr(stats, outcome) + 1)
    stats.by_kind.setdefault(kind, [0, 0])[outcome == "rejected"] += 1
