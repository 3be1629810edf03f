"""LiteRT (TFLite): interpreters that share weights, and their inputs.

``BUILTIN_WITHOUT_DEFAULT_DELEGATES`` keeps the XNNPACK delegate from packing
weights into a private copy per interpreter.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from ..report import JsonDict

if TYPE_CHECKING:
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.interpreter import Interpreter


class TensorDetails(TypedDict, total=False):
    """One entry of LiteRT's ``get_input_details()`` / ``get_tensor_details()`` (the keys read here)."""

    name: str
    index: int
    shape: np.ndarray
    shape_signature: np.ndarray
    dtype: type[np.generic]


@contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """LiteRT's C++ logs ("INFO: Created TensorFlow Lite XNNPACK delegate", kernel errors) go straight to fd 2;
    a CI gate's stderr must hold only our one line. Errors still arrive as Python exceptions."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def silence_native_stderr_until_exit() -> None:
    """LiteRT's accelerator registry logs "DestroyAccelerator" from static destructors at process exit; once a
    command has written everything it has to say, fd 2 goes to /dev/null so a CI log holds nothing else."""
    sys.stderr.flush()
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 2)


# What LiteRT raises when a model does not load or a kernel fails (Interpreter: ValueError on load, RuntimeError
# on invoke; CompiledModel: RuntimeError). Anything else in a verify leg is a bug and is reported as one.
LITERT_ERRORS = (RuntimeError, ValueError)

# verify runs every path a user may run: the classic Interpreter without delegate and with the default
# XNNPACK delegate (which also provides custom ops such as Convolution2DTransposeBias).
MODES = ("no delegate", "XNNPACK")


def new_interpreter(model_path: str, share: bool = True, allocate: bool = True) -> Interpreter:
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    kwargs = {"experimental_op_resolver_type": OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES} if share else {}
    interp = Interpreter(model_path=model_path, **kwargs)
    if allocate:
        interp.allocate_tensors()
    return interp


def _random_array(
    rng: np.random.Generator, shape: list[int], dtype: np.typing.DTypeLike, bound: int | None = None
) -> np.ndarray:
    dtype = np.dtype(dtype)
    if bound is not None:
        return rng.integers(0, bound, shape).astype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), shape).astype(dtype)


# op -> (position of the index input, position of the indexed tensor)
_INDEXING = {"GATHER": (1, 0), "GATHER_ND": (1, 0), "EMBEDDING_LOOKUP": (0, 1)}
# ops whose output carries an index input's values on to a lookup: litert-torch reshapes token ids before its
# EMBEDDING_LOOKUP, and wraps positions as torch does for negative indices (SELECT(LESS(p, 0), ADD(p, n), p))
# before its GATHER_ND and scatter into the KV cache
_PASS_THROUGH = ("RESHAPE", "SQUEEZE", "EXPAND_DIMS", "CAST", "IDENTITY", "SELECT", "SELECT_V2", "ADD", "SUB")


def _subgraph_bounds(graph: Any, sg: Any) -> dict[int, int | None]:
    """Tensor index of a subgraph input whose values index a table -> exclusive bound (None: size unknown)."""
    from ai_edge_litert import schema_py_generated as schema

    from ..formats.tflite.graph import builtin_code, indices

    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    codes = [names.get(builtin_code(c), "") for c in graph.operatorCodes or []]
    tensors = sg.tensors or []
    carries = {i: i for i in indices(sg.inputs)}  # tensor -> the subgraph input whose values it holds
    bounds: dict[int, int | None] = {}
    for op in sg.operators or []:
        name = codes[op.opcodeIndex] if 0 <= op.opcodeIndex < len(codes) else ""
        ins, outs = indices(op.inputs), indices(op.outputs)
        carried = next((carries[i] for i in ins if i in carries), None)
        if name in _PASS_THROUGH and carried is not None:
            for o in outs:
                carries[o] = carried
            continue
        where = _INDEXING.get(name)
        if where is None or len(ins) <= max(where) or ins[where[0]] not in carries:
            continue
        table = tensors[ins[where[1]]] if 0 <= ins[where[1]] < len(tensors) else None
        shape = None if table is None else table.shapeSignature if table.shapeSignature is not None else table.shape
        dims = [] if shape is None else [int(d) for d in shape]
        if name == "GATHER":
            axis = int(getattr(op.builtinOptions, "axis", 0) or 0)
            dims = dims[axis:] if 0 <= axis < len(dims) else dims[axis:][:1] if -len(dims) <= axis < 0 else []
        if name == "GATHER_ND":  # the indices' last dim k addresses the table's first k dims
            index = tensors[ins[where[0]]] if 0 <= ins[where[0]] < len(tensors) else None
            k = int(index.shape[-1]) if index is not None and index.shape is not None and len(index.shape) else 0
            dims = dims[:k] if 0 < k <= len(dims) else dims
        size = (min(dims) if name == "GATHER_ND" else dims[0]) if dims else -1
        source = carries[ins[where[0]]]
        known = bounds.get(source)
        if size < 1:
            bounds.setdefault(source, None)
        else:
            bounds[source] = size if known is None else min(known, size)
    return bounds


def _text(value: bytes | str | None) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value or "")


def signature_bounds(model_path: str) -> dict[str, dict[str, int | None]]:
    """Signature key -> input name -> exclusive bound of the values it must take, for inputs used as indices
    (GATHER, GATHER_ND, EMBEDDING_LOOKUP, directly or through a reshape/cast), read from the model's graph: each
    signature runs its own subgraph, whose ops the Interpreter's ``_get_ops_details`` (primary subgraph only) does
    not list. Names are the signature's (``tokens``, not ``prefill_tokens:0``); the primary subgraph of a model
    without SignatureDefs is key "" with tensor names."""
    from ..formats.tflite.flatbuf import check_header, open_model, read_graph
    from ..formats.tflite.graph import tensor_name

    with open_model(model_path) as (reader, mapping):
        check_header(reader)
        graph = read_graph(reader, mapping)
    subgraphs = graph.subgraphs or []
    out: dict[str, dict[str, int | None]] = {}
    if not graph.signatureDefs:
        if subgraphs:
            sg = subgraphs[0]
            out[""] = {tensor_name(sg.tensors[i]): b for i, b in _subgraph_bounds(graph, sg).items()}
        return out
    for sd in graph.signatureDefs:
        key = _text(sd.signatureKey)
        if not 0 <= sd.subgraphIndex < len(subgraphs):
            continue
        by_tensor = _subgraph_bounds(graph, subgraphs[sd.subgraphIndex])
        names = {int(m.tensorIndex): _text(m.name) for m in sd.inputs or []}
        out[key] = {names[i]: b for i, b in by_tensor.items() if i in names}
    return out


def _shape(
    details: TensorDetails, shapes: dict[str, list[int]], dims: dict[str, int], name: str, plain: str = ""
) -> list[int]:
    """``--shape SIGNATURE:NAME=...`` (``name``), else ``--shape NAME=...`` (``plain``), else the declared shape
    with dynamic dims set by ``--dim '*=N'``."""
    for n in (name, plain):
        if n and n in shapes:
            return shapes[n]
    signature = details.get("shape_signature")
    sig = [int(x) for x in (signature if signature is not None and len(signature) else details["shape"])]
    return [d if d >= 0 else dims.get("*", 1) for d in sig]


def given_for(given: dict[str, np.ndarray] | None, key: str | None, name: str) -> np.ndarray | None:
    """The value given for input ``name`` of signature ``key``: ``--input SIGNATURE:NAME=FILE`` first (signatures
    of one LM take ``tokens`` as [1, 16] and [1, 1]), then ``--input NAME=FILE`` for every signature with it."""
    if not given:
        return None
    if key and f"{key}:{name}" in given:
        return given[f"{key}:{name}"]
    return given.get(name)


def unknown_given(entries: list[tuple[str, EntryPoint]], given: dict[str, Any]) -> list[str]:
    """The ``--input`` names no signature takes (``NAME`` or ``SIGNATURE:NAME``)."""
    known: set[str] = set()
    for key, entry in entries:
        for name in entry.input_details():
            known.add(name)
            if key:
                known.add(f"{key}:{name}")
    return [n for n in given if n not in known]


class EntryPoint:
    """One signature (or the primary subgraph): seeded random feeds in, outputs by name out.

    ``bounds``: the signature's index inputs -> exclusive bound (``signature_bounds``)."""

    def __init__(self, interp: Interpreter, key: str | None, bounds: dict[str, int | None] | None = None):
        self.interp, self.key = interp, key
        self.runner = interp.get_signature_runner(key) if key else None
        self.bounds = bounds or {}

    def input_details(self) -> dict[str, TensorDetails]:
        if self.runner:
            details: dict[str, TensorDetails] = self.runner.get_input_details()
            return details
        return {d["name"]: d for d in self.interp.get_input_details()}

    def output_details(self) -> dict[str, TensorDetails]:
        if self.runner:
            details: dict[str, TensorDetails] = self.runner.get_output_details()
            return details
        return {d["name"]: d for d in self.interp.get_output_details()}

    def feeds(
        self,
        seed: int,
        given: dict[str, np.ndarray] | None = None,
        shapes: dict[str, list[int]] | None = None,
        dims: dict[str, int] | None = None,
    ) -> dict[str, np.ndarray]:
        from ..errors import UsageError

        rng = np.random.default_rng(seed)
        feeds: dict[str, np.ndarray] = {}
        for name, d in self.input_details().items():
            value = given_for(given, self.key, name)
            if value is not None:
                feeds[name] = value
                continue
            if name in self.bounds and self.bounds[name] is None:
                where = f"{self.key}:{name}" if self.key else name
                raise UsageError(
                    f"input {where!r} indexes a tensor of unknown size, so random values would be "
                    f"out of range; give it with --input {where}=FILE.npy"
                )
            shape = _shape(d, shapes or {}, dims or {}, f"{self.key}:{name}" if self.key else name, name)
            feeds[name] = _random_array(rng, shape, d["dtype"], self.bounds.get(name))
        return feeds

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.runner:
            # np.array copies: the runner's outputs view its interpreter's tensors, which the next run overwrites
            return {k: np.array(v) for k, v in self.runner(**feeds).items()}
        return _run_primary(self.interp, feeds)


