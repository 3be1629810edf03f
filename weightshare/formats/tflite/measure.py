"""What one more LiteRT interpreter costs, measured: the PSS growth from 1 to 4 interpreters, per setting, in a child.

The static rules (``inventory.py``) say which buffers XNNPACK packs and which DEQUANTIZE/DENSIFY kernels
materialise; LiteRT itself is the authority on what a new interpreter copies (XNNPACK's packing of int8
weight-only and fp16 weights behind DEQUANTIZE included), so ``check`` and ``inspect`` ask it as they ask ONNX
Runtime (``formats/onnx/measure.py``): a fresh child per setting opens interpreters one by one, runs every
signature once (seeded random inputs, in range for index inputs), and reads its PSS after each. The growth is
that of the PSS of everything but program code (``_runtimes.memory.data_pss``), over 3. The child is bounded
(``TIMEOUT_S``) and started with ``MALLOC_MMAP_THRESHOLD_=1048576`` like the ONNX one. ``litert-compiled-cache``
is measured as ``weightshare.litert`` opens the model (``weightshare.litert.interpreter``: CompiledModel with the
XNNPACK weight cache ``convert --prepack`` wrote beside it; ``bench``'s ``--prepack`` variant) when that cache
matches the model; without one (or when LiteRT refuses it) its figure stays the static one and a note says why.

Weights, not activations: an interpreter keeps its tensor arena (inputs, intermediate tensors, kernel scratch)
and, with XNNPACK, the delegate's own workspace and indirection buffers, all sized by the inputs. The arena is
measured in the child: the resident pages under every tensor that is not in the model file (``arena_bytes``),
taken off the growth. XNNPACK's workspace has no tensors to point at; what the delegate keeps of the weights is
what it packs, which XNNPACK itself measures when it writes a weight cache (the matching cache beside a
``--prepack`` output, else one built in a temporary folder): under ``litert-xnnpack`` the weight figure is at most
that packed size plus the no-delegate setting's weight copies (DEQUANTIZE outputs it keeps), and the rest of the
growth is activation memory, reported as its own figure. CompiledModel shows no tensor to read pages under: under
``litert-compiled-cache`` an instance's own buffers (``instance_buffers``, its input and output copies included),
an upper bound of its arena, are taken off instead.

What a user pays (``paid``): for a model measured through the helper, what the model and its runtime add to whole
processes (``_runtimes.memory.in_children``), through the helper and under LiteRT's default Interpreter, with 1
and 4 instances in one process and in 2 processes alive at once; ``check`` turns it into its
``costs-more-than-original`` finding (``weightshare._paid``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..._findings import Finding
from ..._inventory import MeasureInputs
from ...errors import UsageError, WeightshareError
from ...report import JsonDict
from ..onnx.measure import ENV_SKIP, MALLOC_ENV, SESSIONS

SETTINGS = (("litert-builtin", True), ("litert-xnnpack", False))  # (setting id, without default delegates)
LOADERS = ("interpreter", "helper")  # the classic Interpreter (share: no default delegates), weightshare.litert
# The children that open a model through weightshare.litert (the helper; ``hold`` for both loaders): above the
# loaders and this folder, so started by module name, never imported from here.
LOADER_PROBES = "weightshare._loader_probes"
TIMEOUT_S = 600.0


def _run_signatures(
    model_path: str,
    interp: Any,
    bounds: dict[str, dict[str, int | None]],
    given: dict[str, Any] | None = None,
    dims: dict[str, int] | None = None,
) -> bool:
    """Run every signature of ``interp`` once (seeded random inputs, index inputs in range); False when the inputs
    cannot be made up or LiteRT refuses them. The signature runners are dropped before returning: each holds the
    interpreter, and LiteRT refuses ``allocate_tensors`` ("at least 1 reference to internal data") while one
    lives."""
    from ..._runtimes.litert import entry_points

    entries = entry_points(interp, bounds)
    try:
        for _key, entry in entries:
            entry(entry.feeds(0, given or {}, None, dims or {}))
    except Exception:  # noqa: BLE001 -- inputs it cannot make up: the interpreter is measured unrun
        return False
    finally:
        del entries
    return True


def _allocate_signatures(interp: Any) -> None:
    """Allocate every signature's subgraph (XNNPACK packs a subgraph's weights when it is allocated, once per
    signature); the primary subgraph alone for a model without SignatureDefs."""
    keys = list(interp.get_signature_list())
    if not keys:
        interp.allocate_tensors()
        return
    for key in keys:
        runner = interp.get_signature_runner(key)
        runner._interpreter_wrapper.AllocateTensors(runner._subgraph_index)  # what the runner does before a run
        del runner


def read_given(input_files: dict[str, str] | None) -> JsonDict:
    """``--input NAME=FILE`` (SIGNATURE:NAME=FILE for one signature), read in a probe as verify reads it:
    {"given": name -> array}, or {"usage": why not} (the parent raises it as a usage error)."""
    from ..._verify import read_input

    try:
        return {"given": {name: read_input(name, file, {}) for name, file in (input_files or {}).items()}}
    except UsageError as e:
        return {"usage": e.message}


def probe(
    model_path: str,
    share: bool,
    interpreters: int = SESSIONS,
    bounds: dict[str, dict[str, int | None]] | None = None,
    dims: dict[str, int] | None = None,
    input_files: dict[str, str] | None = None,
    loader: str = "interpreter",
) -> JsonDict:
    """In this (child) process: PSS after each of ``interpreters`` interpreters under the setting, or why LiteRT
    refused the model; ``buffers``: one interpreter's own buffers (``instance_buffers``: activations, inputs and
    outputs, KV cache), which are not weight copies. ``loader``: "interpreter" only; the helper's probe, through
    ``weightshare.litert``, is ``LOADER_PROBES``'s (``_loader_probes.probe``)."""
    from ..._runtimes.litert import native_stderr_silenced, new_interpreter
    from ..._runtimes.memory import data_pss, smaps_rollup
    from .signatures import instance_buffers

    if loader != LOADERS[0]:
        raise ValueError(f"loader {loader!r}: probed by {LOADER_PROBES}")
    read = read_given(input_files)
    if "usage" in read:
        return read
    given: dict[str, Any] = read["given"]
    opened: list[Any] = []
    pss: list[int] = []
    data: list[int] = []
    arena: list[int] = []
    derived = weight_derived(model_path)  # before the first interpreter: not part of the growth
    ran = True
    buffers = 0
    with native_stderr_silenced():
        for _ in range(interpreters):
            try:
                interp = new_interpreter(model_path, share, allocate=False)
            except Exception as e:  # noqa: BLE001 -- any refusal is the answer
                return {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
            if ran:
                ran = _run_signatures(model_path, interp, bounds or {}, given, dims)
            if not ran:
                try:
                    _allocate_signatures(interp)
                except Exception as e:  # noqa: BLE001
                    return {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
            opened.append(interp)
            pss.append(smaps_rollup()["Pss"])
            data.append(data_pss())
            arena.append(arena_bytes(interp, derived))
        try:  # after the measurements: reading the graph leaves Python's own memory behind
            buffers = instance_buffers(model_path, opened[0])
        except Exception:  # noqa: BLE001 -- a figure beside the measurement, never a reason to drop it
            buffers = 0
    return {"pss": pss, "data_pss": data, "ran": ran, "buffers": buffers, "arena": arena}


PAID_COUNTS = ((1, 1), (1, SESSIONS), (2, 1))  # (processes, instances in each) measured for ``paid``


def paid(
    path: Path,
    bounds: dict[str, dict[str, int | None]],
    given: MeasureInputs,
    measured: dict[str, int],
    notes: list[str],
) -> JsonDict:
    """What a user pays for a ``--prepack`` output opened as ``weightshare.litert`` opens it ("converted": the
    helper, its CompiledModel and the cache) against the same weights under LiteRT's default Interpreter
    ("original": XNNPACK packing a private copy per interpreter): the PSS the model and its loader add to
    fresh processes (``in_children``) with 1 and 4 instances in one process, and of two processes with one instance
    each, alive at once. {} when either setting was not measured (no matching cache, LiteRT refused it)."""
    from ..._runtimes.memory import in_children

    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, given.dims, given.input_files)
    if key in _PAID:  # check measures again near its gate: these figures do not decide it, once is enough
        return _PAID[key]
    roles = (("converted", COMPILED_CACHE, True, "helper"), ("original", SETTINGS[1][0], False, "interpreter"))
    if any(setting not in measured for _role, setting, _share, _loader in roles):
        return {}
    out: JsonDict = {}
    for role, setting, share, loader in roles:
        figures: JsonDict = {"setting": setting, "one_process": {}}
        for processes, instances in PAID_COUNTS:
            args: list[object] = [str(path), share, loader, bounds, dict(given.dims), dict(given.input_files)]
            try:
                pss = in_children(
                    LOADER_PROBES, "hold", [*args, instances], processes, MALLOC_ENV, TIMEOUT_S, loader == "helper"
                )
            except RuntimeError as e:
                notes.append(f"what a user pays is not measured ({setting}: {e})")
                return {}
            if processes == 1:
                figures["one_process"][str(instances)] = pss[0]
            else:
                figures["two_processes"] = sum(pss)
        out[role] = figures
    _PAID[key] = out
    return out


_PAID: dict[tuple[object, ...], JsonDict] = {}


def buffers_note(setting: str, res: JsonDict, taken_off: bool = False) -> str | None:
    """The measured figure of ``setting`` includes each interpreter's own buffers: say how much they are
    (``taken_off``: they were taken off the weight figure as the bound of an arena the probe cannot read)."""
    buffers = int(res.get("buffers", 0) or 0)
    if buffers < (1 << 20) // 16:
        return None
    what = "(activations, inputs and outputs, KV cache: every non-constant tensor of its signatures)"
    if taken_off:
        return (
            f"{setting}: its {buffers / (1 << 20):.1f} MiB of own buffers {what} are taken off the growth as "
            "activation memory (CompiledModel shows no tensor whose pages could be read)"
        )
    return (
        f"{setting}: of what one more interpreter costs, up to {buffers / (1 << 20):.1f} MiB are its own buffers "
        f"{what}, not weight copies"
    )


def weight_derived(model_path: str) -> set[int]:
    """Tensors of the first subgraph computed from constants alone (a DEQUANTIZE of a weight, chains of them):
    a runtime keeps them per interpreter like a copy of the weights, so they are not activations."""
    from . import flatbuf

    with flatbuf.open_model(model_path) as (reader, mapping):
        flatbuf.check_header(reader)
        graph = flatbuf.read_graph(reader, mapping)
    if not graph.subgraphs:
        return set()
    sub = graph.subgraphs[0]
    ops = sub.operators or []
    produced = {int(t) for op in ops for t in (op.outputs if op.outputs is not None else [])}
    inputs = {int(t) for t in (sub.inputs if sub.inputs is not None else [])}
    tensors = sub.tensors or []
    constant = {
        i
        for i, t in enumerate(tensors)
        if i not in produced and i not in inputs and not getattr(t, "isVariable", False)
    }
    derived: set[int] = set()
    for op in ops:  # in execution order: a chain of constant-only ops is found in one pass
        ins = [int(t) for t in (op.inputs if op.inputs is not None else []) if int(t) >= 0]
        if ins and all(t in constant or t in derived for t in ins):
            derived.update(int(t) for t in (op.outputs if op.outputs is not None else []))
    return derived


def arena_bytes(interp: Any, skip: set[int] | None = None) -> int:
    """Resident bytes under the tensors of ``interp`` that are not in the model file, nor computed from the weights
    alone (``skip``): its arena (activations)."""
    from ..._runtimes.memory import resident_bytes

    spans = []
    for d in interp.get_tensor_details():
        if skip and d["index"] in skip:
            continue
        try:
            a = interp.tensor(d["index"])()
        except Exception:  # noqa: BLE001 -- a tensor without data (not allocated, delegated away) has no pages
            continue
        # a 0-d tensor comes back as a numpy scalar (a copy, no address): its few bytes share a page with the
        # arena's other tensors, whose spans count that page
        if isinstance(a, np.ndarray) and a.nbytes:
            spans.append((a.ctypes.data, a.ctypes.data + a.nbytes))
    return resident_bytes(spans)


def packed_bytes(path: Path) -> int | None:
    """Bytes XNNPACK packs of the model's weights, as measured by XNNPACK writing its weight cache: the matching
    cache beside a ``--prepack`` output, else one built in a temporary folder; None when it cannot be built."""
    import tempfile

    from ..._runtimes.bound import child_memory
    from ...errors import WeightshareError
    from . import xnnpack_cache
    from .verify import mapped

    for st in xnnpack_cache.cache_status(path):
        if st.matches:
            return st.path.stat().st_size
    with tempfile.TemporaryDirectory(prefix="weightshare-packed-") as tmp:
        cache = Path(tmp) / "cache"
        cache.touch()
        try:
            return xnnpack_cache.build(path, cache, child_memory(mapped(path))).nbytes
        except WeightshareError as e:
            return 0 if "wrote no XNNPACK weight cache" in e.message else None


def available() -> bool:
    return importlib.util.find_spec("ai_edge_litert") is not None and os.environ.get(ENV_SKIP, "") != "1"


def measure_copies(
    path: Path, feeds: MeasureInputs | None = None
) -> tuple[dict[str, int], dict[str, int], list[str], dict[str, int], list[Finding], JsonDict]:
    """(setting id -> bytes of weights and copies of them one more interpreter keeps, setting id -> PSS of the child
    with one interpreter, notes, setting id -> activation memory one more interpreter keeps, findings of the model
    itself (none yet: a model LiteRT refuses is a note), what a user pays in PSS converted and original
    (``paid``)); ({}, {}, [why not], {}, [], {}) when ai-edge-litert is not installed or measuring is off."""
    if not available():
        return (
            {},
            {},
            ["per-interpreter copies are the static estimate: ai-edge-litert is not installed (or measuring is off)"],
            {},
            [],
            {},
        )
    from ..._runtimes.bound import OverBound, child_memory, is_oom
    from ..._runtimes.memory import in_child
    from .signatures import signature_bounds
    from .verify import mapped

    try:
        bounds = signature_bounds(str(path))  # here: the child's memory must not count the graph reader
    except WeightshareError:
        bounds = {}
    given = feeds or MeasureInputs()
    out: dict[str, int] = {}
    one: dict[str, int] = {}
    notes: list[str] = []
    activation: dict[str, int] = {}
    memory = child_memory(mapped(path))  # every child's bound (``_runtimes/bound.py``)
    for setting, share, loader in _settings(path, notes):
        try:
            res: JsonDict = in_child(
                LOADER_PROBES if loader == LOADERS[1] else __name__,
                "probe",
                [str(path), share, SESSIONS, bounds, dict(given.dims), dict(given.input_files), loader],
                MALLOC_ENV,
                timeout=TIMEOUT_S,
                memory=memory,
            )
        except OverBound as e:
            notes.append(f"{setting}: {e}" + _STATIC_KEPT)
            continue
        except RuntimeError as e:
            notes.append(f"could not measure {setting}: {e}{_STATIC_KEPT}")
            continue
        if "usage" in res:
            raise UsageError(str(res["usage"]))
        if "error" in res and is_oom(str(res["error"])):
            notes.append(f"{setting}: {memory.message('not measured')}" + _STATIC_KEPT)
            continue
        if "error" in res:
            notes.append(f"LiteRT refuses the model under {setting}: {res['error']}{_STATIC_KEPT}")
            continue
        data = res["data_pss"]
        growth = max(0, (data[-1] - data[0]) // (len(data) - 1))
        arena = sorted(res["arena"])[len(res["arena"]) // 2]  # each interpreter's own arena
        if loader == "helper":  # CompiledModel shows no tensors: its own buffers, an upper bound of its arena
            arena = int(res.get("buffers", 0) or 0)
        out[setting] = max(0, growth - arena)
        if (not share or loader == "helper") and out[setting] > 0:  # what XNNPACK keeps of the weights: at most
            # what it packs (all of it when the cache were not used; the rest is its workspace, activation memory)
            packed = packed_bytes(path)
            if packed is None:
                notes.append(f"{setting}: XNNPACK's packed size not measured; its workspace counts as weights")
            else:
                # the probe runs every signature, and the default delegate packs once per signature's subgraph
                signatures = max(1, len(bounds))
                out[setting] = min(out[setting], packed * signatures + out.get(SETTINGS[0][0], 0))
        activation[setting] = growth - out[setting]
        one[setting] = res["pss"][0]
        if not res["ran"]:
            notes.append(f"{setting}: interpreters measured without a run (inputs could not be generated)")
        note = buffers_note(setting, res, taken_off=loader == "helper")
        if note:
            notes.append(note)
    return out, one, notes, activation, [], paid(path, bounds, given, out, notes)  # no findings of its own


COMPILED_CACHE = "litert-compiled-cache"  # inventory.XNNPACK_CACHE
_STATIC_KEPT = "; its figure is the static estimate"  # every setting not measured keeps the rules' figure


def _settings(path: Path, notes: list[str]) -> list[tuple[str, bool, str]]:
    """(setting, without default delegates, loader) to measure: both classic Interpreter settings, and
    ``litert-compiled-cache`` through ``weightshare.litert.interpreter`` when the model has the XNNPACK weight
    cache that helper would use (else a note: that setting keeps its static figure)."""
    from .xnnpack_cache import find_cache

    settings = [(setting, share, "interpreter") for setting, share in SETTINGS]
    cache, why = find_cache(path)  # hashes the model only when a cache file is beside it
    if cache is None:
        notes.append(f"{COMPILED_CACHE} is not measured: {why}{_STATIC_KEPT}")
        return settings
    return [*settings, (COMPILED_CACHE, True, "helper")]


def measurement_key(path: Path) -> tuple[dict[str, str], list[Path]] | None:
    """(ai-edge-litert's version and the CPU kind XNNPACK dispatches on, the XNNPACK weight caches beside the
    model, which ``litert-compiled-cache`` is measured with), or None when nothing would be measured."""
    from ..onnx.measure import runtime_facts
    from .xnnpack_cache import candidate_caches

    facts = runtime_facts("ai-edge-litert") if available() else {}
    if not facts:
        return None
    return facts, candidate_caches(path)


def measure_interpreters(
    model_path: str,
    counts: list[int],
    share: bool = True,
    inputs: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    loader: str = LOADERS[0],
) -> list[JsonDict]:
    """Memory of 1..N interpreters of ``model_path`` in a fresh process (``inputs``: name -> .npy file; ``env``:
    variables added to the child's environment; ``loader``: one of ``LOADERS``): ``bench``'s rows."""
    from ..._runtimes.memory import in_child
    from ...errors import Unsupported
    from .signatures import signature_bounds

    try:
        rows: list[JsonDict] = in_child(
            LOADER_PROBES,
            "bench_probe",
            [model_path, sorted(counts), share, inputs or {}, loader, signature_bounds(model_path)],
            env,
        )
    except RuntimeError as e:  # LiteRT refused the model or the inputs in the probe: the user's to fix, one line
        detail = str(e).split("failed in a child process: ", 1)[-1]
        raise Unsupported(
            f"LiteRT could not run the model: {detail} (give real inputs with --input NAME=FILE.npy)", model_path
        ) from None
    return rows


def measure_shared(
    model_path: str,
    counts: list[int],
    share: bool = True,
    inputs: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
) -> list[JsonDict]:
    """``measure_interpreters`` through ``weightshare.litert.interpreter`` (``bench``'s ``--prepack`` variant)."""
    return measure_interpreters(model_path, counts, share, inputs, env, loader=LOADERS[1])
