"""ONNX Runtime: sessions that share weights, and their memory.

``session.disable_prepacking=1``: without it MLAS pre-packs MatMul/Gemm weights
into a private heap copy per session, which defeats any sharing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..report import JsonDict
from .memory import data_pss, in_child, memory_now

if TYPE_CHECKING:
    import onnxruntime as ort


def session_options(
    share: bool = True, log_level: int = 3, arena: bool = True, spinning: bool = True
) -> ort.SessionOptions:
    """``arena``: ORT's CPU memory arena (the default); off, activations are freed after each run, so that what
    a session keeps is its weights and their copies (``check`` measures weight copies so). ``spinning``: False
    for sessions that run once and are measured: the thread pool's workers wait on a lock instead of spinning
    after each run (half of a measuring child's CPU time, measured); its threads and memory are the same."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if share:
        so.add_session_config_entry("session.disable_prepacking", "1")
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = log_level
    so.enable_cpu_mem_arena = arena
    return so


def new_session(
    model_path: str | bytes, share: bool = True, log_level: int = 3, arena: bool = True, spinning: bool = True
) -> ort.InferenceSession:
    import onnxruntime as ort

    ort.set_default_logger_severity(max(log_level, 3))  # the process-wide logger also prints load errors
    options = session_options(share, log_level, arena, spinning)
    return ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])


ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
    "tensor(int16)": "int16",
    "tensor(uint16)": "uint16",
    "tensor(uint32)": "uint32",
    "tensor(uint64)": "uint64",
}


def dim_value(d: object, dims: dict[str, int]) -> int:
    """A dimension of an input's shape: a number as it is; a name from ``dims`` (else ``dims["*"]``, else 1); an
    expression of names, such as exporters write (``past_sequence_length + sequence_length``), computed from them."""
    if isinstance(d, int) and d >= 0:
        return d
    text = str(d)
    if text in dims or not any(op in text for op in "+-*/"):
        return dims.get(text, dims.get("*", 1))
    import ast

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return dims.get(node.id, dims.get("*", 1))
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Div)):
            a, b = value(node.left), value(node.right)
            ops = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}
            return ops.get(type(node.op), a // b if b else 0)
        raise ValueError(text)

    try:
        return max(0, value(ast.parse(text, mode="eval")))
    except (SyntaxError, ValueError, RecursionError):
        return dims.get("*", 1)


def random_feeds(
    session: ort.InferenceSession,
    seed: int = 0,
    dims: dict[str, int] | None = None,
    given: dict[str, Any] | None = None,
    bounds: dict[str, int | None] | None = None,
) -> dict[str, Any]:
    """Seeded random inputs from a session's input signature, except those ``given``.

    Symbolic dims take ``dims[name]``, else ``dims["*"]``, else 1; expressions of them are computed. Integer
    inputs used as indices (``bounds``) stay inside the axis they index; integer masks are ones and position
    ids count up, as a decoder expects. Inputs that cannot be generated are named all at once.
    """
    import numpy as np

    from ..errors import UsageError

    rng = np.random.default_rng(seed)
    dims, given, bounds = dims or {}, given or {}, bounds or {}
    feeds: dict[str, Any] = {}
    missing: list[tuple[str, str]] = []
    for inp in session.get_inputs():
        if inp.name in given:
            feeds[inp.name] = given[inp.name]
            continue
        shape = [dim_value(d, dims) for d in inp.shape]
        dtype = ORT_TYPES.get(inp.type)
        name = inp.name.lower()
        if dtype is None:
            missing.append((inp.name, f"has type {inp.type}, which cannot be generated"))
        elif inp.name in bounds:
            if bounds[inp.name] is None:
                missing.append((inp.name, "indexes a tensor of unknown size, so random values would be out of range"))
                continue
            feeds[inp.name] = rng.integers(0, bounds[inp.name], shape).astype(dtype)
        elif dtype == "bool":
            feeds[inp.name] = rng.integers(0, 2, shape).astype(bool)
        elif dtype.startswith(("int", "uint")) and "mask" in name:
            feeds[inp.name] = np.ones(shape, dtype)  # attend to everything: every position is valid
        elif dtype.startswith(("int", "uint")) and "position" in name and shape:
            feeds[inp.name] = np.broadcast_to(np.arange(shape[-1]), shape).astype(dtype)
        elif dtype.startswith(("int", "uint")):
            feeds[inp.name] = rng.integers(0, 3, shape).astype(dtype)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
    if missing:
        why = "; ".join(f"{n!r} {reason}" for n, reason in missing)
        example = " ".join(f"--input {n}={n}.npy" for n, _ in missing)
        raise UsageError(f"inputs that need real values: {why}; give them with {example}")
    return feeds


def _probe(model_path: str, counts: list[int], share: bool, arena: bool = True) -> list[JsonDict]:
    """In this process: open sessions one by one, record memory after each count in ``counts``."""
    import time

    rows, sessions = [], []
    base = memory_now()
    t0 = time.perf_counter()
    for n in range(1, max(counts) + 1):
        session = new_session(model_path, share, arena=arena)
        session.run(None, random_feeds(session))  # page the weights in, as serving would
        sessions.append(session)
        if n in counts:
            row = {"sessions": n, **memory_now(), "load_s": round(time.perf_counter() - t0, 3)}
            row["data_pss_mib"] = round(data_pss() / (1 << 20), 2)  # without code: steady on a shared machine
            row["baseline_pss_mib"] = base["pss_mib"]
            rows.append(row)
    return rows


def _probe_models(model_paths: list[str], share: bool) -> list[JsonDict]:
    """In this process: one session of each model, memory after each."""
    rows, sessions = [], []
    for i, path in enumerate(model_paths):
        session = new_session(path, share)
        session.run(None, random_feeds(session))
        sessions.append(session)
        rows.append({"models": i + 1, **memory_now()})
    return rows


def measure_models(model_paths: list[str], share: bool = True) -> list[JsonDict]:
    """Memory of one session of each model, all in one fresh process (zoo sharing)."""
    rows: list[JsonDict] = in_child(__name__, "_probe_models", [model_paths, share])
    return rows


def measure_sessions(
    model_path: str, counts: list[int], share: bool = True, env: dict[str, str] | None = None, arena: bool = True
) -> list[JsonDict]:
    """Memory of 1..N ONNX Runtime sessions of ``model_path``, in a fresh process (started with ``env`` added;
    ``arena``: False for sessions without ORT's CPU arena, whose growth is their weights and copies alone)."""
    rows: list[JsonDict] = in_child(__name__, "_probe", [model_path, sorted(counts), share, arena], env)
    return rows