def entry_points(
    interp: Interpreter, model_path: str | None = None, bounds: dict[str, dict[str, int | None]] | None = None
) -> list[tuple[str, EntryPoint]]:
    """Every signature of ``interp`` (or its primary subgraph, key ""); ``model_path``: the model it opened, read
    for the inputs used as indices (without it, random index values may be out of range); ``bounds``: those
    already read (``signature_bounds``: a measuring child gets them from its parent, so that the schema module
    the graph reader imports is not counted in its memory)."""
    if bounds is None:
        bounds = signature_bounds(model_path) if model_path else {}
    keys = list(interp.get_signature_list())
    if not keys:
        return [("", EntryPoint(interp, None, bounds.get("")))]
    return [(k, EntryPoint(interp, k, bounds.get(k))) for k in keys]


def open_mode(model_path: str, mode: str) -> Interpreter:
    """A classic Interpreter in one of ``MODES``."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    resolver = OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES if mode == MODES[0] else OpResolverType.AUTO
    # Not allocated here: a signature runner resizes the inputs to the feeds, then allocates.
    return Interpreter(model_path=model_path, experimental_op_resolver_type=resolver)


class CompiledEntry:
    """One signature run through LiteRT's CompiledModel (the only loader of ExternalBuffer groups)."""

    def __init__(self, model: CompiledModel, key: str, feeds: Callable[..., dict[str, np.ndarray]]):
        self.model, self.key = model, key
        self.feeds = feeds  # CompiledModel has no shape signatures or op list: the Interpreter's view makes inputs
        self.index = model.get_signature_index(key) if key else 0
        self.signature = model.get_signature_by_index(self.index)

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        key = self.signature.get("key", self.key)
        declared = self.model.get_input_tensor_details(key)
        for name in self.signature["inputs"]:
            if [int(x) for x in declared[name]["shape"]] != list(feeds[name].shape):
                self.model.resize_input_tensor_by_name(key, name, list(feeds[name].shape))
        ins, outs = self.model.create_input_buffers(self.index), self.model.create_output_buffers(self.index)
        for name, buf in zip(self.signature["inputs"], ins):
            buf.write(np.ascontiguousarray(feeds[name]))
        self.model.run_by_index(self.index, ins, outs)
        details = self.model.get_output_tensor_details(key)
        return {
            name: np.array(buf.read(int(np.prod(details[name]["shape"])), details[name]["dtype"])).reshape(
                [int(x) for x in details[name]["shape"]]
            )
            for name, buf in zip(self.signature["outputs"], outs)
        }


