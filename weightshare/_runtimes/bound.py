"""The memory bound of every runtime child ``check``, ``inspect`` and ``verify`` start: one formula.

A model of a few hundred bytes can ask a runtime for gigabytes (``Expand`` of one element to [20000, 20000] took
check's measuring child to 6.6 GB RSS, verify to 3.3 GB), so each child runs under an address-space limit derived
from what it is given (``child_memory_bytes``):

    2 x the largest model's mapped size (its file plus the data files it maps) + FLOOR_BYTES + PER_CPU_BYTES x CPUs

- the factor 2: the model's bytes and one working copy of them (a runtime's parsed graph, one session's
  private copy); what is mapped read-only is not counted by the limit at all (below), so for a model whose weights
  sit in a blob it is headroom;
- ``FLOOR_BYTES`` (2 GiB): python, numpy and the runtime, a dozen sessions' state, ordinary activations;
- ``PER_CPU_BYTES`` (128 MiB per CPU this process may run on): runtimes start a thread per CPU in every session
  and each thread's stack (8 MiB) counts; a measuring child opens up to 12 sessions.

The limit is ``RLIMIT_DATA`` (private writable memory: heap, anonymous mappings, thread stacks), not
``RLIMIT_AS``: address space also counts glibc's 64 MiB arena reservations per thread and every mapped weight
file, neither of which is memory used. ``WEIGHTSHARE_CHILD_MEMORY_MIB`` (``--child-memory MIB`` on the commands)
replaces the formula. A child that runs into it is "not measured" (``check``, ``inspect``: the static estimate
stands) or "not verified" (``verify``, exit 2), one line naming the option; never a failure of the model by itself.
"""

from __future__ import annotations

import os
import resource
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import WeightshareError

__all__ = ["ENV", "FLOOR_BYTES", "PER_CPU_BYTES", "ChildMemory", "OverBound", "child_memory", "child_memory_bytes"]

ENV = "WEIGHTSHARE_CHILD_MEMORY_MIB"
OPTION = "--child-memory MIB"
FLOOR_BYTES = 2 << 30
PER_CPU_BYTES = 128 << 20

# What a child that ran out of memory prints, whatever part of it ran out (onnxruntime, LiteRT, numpy, python).
OOM_MARKS = (
    "MemoryError",
    "bad_alloc",
    "Cannot allocate memory",
    "Failed to allocate",
    "failed to allocate",
    "out of memory",
    "Out of memory",
    "failed to map segment",  # a shared library the limit left no room for
)


class OverBound(RuntimeError):
    """A child ran into its memory bound (``ChildMemory.message`` says which and how to raise it)."""


def _die_with_parent(parent: int) -> None:
    """SIGKILL this (child) process when ``parent`` dies (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing); a parent
    that died before the request was made left it orphaned: it exits."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def child_memory_bytes(largest_mapped_bytes: int) -> int:
    """The bound of a runtime child whose largest model maps ``largest_mapped_bytes`` (the module's formula), or
    what ``WEIGHTSHARE_CHILD_MEMORY_MIB`` says."""
    given = os.environ.get(ENV, "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given) << 20
    return 2 * max(0, largest_mapped_bytes) + FLOOR_BYTES + PER_CPU_BYTES * _cpus()


def mapped_bytes(model: Path, data_files: Iterable[str] = ()) -> int:
    """What a runtime maps of ``model``: the file and the data files (names relative to its directory) it reads."""
    total = model.stat().st_size if model.is_file() else 0
    for name in set(data_files):
        f = model.parent / name
        # a TFLite model's buffers appended to itself are listed as its data file: mapped once, counted once
        if f.is_file() and not (model.is_file() and os.path.samefile(f, model)):
            total += f.stat().st_size
    return total


def mapped_by(model: Path, inventory: Callable[..., Any]) -> int:
    """``mapped_bytes`` of ``model`` with the data files its format's ``inventory`` (``inventory_file``) lists; an
    unreadable model: its file alone (the runtime will say why it refuses it)."""
    try:
        files = inventory(model, hash_payloads=False).external_files
    except (WeightshareError, OSError):
        files = []
    return mapped_bytes(model, files)


@dataclass(frozen=True)
class ChildMemory:
    """The bound of one child: ``limit`` bytes of private writable memory."""

    limit: int

    def preexec(self) -> Callable[[], None]:
        """For ``subprocess``: the limit, set in the child before it runs anything, and death with its parent."""
        parent = os.getpid()
        limit = self.limit

        def apply() -> None:
            _die_with_parent(parent)
            _, hard = resource.getrlimit(resource.RLIMIT_DATA)
            soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))

        return apply

    def ran_into(self, returncode: int, text: str) -> bool:
        """Whether a child that failed so (its exit status, its error text) ran out of memory under the bound."""
        return is_oom(text) or returncode in (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGKILL)

    def message(self, what: str) -> str:
        """One line: ``what`` (e.g. "not measured") and the option that raises the bound."""
        return (
            f"{what}: it needs more than the runtime child's memory bound of {self.limit >> 20} MiB (2 x the "
            f"model's mapped size + {FLOOR_BYTES >> 20} MiB + {PER_CPU_BYTES >> 20} MiB per CPU); raise it with "
            f"{OPTION} (or {ENV}=MIB)"
        )


def child_memory(largest_mapped_bytes: int) -> ChildMemory:
    return ChildMemory(child_memory_bytes(largest_mapped_bytes))


def is_oom(text: str) -> bool:
    return any(mark in text for mark in OOM_MARKS)
