"""Mutation fuzzing shared by the test suite and scripts/fuzz.py.

Every mutated model must give either a conversion or a ``WeightshareError`` whose
message is one line naming the file, leave nothing behind in OUTDIR on failure,
and never allocate much more than the file's size (tracemalloc, which numpy
reports into, measures the Python-side peak). An accepted output must re-read
with every recorded checksum intact; a sample of accepted (input, output) pairs
is kept, and ``runtime_loads`` checks in a child process that the runtime loads
every converted model whose original it loads.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
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
        return kind, data[:pos] + bytes(enc) + data[pos + len(enc) :]
    if kind == "zero":
        end = min(n, pos + rng.randint(1, 64))
        return kind, data[:pos] + bytes(end - pos) + data[end:]
    if kind == "duplicate":
        end = min(n, pos + rng.randint(1, 256))
        return kind, data[:end] + data[pos:end] + data[end:]
    other = rng.randrange(max(1, n))
    return kind, data[:pos] + data[other : other + rng.randint(1, 512)] + data[pos:]


@dataclass
class FuzzStats:
    inputs: int = 0
    converted: int = 0
    rejected: int = 0
    by_kind: dict = field(default_factory=dict)
    max_alloc: int = 0
    keep_dir: Path | None = None  # where accepted (input, output) pairs are kept for ``runtime_loads``
    keep_every: int = 10  # keep every n-th accepted pair
    kept: list[tuple[Path, Path]] = field(default_factory=list)  # (input model, converted model)


def check_one(
    data: bytes,
    name: str,
    workdir: Path,
    stats: FuzzStats,
    kind: str = "",
    extra: dict[str, bytes] | None = None,
    options: ConvertOptions | None = None,
) -> None:
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


def convert_and_check(
    src: Path, out: Path, size: int, stats: FuzzStats, kind: str = "", options: ConvertOptions | None = None
) -> None:
    """Convert ``src`` into ``out`` and assert the invariants for an input of ``size`` bytes."""
    tracemalloc.start()
    report = None
    try:
        report = api.convert(src, out, options)
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
    if report is not None:
        model = Path(report.outputs[0])
        _assert_rereads(model)
        if stats.keep_dir is not None and stats.converted % stats.keep_every == 1:
            _keep(src, model, stats)


def _assert_rereads(model: Path) -> None:
    """The output's blob records match its bytes, and every payload is where the model says."""
    from weightshare._dispatch import inventory

    inv = inventory(model, hash_payloads=True)
    problems = [p.problem for p in inv.payloads if p.problem] + inv.record_problems
    problems += [
        f"{p.name}: checksum differs" for p in inv.payloads if p.recorded_sha256 and p.sha256 != p.recorded_sha256
    ]
    assert not problems, f"accepted output does not re-read: {problems[:3]}"


def _keep(src: Path, model: Path, stats: FuzzStats) -> None:
    assert stats.keep_dir is not None
    pair = stats.keep_dir / str(len(stats.kept))
    shutil.copytree(src.parent, pair / "in")
    shutil.copytree(model.parent, pair / "out")
    stats.kept.append((pair / "in" / src.name, pair / "out" / model.name))


_LOADER = r"""
import sys
for path in sys.argv[1:]:
    print("start", flush=True)
    try:
        if path.endswith(".onnx"):
            import onnxruntime as ort
            so = ort.SessionOptions()
            so.log_severity_level = 4
            ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        else:
            from ai_edge_litert.interpreter import Interpreter, OpResolverType
            Interpreter(model_path=path, experimental_op_resolver_type=
                        OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES).allocate_tensors()
        print("ok", flush=True)
    except Exception as e:
        print("fail", (str(e).strip().splitlines() or [type(e).__name__])[-1], flush=True)
"""


def _loads(paths: list[Path]) -> list[tuple[bool, str]]:
    """Does the runtime load each path? In child processes: a damaged input may crash a runtime's parser; a crash
    counts as not loaded, and the next child goes on after it."""
    results: list[tuple[bool, str]] = []
    while len(results) < len(paths):
        rest = paths[len(results) :]
        res = subprocess.run(
            [sys.executable, "-c", _LOADER, *map(str, rest)], capture_output=True, text=True, timeout=600
        )
        lines = res.stdout.splitlines()
        for line in lines:
            if line.startswith(("ok", "fail")):
                results.append((line == "ok", line[5:]))
        if len(results) < len(paths) and lines and lines[-1] == "start":  # crashed on this one
            results.append((False, f"the runtime crashed (exit {res.returncode})"))
        elif res.returncode != 0 and len(results) < len(paths):
            raise AssertionError(f"loader failed: {res.stderr.strip()[-300:]}")
    return results


def runtime_loads(stats: FuzzStats) -> dict[str, int]:
    """For each kept pair: when the runtime loads the input, it must load the output too.

    Returns counts (``pairs``, ``original_loads``); raises AssertionError naming the first pair that breaks it.
    """
    originals = _loads([o for o, _c in stats.kept])
    loadable = [pair for pair, (ok, _why) in zip(stats.kept, originals) if ok]
    for (original, converted), (ok, why) in zip(loadable, _loads([c for _o, c in loadable])):
        assert ok, f"the runtime loads {original} but not its conversion {converted}: {why}"
    return {"pairs": len(stats.kept), "original_loads": len(loadable)}
