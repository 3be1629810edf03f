"""Memory figures that mean what they say.

RSS counts a shared mapping once per process *and* once per mapping, so it
cannot show sharing; PSS (proportional set size) splits each shared page among
the processes mapping it. Both come from ``/proc/<pid>/smaps_rollup`` (Linux).
Peak RSS of a finished child comes from ``getrusage(RUSAGE_CHILDREN)``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from .bound import ChildMemory, OverBound


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """Fields of /proc/<pid>/smaps_rollup in bytes (Rss, Pss, Shared_Clean, Private_Dirty, ...)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


_CODE = re.compile(r"\.so(\.[0-9.]+)?$")


def _smaps_sum(pid: int | str, dirty_code: bool) -> int:
    """Bytes of ``Pss`` over every mapping of ``/proc/<pid>/smaps`` but program code (libraries, executables),
    plus, with ``dirty_code``, the ``Private_Dirty`` pages of the code mappings."""
    total, code = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):  # a mapping's header line
                path = parts[5] if len(parts) > 5 else ""
                code = bool(path) and not path.startswith("[") and ("x" in parts[1] or bool(_CODE.search(path)))
            elif (parts[0] == "Pss:" and not code) or (dirty_code and parts[0] == "Private_Dirty:" and code):
                total += int(parts[1]) * 1024
    return total


def data_pss(pid: int | str = "self") -> int:
    """PSS in bytes of every mapping but program code: anonymous memory (heap, arenas, copies) and mapped data
    files (weights), without shared libraries and executables (``/proc/<pid>/smaps``). Code is not per session,
    but its PSS moves whenever another process maps or unmaps the same library (measured: +-1.5 MiB between two
    reads of an onnxruntime process on a shared machine), which would drown a few MiB of per-session copies."""
    return _smaps_sum(pid, dirty_code=False)


def paid_pss(pid: int | str = "self") -> int:
    """What a process pays, in bytes: the PSS of every mapping but program code, whose clean pages any process on
    the machine that loads the same library shares (their PSS moves with processes that are not the user's:
    +-5 MiB for LiteRT's 10 MiB library on a shared machine), plus the pages of code mappings this process
    dirtied (relocations, a library's data: 3.8 MiB for LiteRT's WebGPU accelerator, which CompiledModel loads)."""
    return _smaps_sum(pid, dirty_code=True)


