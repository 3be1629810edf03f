"""Bounds for the onnxruntime child processes (``--prepack``'s optimizer, ``--unpack ort-cpu``'s probe).

ORT optimizes whatever graph it is given: constant folding can turn a 136-byte model into a 256 MiB initializer,
and some graphs keep it busy for minutes. A hostile model must end the run with one line, so each child runs
under limits derived from the model's own size, each with a floor that every ordinary model stays far below:

- wall time: ``WALL_FLOOR_S`` (30 s) + ``WALL_S_PER_GIB`` per GiB of input (``derived_wall_s``;
  ``--ort-child-timeout`` overrides);
- CPU time (RLIMIT_CPU): the wall time times the CPUs ORT's thread pool may use;
- address space (RLIMIT_AS): ``MEMORY_FLOOR`` + ``MEMORY_PER_BYTE`` x input (``--ort-child-memory`` overrides);
- file size (RLIMIT_FSIZE) and, checked afterwards, everything ORT wrote: ``--ort-max-growth`` (default 4) x
  the input, by default at least ``OUTPUT_FLOOR`` (16 MiB; 1 MiB with a factor given): the packed and
  reordered copies of a real model are about 1-2x it.

Children also die with their parent (PR_SET_PDEATHSIG): a converter killed with -9 leaves no ORT behind. The
``--prepack`` child serves every model of a run (``server.OrtChild``): it sets each model's limits on itself before
that model's work (``apply_limits``), CPU time counted from what it had used before.
"""

from __future__ import annotations

import ctypes
import math
import os
import resource
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ....errors import Unsupported

DEFAULT_BUDGET = 32 << 20  # weight bytes per ORT segment (``segments``); a window (two segments) is optimized at once
BUDGET_ENV = "WEIGHTSHARE_ORT_SEGMENT_BYTES"  # smaller budgets, to exercise the cuts on small models
# the child's ``Target``: JSON {"blob", "align", "scratch", ...}; here, not in ``prepack``, which the child would
# import for it with the whole writing side (0.2-0.3 s of CPU per run where no bytecode is cached)
TARGET_ENV = "WEIGHTSHARE_PREPACK_TARGET"


def budget_from_env() -> int:
    value = os.environ.get(BUDGET_ENV, "")
    return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_BUDGET


# A floor of seconds, not minutes: python + onnxruntime start in about 1 s and optimize a small model in 1-2 s
# more; a model of a few hundred bytes that keeps ORT busy longer asks for work its size does not justify (a
# constant-folding bomb that ``fold_bound`` could not size statically).
WALL_FLOOR_S = 30.0
WALL_S_PER_GIB = 600.0
MEMORY_FLOOR = 4 << 30  # python + onnxruntime + numpy map ~0.4 GiB of address space before loading anything
MEMORY_PER_BYTE = 8  # the mapped model, ORT's optimized copy, reordered and packed copies, allocator slack
OUTPUT_FLOOR = 16 << 20
DEFAULT_GROWTH = 4.0
PR_SET_PDEATHSIG = 1

# Lines an out-of-memory child prints, whatever part of it ran out.
_OOM_MARKS = (
    "MemoryError",
    "bad_alloc",
    "Cannot allocate memory",
    "Failed to allocate",
    "out of memory",
    "failed to map segment",  # a shared library the address-space limit left no room for
)


