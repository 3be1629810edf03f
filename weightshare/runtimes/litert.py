"""LiteRT (TFLite): interpreters that share weights, and their inputs.

``BUILTIN_WITHOUT_DEFAULT_DELEGATES`` keeps the XNNPACK delegate from packing
weights into a private copy per interpreter (DESIGN.md 7).
"""

from __future__ import annotations

import numpy as np


def new_interpreter(model_path: str, share: bool = True):
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    kwargs = {"experimental_op_resolver_type": OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES} if share else {}
    interp = Interpreter(model_path=model_path, **kwargs)
    interp.allocate_tensors()
    return interp


def _random_array(rng, shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), shape).astype(dtype)


class EntryPoint:
    """One signature (or the primary subgraph): seeded random feeds in, outputs by name out."""

    def __init__(self, interp, key: str | None):
        self.interp, self.key = interp, key
        self.runner = interp.get_signature_runner(key) if key else None

    def feeds(self, seed: int) -> dict:
        rng = np.random.default_rng(seed)
        details = self.runner.get_input_details() if self.runner else {
            d["index"]: d for d in self.interp.get_input_details()}
        return {name: _random_array(rng, [int(x) for x in d["shape"]], d["dtype"]) for name, d in details.items()}

    def __call__(self, feeds: dict) -> dict[str, np.ndarray]:
        if self.runner:
            return {k: np.array(v) for k, v in self.runner(**feeds).items()}
        outs = run(self.interp, feeds)
        return {d["name"]: o for d, o in zip(self.interp.get_output_details(), outs)}


def entry_points(interp) -> list[tuple[str, EntryPoint]]:
    keys = list(interp.get_signature_list())
    if not keys:
        return [("", EntryPoint(interp, None))]
    return [(k, EntryPoint(interp, k)) for k in keys]


def random_feeds(interp, seed: int = 0, dims: dict[str, int] | None = None) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {d["index"]: _random_array(rng, [int(s) for s in d["shape"]], d["dtype"])
            for d in interp.get_input_details()}


def run(interp, feeds: dict[int, np.ndarray]) -> list[np.ndarray]:
    for index, value in feeds.items():
        interp.set_tensor(index, value)
    interp.invoke()
    return [interp.get_tensor(d["index"]).copy() for d in interp.get_output_details()]


def _probe(model_path: str, counts: list[int], share: bool) -> list[dict]:
    """In this process: open interpreters one by one (each run once), memory after each count in ``counts``."""
    import time

    from .memory import memory_now

    rows, interps = [], []
    t0 = time.perf_counter()
    for n in range(1, max(counts) + 1):
        interp = new_interpreter(model_path, share)
        run(interp, random_feeds(interp))
        interps.append(interp)
        if n in counts:
            rows.append({"sessions": n, **memory_now(), "load_s": round(time.perf_counter() - t0, 3)})
    return rows


def measure_interpreters(model_path: str, counts: list[int], share: bool = True) -> list[dict]:
    """Memory of 1..N interpreters of ``model_path`` in a fresh process."""
    from .memory import in_child

    return in_child(__name__, "_probe", [model_path, sorted(counts), share])