def resident_bytes(spans: list[tuple[int, int]]) -> int:
    """Bytes resident in this process of the pages that the address ranges ``spans`` ([start, end)) cover, pages
    of mapped files left out: what a runtime's tensors outside the model file occupy (an arena whose tensors
    overlap is counted once per page). Read from ``/proc/self/pagemap``'s present bits (no privilege needed)."""
    import os
    import struct

    files: list[tuple[int, int]] = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 5 and parts[5].startswith("/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                files.append((lo, hi))
    page = os.sysconf("SC_PAGE_SIZE")
    pages: set[int] = set()
    for start, end in spans:
        if end > start and not any(lo <= start < hi for lo, hi in files):
            pages.update(range(start // page, (end + page - 1) // page))
    present = 0
    fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        for p in sorted(pages):
            (entry,) = struct.unpack("<Q", os.pread(fd, 8, p * 8))
            present += entry >> 63
    finally:
        os.close(fd)
    return present * page


MADV_DONTNEED = 4  # the same number on every Linux architecture


def drop_file_pages(files: list[str]) -> int:
    """Drop from this process's page tables the resident pages of its mappings of ``files`` (matched by inode and
    device, or inode and real path, as ``/proc/self/maps`` names them) with ``madvise(MADV_DONTNEED)``; the bytes
    dropped.

    Pages of a file mapping that were never written are the page cache's: dropped, they stay cached, and a later
    touch maps the same bytes again. RSS counts such a page once per mapping holding it, PSS once: dropping them
    changes what the process's RSS says, never its PSS while another of its mappings still holds the page.
    ONNX Runtime maps external data private and writable (``rw-p``), so a mapping is only touched when nothing in it
    was ever written: every resident page a file page and none swapped (``/proc/self/pagemap``; a private mapping's
    written pages are anonymous copies, which ``MADV_DONTNEED`` would discard). Program code and writable shared
    mappings are never touched."""
    import ctypes
    import mmap
    import os

    wanted: dict[int, set[object]] = {}  # inode -> the file's device and its real path
    for name in files:
        try:
            st = os.stat(name)
        except OSError:
            continue
        wanted.setdefault(st.st_ino, set()).update((st.st_dev, os.path.realpath(name)))
    if not wanted:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    spans: list[tuple[int, int, str]] = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 6 or "x" in parts[1] or (parts[1][3] == "s" and "w" in parts[1]):
                continue
            major, minor = (int(n, 16) for n in parts[3].split(":"))
            # the inode and the device, or the path where the maps' device is not stat's (btrfs, overlayfs)
            same = wanted.get(int(parts[4]), set())
            if os.makedev(major, minor) in same or " ".join(parts[5:]) in same:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                spans.append((lo, hi, parts[1]))
    if not spans:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    # the page-table entries are read into and worked on in anonymous mappings, never the heap: what this left in
    # the allocator's free lists would be counted as freed heap by the readings that follow
    most = max(hi - lo for lo, hi, _p in spans) // page * 8
    with mmap.mmap(-1, most) as raw, mmap.mmap(-1, most) as spare:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        try:
            for lo, hi, perms in spans:
                present, written = _file_pages(fd, lo // page, (hi - lo) // page, raw, spare)
                if present and not (perms[3] == "p" and written):
                    if libc.madvise(lo, hi - lo, MADV_DONTNEED) == 0:
                        dropped += present * page
        finally:
            os.close(fd)
    return dropped


def _file_pages(fd: int, first: int, n: int, raw: Any, spare: Any) -> tuple[int, bool]:
    """(the resident pages of the ``n`` pages from page number ``first``, whether one of them is no page of the
    mapped file or swapped out: a private copy made by a write), from ``pagemap`` (``fd``), worked on in place in
    the buffers ``raw`` and ``spare``."""
    import numpy as np

    if _preadv(fd, raw, 8 * n, first * 8) != 8 * n:
        return 0, True
    entries = np.frombuffer(raw, "<u8", n)
    bits = np.frombuffer(spare, "<u8", n)
    np.right_shift(entries, np.uint64(61), out=entries)  # bits 63 present, 62 swapped, 61 file page: 2, 1, 0
    swapped = bool(int(np.bitwise_or.reduce(entries)) & 2)
    np.right_shift(entries, np.uint64(2), out=bits)
    present = int(np.add.reduce(bits))
    np.invert(entries, out=entries)
    np.bitwise_and(bits, entries, out=bits)  # present, and not a page of the file
    return present, swapped or bool(int(np.bitwise_or.reduce(bits)) & 1)


def _preadv(fd: int, buffer: Any, size: int, offset: int) -> int:
    """``os.preadv`` of ``size`` bytes into the start of ``buffer`` (an mmap), the bytes read."""
    import os

    with memoryview(buffer) as whole, whole[:size] as view:
        return os.preadv(fd, [view], offset)


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
    # The wrapper's child dies with the wrapper (PR_SET_PDEATHSIG, set between fork and exec, then a check that the
    # wrapper did not die before it was set): a child that armed this itself after its start-up left a window in
    # which a converter killed with -9 orphaned it (seen on a loaded machine).
    wrapper = (
        "import ctypes, os, resource, signal, subprocess, sys, json\n"
        "me = os.getpid()\n"
        "def arm():\n"
        "    try:\n"
        "        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
        "    except (OSError, AttributeError):\n"
        "        return\n"
        "    if os.getppid() != me:\n"
        "        os._exit(137)\n"
        "r = subprocess.run(sys.argv[1:], capture_output=True, preexec_fn=arm)\n"
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


_Pool = dict[tuple[tuple[str, str], ...], "_Worker"]  # a worker per environment
_WORKERS: ContextVar[_Pool | None] = ContextVar("weightshare_workers", default=None)
_ANSWER = "\x1eweightshare-answer "  # marks the worker's answer lines: a runtime may print to stdout too

_SERVE = """
import gc, json, os, resource, sys
from importlib import import_module
from weightshare._platform import malloc_trim
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what the runtime prints goes with its errors, never into an answer
for line in sys.stdin:
    module, func, args, limit = json.loads(line)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    answer = json.dumps(getattr(import_module(module), func)(*args))
    gc.collect()  # what the call opened is closed before the next call measures anything
    malloc_trim()
    answers.write(sys.argv[1] + answer + "\\n")
    answers.flush()
"""


@dataclass
class _Worker:
    """One runtime child that answers calls one after another (``in_worker``)."""

    process: subprocess.Popen[str]
    stderr: Any  # a temporary file: what it printed, read when it fails
    calls: int = 0

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self.stderr.close()

    def failure(self) -> tuple[int, str]:
        """(its exit status, the tail of what it printed) once it stopped answering: killed when still alive."""
        if self.process.poll() is None:
            self.process.kill()
        code = self.process.wait()
        self.stderr.seek(0, 2)
        self.stderr.seek(max(0, self.stderr.tell() - 8192))
        return code, self.stderr.read().decode(errors="replace")


@contextmanager
def reused_children() -> Iterator[None]:
    """Within this block, ``in_worker`` calls reuse one runtime child per environment instead of starting one per
    call: a folder's models are measured one after another in one process (python, numpy and the runtime imported
    once). Nested blocks share the outermost one's children; every child is closed when it ends."""
    if _WORKERS.get() is not None:
        yield
        return
    workers: _Pool = {}
    token = _WORKERS.set(workers)
    try:
        yield
    finally:
        _WORKERS.reset(token)
        for w in workers.values():
            w.close()


def _start_worker(env: dict[str, str] | None, memory: ChildMemory) -> _Worker:
    import os
    import tempfile

    err = tempfile.TemporaryFile()
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE, _ANSWER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env={**os.environ, **env} if env else None,
        preexec_fn=memory.preexec(),
    )
    return _Worker(process, err)


def _answer(worker: _Worker, timeout: float | None) -> tuple[str | None, bool]:
    """(the worker's next answer line, or None when it died or ``timeout`` seconds passed (it is then killed);
    whether the time ran out)."""
    import selectors
    import time

    out = worker.process.stdout
    assert out is not None
    deadline = None if timeout is None else time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(out, selectors.EVENT_READ)
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                worker.process.kill()
                return None, True
            if not sel.select(left):
                continue
            line = out.readline()
            if not line:
                return None, False
            if line.startswith(_ANSWER):
                return line[len(_ANSWER) :], False


def in_worker(
    module: str,
    func: str,
    args: list[object],
    env: dict[str, str] | None,
    timeout: float | None,
    memory: ChildMemory,
    again_fresh: Callable[[Any], bool] = lambda answer: False,
) -> Any:
    """``in_child`` (the same arguments, answer and errors), answered by the runtime child of ``reused_children``
    for ``env`` when such a block is open: started at its first call, each call under its own ``memory`` bound
    (``RLIMIT_DATA`` set again before the call). A call that runs into the bound in a child that answered earlier
    calls, or whose answer ``again_fresh`` says so of (a runtime's own out-of-memory answer), is made once more in
    a fresh child: what earlier calls left behind never costs a model its measurement."""
    import json

    workers = _WORKERS.get()
    if workers is None:
        return in_child(module, func, args, env, timeout, memory)
    key = tuple(sorted((env or {}).items()))
    worker = workers.get(key)
    if worker is None:
        worker = workers[key] = _start_worker(env, memory)
    used = worker.calls > 0
    worker.calls += 1
    stdin = worker.process.stdin
    line, late = None, False
    try:
        assert stdin is not None
        stdin.write(json.dumps([module, func, args, memory.limit]) + "\n")
        stdin.flush()
        line, late = _answer(worker, timeout)
    except OSError:  # it died before reading the call
        pass
    if line is not None:
        answer = json.loads(line)
        if used and again_fresh(answer):
            del workers[key]
            worker.close()
            return in_worker(module, func, args, env, timeout, memory, again_fresh)
        return answer
    del workers[key]
    code, text = worker.failure()
    worker.close()
    if late and timeout is not None:
        raise RuntimeError(f"{module}.{func} did not finish within {timeout:.0f} s in a child process")
    if memory.ran_into(code, text):
        if used:
            return in_worker(module, func, args, env, timeout, memory, again_fresh)
        raise OverBound(memory.message("not measured"))
    tail = text.strip().splitlines()[-1:] or ["(no output)"]
    raise RuntimeError(f"{module}.{func} failed in a child process: {tail[0]}")


def in_child(
    module: str,
    func: str,
    args: list[object],
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    memory: ChildMemory | None = None,
) -> Any:
    """Call ``module.func(*args)`` in a fresh Python process and return its JSON result (as ``json.loads`` does).
    ``env``: variables set for the child on top of this process's environment (read at the child's start, such
    as glibc's ``MALLOC_MMAP_THRESHOLD_``); ``timeout``: seconds before the child is killed (a RuntimeError);
    ``memory``: its bound (``bound.py``; a child that runs into it raises ``OverBound``).

    Memory probes run in their own process so that nothing loaded before (another
    model, another runtime) is counted, and so that PSS is per process.
    """
    import json
    import os

    code = f"import json, sys; from {module} import {func}; print(json.dumps({func}(*json.loads(sys.argv[1]))))"
    try:
        res = subprocess.run(
            [sys.executable, "-c", code, json.dumps(args)],
            capture_output=True,
            text=True,
            env={**os.environ, **env} if env else None,
            timeout=timeout,
            preexec_fn=memory.preexec() if memory else None,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{module}.{func} did not finish within {timeout:.0f} s in a child process") from None
    if res.returncode != 0:
        if memory is not None and memory.ran_into(res.returncode, res.stderr):
            raise OverBound(memory.message("not measured"))
        tail = res.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{module}.{func} failed in a child process: {tail[0]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


_CALL = """
import pickle, sys
from importlib import import_module
with open(sys.argv[1], "rb") as f:
    module, func, args = pickle.load(f)
try:
    result = ("return", getattr(import_module(module), func)(*args))
except Exception as e:
    import traceback
    from weightshare.errors import WeightshareError
    if isinstance(e, WeightshareError):
        result = ("raise", (type(e), e.message, e.path))
    else:  # a bug: raised again in the parent as itself, this traceback attached
        try:
            pickle.loads(pickle.dumps(e))
            error = e
        except Exception:
            error = RuntimeError(f"{type(e).__name__}: {e}")
        result = ("bug", (error, traceback.format_exc()))
with open(sys.argv[2], "wb") as f:
    pickle.dump(result, f)
"""


def call_in_child(module: str, func: str, args: list[object], memory: ChildMemory, what: str) -> Any:
    """``module.func(*args)`` in a fresh Python process under ``memory``; its return value (pickled: arguments
    and result may be any picklable value, numpy arrays included). An exception it raises is raised here (a
    ``WeightshareError`` as itself; another, a bug, with the child's traceback as a note); running into the bound
    raises ``OverBound`` (``memory.message(what)``); a child that dies otherwise, ``RuntimeError`` with its last
    line of error output."""
    import os
    import pickle
    import tempfile

    with tempfile.TemporaryDirectory(prefix="weightshare-call-") as tmp:
        given, answer = os.path.join(tmp, "args"), os.path.join(tmp, "result")
        with open(given, "wb") as f:
            pickle.dump((module, func, args), f)
        res = subprocess.run(
            [sys.executable, "-c", _CALL, given, answer],
            capture_output=True,
            text=True,
            preexec_fn=memory.preexec(),
        )
        if res.returncode != 0 or not os.path.exists(answer):
            if memory.ran_into(res.returncode, res.stderr):
                raise OverBound(memory.message(what))
            tail = res.stderr.strip().splitlines()[-1:] or [f"exit status {res.returncode}"]
            raise RuntimeError(f"{module}.{func} failed in a child process: {tail[0]}")
        with open(answer, "rb") as f:
            kind, value = pickle.load(f)  # noqa: S301 -- written by the child this call started, in its own directory
    if kind == "raise":
        cls, message, path = value
        raise cls(message, path)
    if kind == "bug":
        error, trace = value
        error.add_note(f"raised in a child process ({module}.{func}):\n{trace}")
        raise error
    return value


def verify_bounded(
    module: str, func: str, report: Any, original: Any, converted: Any, opts: Any, broken: bool, largest: int
) -> None:
    """A format's runtime half of ``verify`` (``module.func(report, original, converted, opts, broken)``, which
    fills ``report``) in a child under the memory bound of the larger of the two models (``largest``: its mapped
    bytes, ``bound.py``); the report comes back filled. Over the bound: a ``UsageError``, one line naming the
    option that raises it."""
    from ..errors import UsageError
    from .bound import child_memory

    memory = child_memory(largest)
    try:
        args = [module, func, report, original, converted, opts, broken]
        done = call_in_child(__name__, "_verify_child", args, memory, "not verified")
    except OverBound as e:
        raise UsageError(str(e), converted) from None
    if isinstance(done, str):  # the runtime ran out of memory and said so in an error it reported
        raise UsageError(memory.message("not verified"), converted)
    report.__dict__.update(done.__dict__)


def _verify_child(module: str, func: str, report: Any, original: Any, converted: Any, opts: Any, broken: bool) -> Any:
    """In the child: the verify, and whether an error it turned into a line was the bound ("oom")."""
    from importlib import import_module

    from ..errors import WeightshareError
    from .bound import is_oom

    try:
        getattr(import_module(module), func)(report, original, converted, opts, broken)
    except WeightshareError as e:
        if is_oom(e.message):
            return "oom"
        raise
    if any(is_oom(line) for line in report.mismatches):
        return "oom"
    return report


def in_children(
    module: str,
    func: str,
    args: list[object],
    n: int,
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
    count_import: bool = False,
) -> list[int]:
    """What ``module.func(*args)`` (which opens what is measured and returns it, kept alive) costs in each of ``n``
    fresh Python processes, all alive at once: the ``paid_pss`` in bytes each reads once every one is ready (so
    pages they map in common are split among all ``n``, as they are for a user's ``n`` processes) less its figure
    before the call, when it had imported numpy and ``module`` but nothing of the runtime (what any Python process
    pays anyway; ``func`` imports what it opens with). ``count_import``: importing ``module`` counts too (a loader
    of weightshare's own: its user imports weightshare; a runtime's own loader: its user does not). A child that
    fails, or a barrier not reached within ``timeout`` seconds, is a RuntimeError."""
    import json
    import os
    import threading

    code = (
        "import json, sys\n"
        "import numpy\n"
        "from weightshare._runtimes.memory import paid_pss\n"
        "base = paid_pss()\n"
        f"from {module} import {func}\n"
        f"base = {'base' if count_import else 'paid_pss()'}\n"
        f"held = {func}(*json.loads(sys.argv[1]))\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "print(json.dumps(paid_pss() - base), flush=True)\n"
        "sys.stdin.readline()\n"
    )
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env} if env else None,
        )
        for _ in range(n)
    ]

    def kill_all() -> None:
        for c in children:
            c.kill()

    timer = threading.Timer(timeout, kill_all)
    timer.start()
    try:
        for c in children:  # the barrier: every process has opened its instance
            if c.stdout is None or c.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{module}.{func} failed in a child process: {_tail(c)}")
        for c in children:
            if c.stdin is not None:
                c.stdin.write("go\n")
                c.stdin.flush()
        figures = []
        for c in children:
            line = c.stdout.readline() if c.stdout is not None else ""
            if not line.strip():
                raise RuntimeError(f"{module}.{func} failed in a child process: {_tail(c)}")
            figures.append(int(json.loads(line)))
        return figures
    finally:
        timer.cancel()
        for c in children:
            if c.stdin is not None:
                c.stdin.close()
            try:
                c.wait(timeout=30)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
            for stream in (c.stdout, c.stderr):
                if stream is not None:
                    stream.close()


def _tail(child: subprocess.Popen[str]) -> str:
    child.kill()  # a child stuck past its failure: its stderr is read to the end
    child.wait()
    err = child.stderr.read() if child.stderr is not None else ""
    return (err.strip().splitlines()[-1:] or ["(no output)"])[0]
