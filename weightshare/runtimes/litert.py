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


def random_feeds(interp, seed: int = 0, dims: dict[str, int] | None = None) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for d in interp.get_input_details():
        shape = [int(s) for s in d["shape"]]
        dtype = np.dtype(d["dtype"])
        if dtype.kind == "f":
            feeds[d["index"]] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[d["index"]] = rng.integers(0, 2, shape).astype(bool)
        else:
            info = np.iinfo(dtype)
            feeds[d["index"]] = rng.integers(max(info.min, -100), min(info.max, 100), shape).astype(dtype)
    return feeds


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