PLACEHOLDER_SIGNATURE = "<placeholder signature>"  # CompiledModel's key for a model without SignatureDefs


def compiled_entry_points(
    model_path: str, inputs_from: str, cache_path: str | None = None
) -> list[tuple[str, CompiledEntry]]:
    """Every signature of ``model_path`` through CompiledModel; inputs made from ``inputs_from``'s Interpreter.

    ``cache_path``: an XNNPACK weight cache for the CPU options. A model without SignatureDefs has one
    placeholder signature in CompiledModel and none in the Interpreter: both are the primary subgraph, "".
    """
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.cpu_options import CpuOptions
    from ai_edge_litert.options import Options

    feeders = dict(entry_points(open_mode(inputs_from, MODES[0]), inputs_from))
    if cache_path is None:
        model = CompiledModel.from_file(model_path)
    else:
        options = Options(cpu_options=CpuOptions(num_threads=1, xnnpack_weight_cache_path=cache_path))
        model = CompiledModel.from_file(model_path, options=options)
    keys = list(model.get_signature_list()) or [""]
    entries = []
    for k in keys:
        key = "" if k == PLACEHOLDER_SIGNATURE and "" in feeders else k
        if key not in feeders:
            raise ValueError(f"signature {k!r} of {model_path} is not one of the original's {sorted(feeders)}")
        entries.append((key, CompiledEntry(model, k if key else "", feeders[key].feeds)))
    return entries


