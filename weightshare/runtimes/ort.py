"""ONNX Runtime: sessions that share weights, and their memory.

``session.disable_prepacking=1``: without it MLAS pre-packs MatMul/Gemm weights
into a private heap copy per session, which defeats any sharing (DESIGN.md 7).
"""

from __future__ import annotations

from .memory import in_child, memory_now


def session_options(share: bool = True):
    import onnxruntime as ort

    so = ort.SessionOptions()
    if share:
        so.add_session_config_entry("session.disable_prepacking", "1")
    so.log_severity_level = 3
    return so


def new_session(model_path: str, share: bool = True):
    import onnxruntime as ort

    return ort.InferenceSession(model_path, session_options(share), providers=["CPUExecutionProvider"])


_ORT_TYPES = {
    "tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64", "tensor(int64)": "int64",
    "tensor(int32)": "int32", "tensor(int8)": "int8", "tensor(uint8)": "uint8", "tensor(bool)": "bool",
    "tensor(int16)": "int16", "tensor(uint16)": "uint16", "tensor(uint32)": "uint32", "tensor(uint64)": "uint64",
}


def random_feeds(session, seed: int = 0, dims: dict[str, int] | None = None) -> dict:
    """Seeded random inputs from a session's input signature; symbolic dims default to 1."""
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in session.get_inputs():
        shape = [d if isinstance(d, int) else (dims or {}).get(str(d), 1) for d in inp.shape]
        dtype = _ORT_TYPES.get(inp.type)
        if dtype is None:
            raise RuntimeError(f"input {inp.name!r} has type {inp.type}, which cannot be generated")
        if dtype == "bool":
            feeds[inp.name] = rng.integers(0, 2, shape).astype(bool)
        elif dtype.startswith(("int", "uint")):
            feeds[inp.name] = rng.integers(0, 3, shape).astype(dtype)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _probe(model_path: str, counts: list[int], share: bool) -> list[dict]:
    """In this process: open sessions one by one, record memory after each count in ``counts``."""
    import time

    rows, sessions = [], []
    base = memory_now()
    t0 = time.perf_counter()
    for n in range(1, max(counts) + 1):
        session = new_session(model_path, share)
        session.run(None, random_feeds(session))  # page the weights in, as serving would
        sessions.append(session)
        if n in counts:
            row = {"sessions": n, **memory_now(), "load_s": round(time.perf_counter() - t0, 3)}
            row["baseline_pss_mib"] = base["pss_mib"]
            rows.append(row)
    return rows


def _probe_models(model_paths: list[str], share: bool) -> list[dict]:
    """In this process: one session of each model, memory after each."""
    rows, sessions = [], []
    for i, path in enumerate(model_paths):
        session = new_session(path, share)
        session.run(None, random_feeds(session))
        sessions.append(session)
        rows.append({"models": i + 1, **memory_now()})
    return rows


def measure_models(model_paths: list[str], share: bool = True) -> list[dict]:
    """Memory of one session of each model, all in one fresh process (zoo sharing)."""
    return in_child(__name__, "_probe_models", [model_paths, share])


def measure_sessions(model_path: str, counts: list[int], share: bool = True) -> list[dict]:
    """Memory of 1..N ONNX Runtime sessions of ``model_path``, in a fresh process."""
    return in_child(__name__, "_probe", [model_path, sorted(counts), share])
