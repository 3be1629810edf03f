"""What ONNX Runtime copies per session, measured: the PSS an extra session costs, per setting, in a child.

Static rules cannot keep up with ORT: MatMulNBits, DynamicQuantizeMatMul, the QDQ kernels fused at
ORT_ENABLE_ALL, Attention and every kernel inside an ``If`` branch pre-pack their weights per session, and the
transformers optimizer's fp16 graphs cast per session (measured +44 to +344 MiB per session on forms
the rules said cost nothing). ORT itself is the one authority on what it copies, so ``check`` and ``inspect``
ask it: a child process opens sessions one by one under each setting in turn, runs each once (seeded random
inputs, when the signature allows) so that mapped weights are paged in as in serving, and reads its PSS after the
first and the last. The sessions of one setting are closed (and the heap trimmed) before the next setting's open;
within ``check`` one child measures a folder's models one after another (``_runtimes.memory.in_worker``: python,
numpy and onnxruntime imported once, not once per setting and model, which was two thirds of a cold `check`), its
memory bound set for each model as a fresh child's would be, and a model over it there measured again in a fresh
child. Its sessions do not spin waiting for work after a run (half of the CPU time a measuring child spent).

Weights, not activations: the sessions that measure weight copies run with ORT's CPU arena off
(``enable_cpu_mem_arena=False``), so the activations, kernel scratch and outputs of a run are freed after it and
what a session keeps is its weights and what it made of them (pre-packed, reordered, cast copies). The arena a
session keeps at default options (measured: 40 MiB per session for a YOLO-like detector with 0.3 MiB of weights)
is measured apart, in the same child at default options: one session more with the arena on, its growth
from the last session without it, less the weights' growth per session, is the session's activation
memory, reported as its own figure, never as a weight copy. What any session costs whatever its model (its
thread pool, per-session state: 0.1-0.4 MiB measured) is measured in the same child on a one-node model, once
per setting, and taken off.

The child starts with ``MALLOC_MMAP_THRESHOLD_=1048576`` (``MALLOC_ENV``), as serving processes that share
weights are told to (``weightshare.ort``): buffers of 1 MiB or more that ORT allocates and frees (the plain weight
a pre-pack replaced, validation copies, activations without the arena) are then mmapped and returned to the
kernel when freed, so what remains is what ORT keeps per session. Without it glibc's heap keeps some of them and
the figure depends on the sizes involved (measured, 4 MiB MatMulNBits int8: 0.5 MiB per session with it, 2.9 MiB
without; docs/ci.md). Smaller freed buffers (a run's outputs and activations, a load's graph rewrites) stay in the
heap's free lists whenever a live block sits above them, by chance of the allocation order: each figure is read
after ``malloc_trim`` hands those pages back (``_trim``), else a --prepack QDQ BERT's 9.0 MiB per session read
between 7 and 17 MiB from one run to the next, and a model returning 32 outputs of 0.5 MiB 1.4-5.0 MiB instead of
0.3 (how much was handed back is reported, ``freed``, never counted). The cost of one more session is the
growth from the first to the fourth session, over 3, of the PSS of everything but program code (``data_pss``:
code is not per session, and its PSS moves with other processes): form-agnostic, subgraphs included, and what a
PSS benchmark of what the sessions hold would show. A figure near ``check``'s
gate is measured again there (``_check.settle``), so that the verdict does not flip between runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._inventory import NOT_MEASURED_AGAIN, MeasureInputs
from ...report import JsonDict

if TYPE_CHECKING:
    from ..._findings import Finding
    from ..._runtimes.bound import ChildMemory

SESSIONS = 4  # growth from 1 to 4 sessions, over 3: the sharing criterion of a PSS benchmark (4 vs 1), less noisy
FOLD_CHECK_MAX = 64 << 20  # model files up to this size are parsed for fold_bound (a folding bomb is a small file)
CHILD_SESSIONS = 3 * SESSIONS  # a child's sessions of the model: arena off, arena on, and room for a slow load
SHARE, DEFAULT = "ort-disable-prepacking", "ort-default"
SETTINGS = ((SHARE, True), (DEFAULT, False))
ACTIVATION_SETTING = "ort-default"  # activations are measured at the runtime's defaults (the arena on)
ENV_SKIP = "WEIGHTSHARE_NO_MEASURE"  # set to 1: inspect/check use the static estimate only
TRACE_ENV = "WEIGHTSHARE_MEASURE_TRACE"  # a file: each measuring call appends one line (``_trace``)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576"}  # the measuring child's glibc setting (see above)
COPY_NAMED = 256 << 10  # weight bytes found copied per session from which ``ort-session-state`` names the tensors
# One more session's step from its first session to its second at least this large, and this share of one
# session's PSS (twice check's ratio line, 0.1 / 3 of it), is measured by those 2 sessions, not 4: a copy as large as
# the model (an fp32 MatMul model's portable twin, B pre-packed per session) held 7 times took a 456 MiB model's
# measuring child to 3.3 GiB; held twice, it stays within 2 x the model + the floor (``_runtimes/bound.py``).
LARGE_STEP = 16 << 20
LARGE_SHARE = 1 / 16
# A model that maps this much has its sessions but the first closed before the arena's open (``probe``'s ``rotate``):
# each session maps the weights again and RSS counts every mapping (7 sessions of a 381 MiB T5 decoder: 1.5 GiB);
# and the pages of those read are dropped before the next opens (``_drop_read``: 4 sessions of a 913 MiB --prepack
# MatMul+Conv output held 2.0 GiB of RSS, one copy of PSS)
ROTATE_FROM = 64 << 20


def _one_node_model() -> bytes:
    """A model of one Identity node: what a session costs whatever its model (thread pool, session state)."""
    from ._proto import pb

    m = pb.ModelProto(ir_version=8, producer_name="weightshare")
    m.opset_import.add(domain="", version=13)
    g = m.graph
    g.name = "overhead"
    g.node.add(op_type="Identity", input=["x"], output=["y"])
    for vi, name in ((g.input.add(), "x"), (g.output.add(), "y")):
        vi.name = name
        vi.type.tensor_type.elem_type = 1
        vi.type.tensor_type.shape.dim.add(dim_value=1)
    return bytes(m.SerializeToString())


def _growth(data: list[int], sessions: int) -> int:
    """What one more session costs: the growth from the first of ``sessions`` to the last (``data``: the figures
    read after each of the two), over the sessions between."""
    return max(0, (data[-1] - data[0]) // (sessions - 1))


def probe(
    model_path: str,
    share: bool,
    sessions: int = SESSIONS,
    arena: bool = False,
    activations: bool = False,
    dims: dict[str, int] | None = None,
    input_files: dict[str, str] | None = None,
    explain: bool = False,
    rotate: bool = False,
    listed: JsonDict | None = None,
    drop: bool | None = None,
) -> JsonDict:
    """In this (child) process: PSS after the first and the last of ``sessions`` sessions under the setting (with
    ORT's CPU arena or not), and ``overhead``, what one more session of a one-node model costs; or why ORT refused. With
    ``activations``, then one more with the arena on: ``arena_growth``, what it keeps.
    The run's inputs are made as verify makes them (``decode.session_feeds``: ``dims``, the configs beside the
    model), those in ``input_files`` read from their files (``--input``); ``usage`` is a --dim/--input error,
    ``no_run`` why the sessions were not run (``measure_copies`` then reports no figure: the static rules judge).
    A run that fails stops the runs of the sessions after it, so that their growth is that of unrun sessions.
    With ``explain``, a growth of ``remainder.EXPLAIN_MIN`` or more is broken down (``breakdown``: per mapping kind,
    and what the added sessions' pages hold, ``remainder.explain``).
    With ``rotate`` (a model that maps ``ROTATE_FROM`` bytes or more: each session maps its weights again, and
    the process's RSS counts every mapping) the sessions but the first are closed before the arena's open: 4 open at
    once, not 7. The weights' sessions stay open together: what they cost together (a heap's fragments included) is
    the figure (one closed before the next opens could leave the heap it freed to the next, a figure too low). A
    step to the second session of ``_large_step`` decides the figure with those 2 sessions. ``listed``: the
    model's ``remainder.sources`` as the parent listed them (not listed again here while its files are those).
    ``drop`` (by default with ``rotate``): the pages of the weight files the sessions already read map are dropped
    from this process's page tables before the next session opens (``_drop_read``), so that RSS holds the weights
    once, not once per session open; every figure is read as without it."""
    from ..._platform import rss_bytes
    from ..._runtimes import remainder as pages
    from ..._runtimes.bound import is_oom
    from ..._runtimes.memory import data_pss, smaps_rollup
    from ..._runtimes.ort import new_session
    from ..._verify import read_input
    from ...errors import UsageError
    from ._proto import read_tensor_proto
    from .decode import session_feeds
    from .remainder import EXPLAIN_MAX, EXPLAIN_MIN, adopt, sources
    from .remainder import explain as explain_growth

    started = time.process_time()
    overhead = _overhead(share, arena)
    mapped = _weight_files(model_path) if (rotate if drop is None else drop) else []
    # what calls after this child's first left of data (freed, trimmed, but a heap keeps some) is not this model's;
    # what its first call left stays counted: the runtime's set-up a fresh child's first model session makes too
    # (11-14 MiB measured: a warm child's first session of a model costs that much less than a fresh child's)
    _trim()
    _CALLS.append(data_pss())
    left = _CALLS[-1] - _CALLS[1] if len(_CALLS) > 1 else 0
    files: list[str] = []
    if explain:
        try:  # the breakdown explains a figure; a model it cannot list is still measured (and ORT's refusal said)
            if listed:
                adopt(Path(model_path), listed)
            files = [f for f, _t in sources(Path(model_path))]
        except Exception:  # noqa: BLE001
            explain = False
    snapshots: list[JsonDict] = []
    opened: list[Any] = []
    most = 0
    pss: list[int] = []
    data: list[int] = []
    feeds: dict[str, Any] | None = None
    ran = True
    no_run = ""
    notes: list[str] = []
    try:
        given = {name: read_input(name, file, {".pb": read_tensor_proto}) for name, file in (input_files or {}).items()}
    except UsageError as e:
        return {"usage": e.message}
    steps: list[int] = []  # the growth from the first session to the second, then to the last
    freed: list[int] = []  # what the allocator's free lists held at each reading, handed back before it (``_trim``)
    for i in range(sessions):
        if i and mapped:  # the sessions read so far are run no more: their weights' pages need not stay in RSS
            _drop_read(mapped)
        try:
            s = new_session(model_path, share=share, log_level=4, arena=arena, spinning=False)
        except Exception as e:  # noqa: BLE001 -- any refusal is the answer
            text = " ".join(str(e).split())[:1000] or type(e).__name__
            return {"oom": text[:300]} if is_oom(text) else {"error": text}
        if feeds is None and ran:
            unknown = sorted(set(given) - {i.name for i in s.get_inputs()})
            if unknown:  # what the user gave does not fit the model: a usage error (exit 2), as in verify
                return {"usage": f"--input {unknown[0]}: {Path(model_path).name} has no input of that name"}
            try:
                feeds, notes = session_feeds(Path(model_path), s, dims or {}, given)
            except UsageError as e:
                if e.message.startswith("--dim"):
                    return {"usage": e.message}
                ran, no_run = False, e.message  # inputs it cannot make up: sessions are measured unrun
            except Exception as e:  # noqa: BLE001
                ran, no_run = False, (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        if feeds is not None:
            try:
                s.run(None, feeds)
            except Exception as e:  # noqa: BLE001
                if is_oom(str(e)):  # the memory bound, not the model: not measured
                    return {"oom": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
                feeds, ran = None, False
                no_run = "the run failed: " + (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        opened.append(s)
        most = max(most, len(opened))
        if i in (0, 1, sessions - 1):  # (a walk of smaps: 5-40 ms each; the resident counter: none)
            raw = rss_bytes("self")
            _trim()
            freed.append(max(0, raw - rss_bytes("self")))  # anonymous pages: trimmed ones leave RSS as they go
        if explain and len(opened) == 1:  # before the figures: what the snapshot holds is in the first one
            snapshots.append(pages.snapshot(files))
        if i == 0:
            pss.append(smaps_rollup()["Pss"] - left)  # as in a fresh child
            data.append(data_pss())
            before = data[0]
        elif i == 1 or i == sessions - 1:
            now = data_pss()
            steps.append(now - before)
            if i == 1 and _large_step(steps[0], pss[0]):
                # a copy this large is decided by one step (far from check's lines; a figure near one is measured
                # again there), and more sessions of it would hold more copies: 2 sessions, not 4
                sessions = 2
            if i == sessions - 1:
                break
    if steps:  # the first and the last (the step to the second read only to decide the above)
        pss.append(pss[0] + steps[-1])
        data.append(data[0] + steps[-1])
    # what readings without the trims would have added per session: free heap pages, held by no session
    more: JsonDict = {"freed": max(0, sum(freed[1:]) // (sessions - 1))} if len(freed) > 1 else {}
    if snapshots and ran and EXPLAIN_MIN <= _growth(data, sessions) <= EXPLAIN_MAX:
        snapshots.append(pages.snapshot(files))
        # the pages read now, before the arena's sessions: their runs fill what the weights' sessions freed since
        # with activations (a --prepack QDQ BERT: 1.3 MiB of ORT's state read back as zero and unclassified
        # pages); its own memory is handed back before the arena's figure (``_trim``), read as a difference
        try:
            more["breakdown"] = explain_growth(Path(model_path), snapshots[0], snapshots[1], sessions - 1)
        except Exception as e:  # noqa: BLE001 -- unexplained, the whole growth stays the weight figure
            notes.append(f"the per-session growth was not broken down: {type(e).__name__}: {e}"[:300])
        del snapshots[:]
    if activations and feeds is not None:
        # one more session with the arena on, run once: its growth from the last session without it (measured: the
        # first arena session of a child sets up nothing the others do not, its step within their spread; one
        # session, not ``sessions`` - 1: a cold check's arena sessions were a third of its sessions); with
        # ``rotate`` (or a large copy) from the first session alone, the others closed
        _drop_read(mapped)  # both readings of the arena's growth without the weights' pages (see below)
        if rotate or sessions == 2:
            s = None
            before = _close_after_first(opened)
        else:
            _trim()
            before = data_pss()
        try:
            s = new_session(model_path, share=share, log_level=4, arena=True, spinning=False)
            s.run(None, feeds)
        except Exception as e:  # noqa: BLE001
            if is_oom(str(e)):  # arenas of large activations, kept per session: over the bound
                return {"oom": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
            raise
        opened.append(s)
        most = max(most, len(opened))
        # the arena's session maps the pages the first session mapped (a page both map is counted once in PSS,
        # so without the drop the growth holds none of them): read without them, as they were before it opened
        _drop_read(mapped)
        _trim()
        more["arena_growth"] = max(0, data_pss() - before)
    if not ran:
        more["no_run"] = no_run
    _trace(model_path, share, len(opened), most, time.process_time() - started)
    return {
        "pss": pss,
        "data_pss": data,
        "sessions": sessions,
        "ran": ran,
        "overhead": overhead,
        "input_notes": notes,
        **more,
    }


# The sessions of a one-node model a measuring child opens once per setting, kept open while it lives, and what one
# more of them costs; the child's data PSS at the start of each call of ``probe``.
_TINY: dict[tuple[bool, bool], tuple[list[Any], int]] = {}
_CALLS: list[int] = []


def _overhead(share: bool, arena: bool) -> int:
    """What one more session of a one-node model costs under the setting: measured at the setting's first call in
    this child, first, so that what the first session of a process sets up is not the model's."""
    import numpy as np

    from ..._runtimes.memory import data_pss
    from ..._runtimes.ort import new_session

    if (share, arena) not in _TINY:
        tiny: list[Any] = []
        tiny_data: list[int] = []
        model = _one_node_model()
        for i in range(SESSIONS):
            t = new_session(model, share=share, log_level=4, arena=arena, spinning=False)
            t.run(None, {"x": np.zeros(1, np.float32)})
            tiny.append(t)
            if i in (0, SESSIONS - 1):
                _trim()
                tiny_data.append(data_pss())
        _TINY[share, arena] = (tiny, _growth(tiny_data, SESSIONS))
    return _TINY[share, arena][1]


def _large_step(step: int, one: int) -> bool:
    """Whether one more session's step ``step`` (data PSS) is a copy large enough to be measured by 2 sessions
    instead of 4: ``LARGE_STEP`` or more and at least ``LARGE_SHARE`` of one session's PSS ``one``."""
    return step >= LARGE_STEP and step >= LARGE_SHARE * one


def _weight_files(model_path: str) -> list[str]:
    """The files the model's sessions map its weights from: its external data files (none for a model whose weights
    are in its protobuf, which onnxruntime reads, not maps; nor for one too large to be read again here)."""
    from .ort.probe import external_locations

    path = Path(model_path)
    try:
        if path.stat().st_size > FOLD_CHECK_MAX:
            return []
        return [str(path.parent / loc) for loc in external_locations(path.read_bytes())]
    except Exception:  # noqa: BLE001 -- unread: nothing dropped, RSS as without it
        return []


def _drop_read(files: list[str]) -> None:
    """Drop the resident pages of this process's mappings of ``files`` (``memory.drop_file_pages``): each session
    maps the weights again and a process's RSS counts every mapping's pages (4 sessions of a 913 MiB MatMul+Conv
    ``--prepack`` output: 2.0 GiB of RSS, one copy of PSS). A session that is run again faults them back from the
    page cache. PSS counts a page once however many of the process's mappings hold it, so while every session of
    the model touches the same pages (one model, the same run) the figures (data PSS) read as without the drop; the
    arena's is read without the weights' pages in both its readings (``probe``)."""
    if files:
        from ..._runtimes.memory import drop_file_pages

        drop_file_pages(files)


def _close_after_first(opened: list[Any]) -> int:
    """Close every session of ``opened`` but the first (the caller holds no other reference) and give back what
    they held; the data PSS then, from which the next session's step is read."""
    from ..._runtimes.memory import data_pss

    del opened[1:]
    _collect()
    return data_pss()


def _trim() -> None:
    """Hand the allocator's free pages back (glibc's ``malloc_trim``, which also releases whole free pages inside
    the heap, not only at its top) before a figure is read. What glibc's free lists hold is no session's: an
    untrimmed reading counts whatever freed temporaries (a load's graph rewrites, a run's activations) happen to sit
    below a live block when it is read, which moved a --prepack QDQ BERT's figure between 7 and 17 MiB per session
    from one run of a child to the next (its sessions keep 9.0 MiB each, every run)."""
    from ..._platform import malloc_trim

    malloc_trim()


def _collect() -> None:
    """What closed sessions held given back before the next figure is read (as between two calls of ``probe``)."""
    import gc

    from ..._platform import malloc_trim

    gc.collect()
    malloc_trim()


def _trace(model_path: str, share: bool, sessions: int, most: int, cpu_s: float) -> None:
    """With ``TRACE_ENV`` set to a file: one line per call of ``probe`` (this child's pid, the model, the setting,
    the model sessions it left open, the most of them open at once, those still open from earlier calls, which
    must be none, and the CPU seconds it took): how many children and sessions `check` spends, counted without timing
    (tests/test_check_cost.py)."""
    import gc
    import json

    trace = os.environ.get(TRACE_ENV, "")
    if not trace:
        return
    import onnxruntime as ort

    # the sessions of earlier calls that are still alive: this call's are in ``opened`` (one per session opened)
    alive = sum(1 for o in gc.get_objects() if isinstance(o, ort.InferenceSession)) - sessions - SESSIONS * len(_TINY)
    line = {
        "pid": os.getpid(),
        "model": model_path,
        "share": share,
        "sessions": sessions,
        "most_alive": most,
        "earlier_alive": alive,
        "cpu_s": round(cpu_s, 3),
    }
    with open(trace, "a") as f:
        f.write(json.dumps(line) + "\n")


def available() -> bool:
    return importlib.util.find_spec("onnxruntime") is not None and os.environ.get(ENV_SKIP, "") != "1"


def _bounds(path: Path) -> tuple[float, int, str]:
    """(the measuring child's wall time limit in seconds, the bytes the runtime maps of the model (its memory bound's
    input, ``_runtimes/bound.py``), "" or why the model is not measured): the bounds of convert's ORT child
    (``ort.limits``, ``ort.fold_bound``) for a child that creates ``CHILD_SESSIONS`` sessions: a model whose constant
    folding would compute more than its size justifies is not given to ORT at all."""
    from ...errors import WeightshareError
    from ._proto import load_model
    from .ort.fold_bound import check_constant_folding
    from .ort.limits import limits_for
    from .ort.probe import external_locations

    size = path.stat().st_size
    if size > FOLD_CHECK_MAX:  # its weights embedded: size enough for the bounds, and no second copy in memory
        return limits_for(size, path).wall_s * CHILD_SESSIONS, size, ""
    data = path.read_bytes()
    try:
        files = {path.parent / loc for loc in external_locations(data) if "/" not in loc and "\\" not in loc}
        input_bytes = size + sum(f.stat().st_size for f in files if f.is_file())
        check_constant_folding(load_model(path), input_bytes, path)
    except WeightshareError as e:
        return 0.0, size, e.message
    except Exception:  # noqa: BLE001 -- unreadable here: the child says what onnxruntime makes of it
        input_bytes = size
    return limits_for(input_bytes, path).wall_s * CHILD_SESSIONS, input_bytes, ""


def _measure(
    path: Path,
    share: bool,
    arena: bool,
    activations: bool = False,
    feeds: MeasureInputs | None = None,
    timeout: float | None = None,
    memory: ChildMemory | None = None,
    rotate: bool = False,
) -> tuple[JsonDict, str]:
    """One child's answer (``cost``: bytes one more session keeps beyond a one-node model's, ``data_growth``: its
    whole growth), or ({"refused": why}, "") when onnxruntime refuses the model, or ({}, why not measured)."""
    from ..._runtimes.bound import OverBound, child_memory
    from ..._runtimes.memory import in_worker
    from ...errors import UsageError

    given = feeds or MeasureInputs()
    from .remainder import handed

    args = [str(path), share, SESSIONS, arena, activations, dict(given.dims), dict(given.input_files), not arena]
    args += [rotate, handed(path) if not arena else None]
    try:
        # one child measures every setting and, within check's ``reused_children``, every model in turn; a model
        # over the bound there is measured again in a fresh child (``in_worker``)
        res: JsonDict = in_worker(
            __name__, "probe", args, MALLOC_ENV, timeout, memory or child_memory(0), lambda a: "oom" in a
        )
    except OverBound as e:
        return {}, str(e)
    except RuntimeError as e:
        return {}, f"could not measure: {e}"
    if "usage" in res:
        raise UsageError(str(res["usage"]))
    if "oom" in res and memory is not None:
        return {}, memory.message("not measured")
    if "error" in res:
        return {"refused": str(res["error"])}, ""
    growth = _growth(res["data_pss"], res["sessions"])  # the growth without code's PSS, which other processes move
    # ORT's own state (pointer-dense pages: graph, kernels, maps; the one-node model's is its floor) is not a
    # weight copy: what it adds beyond that floor is reported apart (``ort-session-state``), never as weights
    state = res.get("breakdown", {}).get("pages", {}).get("runtime objects", 0)
    not_weights = max(res["overhead"], min(growth, state))
    return {**res, "data_growth": growth, "cost": max(0, growth - not_weights), "state": state}, ""


def measure_copies(
    path: Path, feeds: MeasureInputs | None = None, only: list[str] | None = None
) -> tuple[dict[str, int], dict[str, int], list[str], dict[str, int], list[Finding]]:
    """(setting id -> bytes of weights and their copies one more session keeps, setting id -> PSS of the child with
    one session (what `check` weighs the growth against), notes, setting id -> activation memory one more session
    keeps at default options (its CPU arena), findings: ``runtime-refuses-model`` when onnxruntime refuses to
    load the model); ({}, {}, [why not], {}, []) when ORT is not installed. Each child runs under the memory bound
    of ``_runtimes/bound.py``; one that runs into it leaves its setting "not measured" (a note naming the option
    that raises the bound), never a finding. ``only``: those settings, without their activation memory (check's
    repeats of a figure near a line: the other settings' figures and the activations are not repeated)."""
    from ..._runtimes.bound import child_memory
    from ..._runtimes.memory import reused_children

    if not available():
        return (
            {},
            {},
            ["per-session copies are the static estimate: onnxruntime is not installed (or measuring is off)"],
            {},
            [],
        )
    timeout, mapped, refused = _bounds(path)
    if refused:
        return {}, {}, [f"per-session copies are the static estimate: not given to onnxruntime: {refused}"], {}, []
    twin = _twin_packings(path) if only is None else None
    with reused_children():
        measured = _measure_settings(
            path, feeds, timeout, child_memory(mapped), [SHARE] if twin else only, mapped >= ROTATE_FROM
        )
    out, one, notes = measured[:3]
    if twin and SHARE in out:
        # what each session packs at default options is what this runtime saved of it at conversion, in the packed
        # model's blob: not packed again here (2 sessions of a 456 MiB MatMul+Conv twin held 2 GiB, and a
        # third of a cold check's CPU went to packing the twins)
        out[DEFAULT], one[DEFAULT] = twin[1], one[SHARE] + twin[1]
        notes.append(
            f"{DEFAULT}: {_mib(twin[1])} per session, {NOT_MEASURED_AGAIN}: onnxruntime's own packings of this "
            f"model, which {twin[0]} maps from its blob (saved by this onnxruntime on this CPU kind at conversion); "
            "every session of this portable model at default options makes them"
        )
    return measured


def _twin_packings(path: Path) -> tuple[str, int] | None:
    """(the packed model, the bytes of its packed copies) when ``path`` is the portable twin of a ``convert
    --prepack`` output whose blob holds that one model's packings, made by the onnxruntime installed here on this
    CPU kind: a session of the twin at default options packs exactly those (the same graph, the same runtime). Else
    None: measured."""
    from ..._recorded import blob_metadata
    from .inventory import _envelope
    from .ort.prepack_record import METADATA_KEY, parse_record
    from .ort.probe import external_locations, packed_bytes, packed_entries

    try:
        files = [f for f in external_locations(path.read_bytes()) if "/" not in f and "\\" not in f]
        for name in files:
            raw = blob_metadata(str(path.parent / name)).get(METADATA_KEY)
            if raw is None:
                continue
            record = parse_record(raw, name)
            if list(record["portable_models"].values()) != [path.name]:
                return None  # not a twin, or a blob holding other models' packings too
            packed = (path.parent / str(record["prepacked_model"])).read_bytes()
            made, here = _envelope(path, [name], packed_bytes(packed_entries(packed)))
            same = bool(here) and all(made.get(k) == here.get(k) for k in ("runtime", "version", "cpu_kind"))
            return (str(record["prepacked_model"]), int(made["packed_bytes"])) if same else None
    except Exception:  # noqa: BLE001 -- anything unread: measured, as any model
        return None
    return None


def _measure_settings(
    path: Path,
    feeds: MeasureInputs | None,
    timeout: float,
    memory: ChildMemory,
    only: list[str] | None = None,
    rotate: bool = False,
) -> tuple[dict[str, int], dict[str, int], list[str], dict[str, int], list[Finding]]:
    """``measure_copies`` once the model's bounds are known: each setting in turn, in one child."""
    from ..._findings import Code, Finding

    out: dict[str, int] = {}
    one: dict[str, int] = {}
    notes: list[str] = []
    activation: dict[str, int] = {}
    refusals: dict[str, list[str]] = {}  # why -> the settings under which onnxruntime refuses the model
    state: list[Finding] = []
    for setting, share in SETTINGS:
        if only is not None and setting not in only:
            continue
        activations = setting == ACTIVATION_SETTING and only is None
        res, why = _measure(path, share, False, activations, feeds, timeout, memory, rotate)
        if why:
            notes.append(f"{setting}: {why}")
            continue
        if "refused" in res:
            refusals.setdefault(res["refused"], []).append(setting)
            continue
        if not res["ran"]:
            # sessions that never ran hold what a load leaves (lazily paged weights, kernels not yet set up) and
            # their growth moves from one child to the next (a --prepack voice-activity model: 2.4-2.7 MiB, exit
            # 1, 1, 0 on three runs): no figure to judge by, the static rules decide
            why = res.get("no_run") or "inputs could not be generated"
            line = (
                f"not measured: check's generated inputs do not run the model ({why}); judged by the static rules "
                "(give real inputs with --input NAME=FILE.npy, or sizes with --dim NAME=VALUE, to measure it)"
            )
            notes += [] if line in notes else [line]
            continue
        out[setting] = res["cost"]
        one[setting] = res["pss"][0]
        if "breakdown" in res:
            state.append(_state_finding(path, setting, res))
        if "arena_growth" in res:  # the same sessions with the arena on: what it keeps beyond the weights
            activation[setting] = max(0, res["arena_growth"] - res["data_growth"])
        for line in res.get("input_notes", []):
            if line not in notes:
                notes.append(line)
    findings = [
        Finding.of(
            Code.RUNTIME_REFUSES_MODEL,
            str(path),
            f"onnxruntime {_ort_version()} (CPU) refuses to load the model under {', '.join(settings)}: {_reason(why)}",
        )
        for why, settings in refusals.items()
    ]
    return out, one, notes, activation, findings + state


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _state_finding(path: Path, setting: str, res: JsonDict) -> Finding:
    """``ort-session-state``: what one more session keeps beyond its weights, per mapping and per page content."""
    from ..._findings import Finding
    from .findings import OnnxCode

    b = res["breakdown"]
    kinds = ", ".join(f"{k} {'+' if n >= 0 else ''}{_mib(n)}" for k, n in b["pss"].items() if abs(n) >= 1 << 16)
    pages = b["pages"]
    # named when they weigh something: a few pages of small tensors match in every session (inline constants)
    shown = b["tensors"][:3] if pages["weights"] >= COPY_NAMED else []
    copied = ", ".join(f"{n} (read by {'/'.join(ops) or 'no node'})" for n, _k, ops in shown)
    return Finding.of(
        OnnxCode.ORT_SESSION_STATE,
        str(path),
        f"one more session under {setting} keeps {_mib(res['data_growth'])} (PSS, measured): "
        f"{_mib(pages['runtime objects'])} of it is ONNX Runtime's own state (graph, kernels, maps: pages dense "
        "with pointers, no weight bytes), not counted as a weight copy; per mapping: "
        f"{kinds or 'no kind above 0.1 MiB'}; the added sessions' pages: weights {_mib(pages['weights'])}"
        + (f" (largest: {copied})" if copied else "")
        + f", zero-filled {_mib(pages['zero'])}, unclassified {_mib(pages['unclassified'])}; counted as weights "
        f"and copies: {_mib(res['cost'])}"
        + (
            f"; not counted either: {_mib(res['freed'])} of freed heap the allocator kept resident (memory no "
            "session holds, handed back with malloc_trim before each reading)"
            if res.get("freed", 0) >= 1 << 17
            else ""
        ),
    )


# What onnxruntime wraps a load error in: its status prefix, "Load model from PATH failed:", a C++ source location
# with the function's signature. The reason follows.
_ORT_WRAPPING = re.compile(
    r"^\[ONNXRuntimeError\] : \d+ : \w+ : (?:Load model from .*? failed:)?(?:\s*/\S+:\d+ [^()]*\([^)]*\)(?: const)? )?"
)


def _reason(error: str) -> str:
    """onnxruntime's load error without its wrapping, at most 300 characters."""
    return _ORT_WRAPPING.sub("", error).strip()[:300] or error[:300]


def _ort_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("onnxruntime")
    except PackageNotFoundError:
        return "(version unknown)"


def runtime_facts(name: str) -> dict[str, str]:
    """``name``'s installed version and the CPU kind its kernels dispatch on ({} when it is not installed)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from .ort.probe import cpu_features, cpu_kind

    try:
        installed = version(name)
    except PackageNotFoundError:
        return {}
    return {"runtime": name, "version": installed, "cpu_kind": cpu_kind(cpu_features(), platform.machine())}


def measurement_key(path: Path) -> tuple[dict[str, str], list[Path]] | None:
    """(onnxruntime's version and CPU kind, the files beside the model the measuring run reads: the configs its
    inputs are sized from and the encoder whose output a decoder is fed, ``decode.session_feeds``), or None when
    nothing would be measured."""
    from .decode import ENCODER_FILE

    facts = runtime_facts("onnxruntime") if available() else {}
    if not facts:
        return None
    return facts, [path.parent / n for n in ("config.json", "genai_config.json", ENCODER_FILE)]