def run(interp: Interpreter, feeds: dict[int, np.ndarray]) -> list[np.ndarray]:
    for index, value in feeds.items():
        interp.set_tensor(index, value)
    interp.invoke()
    return [interp.get_tensor(d["index"]).copy() for d in interp.get_output_details()]


def instance_buffers(model_path: str, interp: Interpreter, io_copies: bool = False) -> int:
    """Bytes of one instance's own buffers after its signatures ran: every tensor an op of a signature's subgraph
    reads or writes that is not a weight (activations, inputs and outputs, the KV cache fed in and out), at the
    shapes ``interp`` allocated. Weights and their per-interpreter copies (the outputs of DEQUANTIZE and DENSIFY
    of constants) are not buffers. An upper bound of LiteRT's arena, which reuses memory between tensors whose
    lifetimes do not overlap. ``io_copies``: the instance also holds its own copy of every signature's inputs and
    outputs (``weightshare.litert.interpreter``'s TensorBuffers)."""
    from ai_edge_litert import schema_py_generated as schema

    from ..formats.tflite.flatbuf import check_header, open_model, read_buffer_refs, read_graph
    from ..formats.tflite.graph import builtin_code, indices

    with open_model(model_path) as (reader, mapping):
        check_header(reader)
        sizes = [r.nbytes for r in read_buffer_refs(reader)]
        graph = read_graph(reader, mapping)
    codes = [builtin_code(c) for c in graph.operatorCodes or []]
    unpacking = {schema.BuiltinOperator.DEQUANTIZE, schema.BuiltinOperator.DENSIFY}
    subgraphs = sorted({int(sd.subgraphIndex) for sd in graph.signatureDefs or []}) or [0]
    total = 0
    for si in subgraphs:
        if not 0 <= si < len(graph.subgraphs or []):
            continue
        sg = graph.subgraphs[si]
        tensors = sg.tensors or []
        weights = {i for i, x in enumerate(tensors) if 0 < x.buffer < len(sizes) and sizes[x.buffer]}
        used = set(indices(sg.inputs)) | set(indices(sg.outputs))
        for op in sg.operators or []:
            ins, outs = indices(op.inputs), indices(op.outputs)
            used |= {i for i in ins + outs if i >= 0}
            if 0 <= op.opcodeIndex < len(codes) and codes[op.opcodeIndex] in unpacking and ins and ins[0] in weights:
                weights |= set(outs)  # a copy of a weight per interpreter: counted as a copy, not a buffer
        io = set(indices(sg.inputs)) | set(indices(sg.outputs))
        for ti in sorted(used - weights):
            try:
                d = interp._get_tensor_details(ti, si)  # no public API gives another subgraph's tensors
            except (ValueError, RuntimeError, IndexError):
                continue
            nbytes = int(np.prod([max(int(x), 0) for x in d["shape"]], dtype=np.int64)) * np.dtype(d["dtype"]).itemsize
            total += nbytes * (2 if io_copies and ti in io else 1)
    return total


def _open_helper(
    model_path: str, bounds: dict[str, dict[str, int | None]]
) -> tuple[Any, list[tuple[str, Callable[..., Any], EntryPoint]]]:
    """``weightshare.litert.interpreter`` and its signature runners, with the classic Interpreter's entry points
    (details and index bounds only: opened without delegate, never allocated, it holds no weights)."""
    from ..litert import interpreter

    shared = interpreter(model_path)
    entries = entry_points(open_mode(model_path, MODES[0]), model_path, bounds)
    runs: list[tuple[str, Callable[..., Any], EntryPoint]] = []
    for key, entry in entries:
        if not key:  # no SignatureDef (MediaPipe's models): no runner, as LiteRT's Interpreter has none either
            runs.append((key, lambda feeds: _run_primary(shared, feeds), entry))
            continue
        runner = shared.get_signature_runner(key)
        runs.append((key, lambda feeds, runner=runner: runner(**feeds), entry))
    return shared, runs