@dataclass(frozen=True)
class ChildLimits:
    wall_s: float
    cpu_s: int
    memory_bytes: int
    output_bytes: int
    where: str  # the model, for messages

    def preexec(self) -> Callable[[], None]:
        """For ``subprocess``: applied in the child before it runs anything."""

        parent = os.getpid()  # in the parent: what the child must still have once it armed the signal

        def apply() -> None:
            die_with_parent(parent)
            resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_s, self.cpu_s + 5))
            resource.setrlimit(resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes))
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.output_bytes, self.output_bytes))

        return apply

    def to_json(self) -> dict[str, int]:
        """What a long-lived child applies to itself before each model (``apply_limits``)."""
        return {"cpu_s": self.cpu_s, "memory_bytes": self.memory_bytes, "output_bytes": self.output_bytes}

    def failure(self, returncode: int, stderr: str, written: Sequence[Path] = ()) -> str | None:
        """Which limit a failed child ran into (one line), or None when it failed for another reason.
        ``written``: the files it wrote (one at the file-size limit: it ran into that limit)."""
        if any(f.is_file() and f.stat().st_size >= self.output_bytes for f in written):
            return self.output_message()
        if returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
            return f"onnxruntime exceeded its CPU time limit of {self.cpu_s} s (raise it with --ort-child-timeout)"
        if returncode in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or "File too large" in stderr:
            return self.output_message()
        if any(mark in stderr for mark in _OOM_MARKS) or returncode in (-signal.SIGSEGV, -signal.SIGABRT):
            return (
                f"onnxruntime exceeded its memory limit of {self.memory_bytes >> 20} MiB "
                "(raise it with --ort-child-memory MIB)"
            )
        return None

    def timeout_message(self) -> str:
        return f"onnxruntime exceeded its wall time limit of {self.wall_s:g} s (raise it with --ort-child-timeout)"

    def output_message(self) -> str:
        return (
            f"onnxruntime's optimizer would write more than {self.output_bytes >> 20} MiB for this model "
            "(constant folding?); allow it with --ort-max-growth FACTOR"
        )

    def check_output(self, files: list[Path], appended: int = 0) -> None:
        """Everything the child wrote, against the bound (RLIMIT_FSIZE bounds each file, not their sum): the blocks
        each file holds, not its length (a node's packed file keeps its packed copies, its weights are holes);
        ``appended``: what it added to a file that was there before (``--prepack``'s staged blob)."""
        total = appended + sum(min(st.st_size, st.st_blocks * 512) for f in files if f.is_file() and (st := f.stat()))
        if total > self.output_bytes:
            raise Unsupported(self.output_message(), self.where)


def apply_limits(doc: dict[str, int]) -> None:
    """In a child that serves several models (``child.serve``): one model's limits (``ChildLimits.to_json``) as
    this process's soft limits, the hard ones left as they are so that the next model's can be set. The CPU limit
    counts from what the process has used so far; past it the kernel sends SIGXCPU, which ends the process."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = math.ceil(used.ru_utime + used.ru_stime) + int(doc["cpu_s"])
    for kind, value in (
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_AS, int(doc["memory_bytes"])),
        (resource.RLIMIT_FSIZE, int(doc["output_bytes"])),
    ):
        _, hard = resource.getrlimit(kind)
        resource.setrlimit(kind, (value if hard == resource.RLIM_INFINITY else min(value, hard), hard))


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere a no-op). ``parent``: the pid
    it must still have; a parent that died before the request was made left this process orphaned, so it exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


def derived_wall_s(input_bytes: int) -> float:
    """The wall time a model of ``input_bytes`` justifies (its CPU time follows in ``limits_for``)."""
    return WALL_FLOOR_S + WALL_S_PER_GIB * input_bytes / (1 << 30)


def limits_for(
    input_bytes: int,
    where: str | os.PathLike[str],
    timeout_s: float | None = None,
    memory_mib: int | None = None,
    growth: float | None = None,
) -> ChildLimits:
    """The limits for a child working on a model of ``input_bytes`` (model file plus its weights)."""
    wall = timeout_s if timeout_s is not None else derived_wall_s(input_bytes)
    memory = memory_mib << 20 if memory_mib is not None else MEMORY_FLOOR + MEMORY_PER_BYTE * input_bytes
    factor = growth if growth is not None else DEFAULT_GROWTH
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return ChildLimits(
        wall_s=wall,
        cpu_s=max(1, math.ceil(wall * cpus)),
        memory_bytes=memory,
        # the floor covers small models at the default factor; a factor the user gives is taken as given
        output_bytes=max(OUTPUT_FLOOR, int(factor * input_bytes))
        if growth is None
        else max(1 << 20, int(factor * input_bytes)),
        where=os.fspath(where),
    )
