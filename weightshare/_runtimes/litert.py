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

    ``bounds``: the signature's index inputs -> exclusive bound (``formats.tflite.signatures.signature_bounds``)."""

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
        return run_primary(self.interp, feeds)


def entry_points(
    interp: Interpreter, bounds: dict[str, dict[str, int | None]] | None = None
) -> list[tuple[str, EntryPoint]]:
    """Every signature of ``interp`` (or its primary subgraph, key ""); ``bounds``: the model's inputs used as
    indices (``formats.tflite.signatures.signature_bounds``, read by the caller: without them, random index values
    may be out of range; a measuring child gets them from its parent, so that the schema module the graph reader
    imports is not counted in its memory)."""
    bounds = bounds or {}
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
    model_path: str,
    inputs_from: str,
    cache_path: str | None = None,
    bounds_of: Callable[[str], dict[str, dict[str, int | None]]] | None = None,
) -> list[tuple[str, CompiledEntry]]:
    """Every signature of ``model_path`` through CompiledModel; inputs made from ``inputs_from``'s Interpreter.

    ``cache_path``: an XNNPACK weight cache for the CPU options. A model without SignatureDefs has one
    placeholder signature in CompiledModel and none in the Interpreter: both are the primary subgraph, "".
    ``bounds_of``: reads a model's inputs used as indices (``entry_points``), asked for ``inputs_from``'s once
    LiteRT opened it (a model LiteRT refuses is refused before its graph is read).
    """
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.cpu_options import CpuOptions
    from ai_edge_litert.options import Options

    feeders = dict(entry_points(open_mode(inputs_from, MODES[0]), bounds_of(inputs_from) if bounds_of else None))
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


def run_primary(interp: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The primary subgraph through the Interpreter calls (resize, set_tensor, invoke, get_tensor)."""
    details = interp.get_input_details()
    for d in details:
        if list(feeds[d["name"]].shape) != [int(x) for x in d["shape"]]:
            interp.resize_tensor_input(d["index"], list(feeds[d["name"]].shape))
    interp.allocate_tensors()
    outs = run(interp, {d["index"]: feeds[d["name"]] for d in details})
    return {d["name"]: o for d, o in zip(interp.get_output_details(), outs)}