def _run_primary(interp: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The primary subgraph through the Interpreter calls (resize, set_tensor, invoke, get_tensor)."""
    details = interp.get_input_details()
    for d in details:
        if list(feeds[d["name"]].shape) != [int(x) for x in d["shape"]]:
            interp.resize_tensor_input(d["index"], list(feeds[d["name"]].shape))
    interp.allocate_tensors()
    outs = run(interp, {d["index"]: feeds[d["name"]] for d in details})
    return {d["name"]: o for d, o in zip(interp.get_output_details(), outs)}


def hold(
    model_path: str,
    share: bool,
    loader: str,
    bounds: dict[str, dict[str, int | None]],
    dims: dict[str, int],
    input_files: dict[str, str],
    instances: int = 1,
) -> list[Any]:
    """In this (child) process: ``instances`` instances as a user opens them (the classic Interpreter, or
    ``weightshare.litert.interpreter``), every signature run once, returned to be kept alive while
    ``memory.in_children`` reads the PSS of every process holding them. Nothing else is imported: what the
    process pays is what a user's would."""
    given = {name: np.load(file, allow_pickle=False) for name, file in input_files.items()}
    held: list[Any] = []
    with native_stderr_silenced():
        for _ in range(instances):
            if loader == "helper":
                shared, runs = _open_helper(model_path, bounds)
                for _key, call, entry in runs:
                    call(entry.feeds(0, given, None, dims))
                held.append(shared)
                del runs  # the classic Interpreter that made the inputs: the measurement's, not the user's
                continue
            interp = new_interpreter(model_path, share, allocate=False)
            entries = entry_points(interp, model_path, bounds)
            for _key, entry in entries:
                entry(entry.feeds(0, given, None, dims))
            del entries  # a signature runner holds the interpreter
            held.append(interp)
    return held


LOADERS = ("interpreter", "helper")  # the classic Interpreter (share: no default delegates), weightshare.litert


def _probe(
    model_path: str,
    counts: list[int],
    share: bool,
    inputs: dict[str, str] | None = None,
    loader: str = LOADERS[0],
    bounds: dict[str, dict[str, int | None]] | None = None,
) -> list[JsonDict]:
    """In this process: open instances one by one (each signature run once), memory after each count.

    Inputs are ``inputs`` (name or SIGNATURE:NAME -> .npy file) where given, else seeded random values, in range
    for inputs used as indices. ``loader``: the classic Interpreter, or ``weightshare.litert.interpreter`` (the
    XNNPACK weight cache of a ``--prepack`` output). Each row also gives ``buffers_mib``: one instance's own
    buffers (``instance_buffers``), what a new instance costs when no weight is copied.
    """
    import time

    from .memory import data_pss, memory_now

    given = {name: np.load(path, allow_pickle=False) for name, path in (inputs or {}).items()}
    rows, instances = [], []
    runs: list[tuple[str, Callable[..., Any], EntryPoint]] = []
    t0 = time.perf_counter()
    for n in range(1, max(counts) + 1):
        if loader == "helper":
            instance, runs = _open_helper(model_path, bounds or {})
            for _key, call, entry in runs:
                call(entry.feeds(0, given))
        else:
            instance = new_interpreter(model_path, share, allocate=False)
            entries = entry_points(instance, model_path, bounds or {})
            for _key, entry in entries:
                entry(entry.feeds(0, given))
            del entries  # a signature runner holds the interpreter: LiteRT refuses to reallocate while one lives
        instances.append(instance)
        if n in counts:
            row = {"sessions": n, **memory_now(), "load_s": round(time.perf_counter() - t0, 3)}
            row["data_pss_mib"] = round(data_pss() / (1 << 20), 2)  # without code: steady on a shared machine
            rows.append(row)
    # after the measurements: reading the graph leaves Python's own memory behind
    interp = runs[0][2].interp if loader == "helper" and runs else instances[0]
    buffers = instance_buffers(model_path, interp, io_copies=loader == "helper")
    for row in rows:
        row["buffers_mib"] = round(buffers / (1 << 20), 2)
    return rows


def measure_interpreters(
    model_path: str,
    counts: list[int],
    share: bool = True,
    inputs: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    loader: str = LOADERS[0],
) -> list[JsonDict]:
    """Memory of 1..N interpreters of ``model_path`` in a fresh process (``inputs``: name -> .npy file; ``env``:
    variables added to the child's environment; ``loader``: one of ``LOADERS``)."""
    from ..errors import Unsupported
    from .memory import in_child

    try:
        rows: list[JsonDict] = in_child(
            __name__,
            "_probe",
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
    return measure_interpreters(model_path, counts, share, inputs, env, loader="helper")
