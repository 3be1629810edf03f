"""Measuring children that open a model through weightshare's own loaders (``weightshare.litert.interpreter``: a
``convert --prepack`` output with its XNNPACK weight cache), for ``check``/``inspect`` (``probe``, ``hold``) and
``bench`` (``bench_probe``).

Placed above the loaders and the formats, which it imports: the format's measuring code
(``formats/tflite/measure.py``) starts these functions in child processes by module name
(``formats.tflite.measure.LOADER_PROBES``) and never imports this module, and the runtime code below the formats
(``_runtimes/``) imports neither a format nor a loader. Kept light at import: ``hold``'s children count importing
this module as part of what a user pays for the loader.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._runtimes.litert import (
    MODES,
    EntryPoint,
    entry_points,
    native_stderr_silenced,
    new_interpreter,
    open_mode,
    run_primary,
)
from .report import JsonDict


def open_helper(
    model_path: str, bounds: dict[str, dict[str, int | None]]
) -> tuple[Any, list[tuple[str, Callable[..., Any], EntryPoint]]]:
    """``weightshare.litert.interpreter`` and its signature runners, with the classic Interpreter's entry points
    (details and index bounds only: opened without delegate, never allocated, it holds no weights)."""
    from .litert import interpreter

    shared = interpreter(model_path)
    entries = entry_points(open_mode(model_path, MODES[0]), bounds)
    runs: list[tuple[str, Callable[..., Any], EntryPoint]] = []
    for key, entry in entries:
        if not key:  # no SignatureDef (MediaPipe's models): no runner, as LiteRT's Interpreter has none either
            runs.append((key, lambda feeds: run_primary(shared, feeds), entry))
            continue
        runner = shared.get_signature_runner(key)
        runs.append((key, lambda feeds, runner=runner: runner(**feeds), entry))
    return shared, runs


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
                shared, runs = open_helper(model_path, bounds)
                for _key, call, entry in runs:
                    call(entry.feeds(0, given, None, dims))
                held.append(shared)
                del runs  # the classic Interpreter that made the inputs: the measurement's, not the user's
                continue
            interp = new_interpreter(model_path, share, allocate=False)
            entries = entry_points(interp, bounds)
            for _key, entry in entries:
                entry(entry.feeds(0, given, None, dims))
            del entries  # a signature runner holds the interpreter
            held.append(interp)
    return held


def bench_probe(
    model_path: str,
    counts: list[int],
    share: bool,
    inputs: dict[str, str] | None = None,
    loader: str = "interpreter",
    bounds: dict[str, dict[str, int | None]] | None = None,
) -> list[JsonDict]:
    """In this process: open instances one by one (each signature run once), memory after each count.

    Inputs are ``inputs`` (name or SIGNATURE:NAME -> .npy file) where given, else seeded random values, in range
    for inputs used as indices. ``loader``: the classic Interpreter, or ``weightshare.litert.interpreter`` (the
    XNNPACK weight cache of a ``--prepack`` output). Each row also gives ``buffers_mib``: one instance's own
    buffers (``instance_buffers``), what a new instance costs when no weight is copied.
    """
    import time

    from ._runtimes.memory import data_pss, memory_now
    from .formats.tflite.signatures import instance_buffers

    given = {name: np.load(path, allow_pickle=False) for name, path in (inputs or {}).items()}
    rows, instances = [], []
    runs: list[tuple[str, Callable[..., Any], EntryPoint]] = []
    t0 = time.perf_counter()
    for n in range(1, max(counts) + 1):
        if loader == "helper":
            instance, runs = open_helper(model_path, bounds or {})
            for _key, call, entry in runs:
                call(entry.feeds(0, given))
        else:
            instance = new_interpreter(model_path, share, allocate=False)
            entries = entry_points(instance, bounds or {})
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


def _run_helper(
    model_path: str,
    bounds: dict[str, dict[str, int | None]],
    given: dict[str, Any],
    dims: dict[str, int],
    ran: bool,
) -> tuple[Any, Any, bool]:
    """One ``weightshare.litert.interpreter`` instance (CompiledModel with the model's XNNPACK weight cache), every
    signature run once when ``ran``: (instance, the classic Interpreter its inputs were made from, ran)."""
    instance, runs = open_helper(model_path, bounds)
    classic = runs[0][2].interp if runs else None
    if ran:
        try:
            for _key, call, entry in runs:
                call(entry.feeds(0, given, None, dims))
        except Exception:  # noqa: BLE001 -- inputs it cannot make up: the instance is measured unrun
            ran = False
    return instance, classic, ran


def probe(
    model_path: str,
    share: bool,
    interpreters: int,
    bounds: dict[str, dict[str, int | None]] | None = None,
    dims: dict[str, int] | None = None,
    input_files: dict[str, str] | None = None,
    loader: str = "helper",
) -> JsonDict:
    """``formats.tflite.measure.probe`` (same arguments and answer) through ``weightshare.litert.interpreter``
    (``litert-compiled-cache``), as ``bench`` measures its ``--prepack`` variant: CompiledModel exposes no tensors,
    so ``arena`` is 0 and ``buffers`` counts the helper's own input and output buffers too."""
    from ._runtimes.memory import data_pss, smaps_rollup
    from .formats.tflite.measure import read_given
    from .formats.tflite.signatures import instance_buffers

    given = read_given(input_files)
    if "usage" in given:
        return given
    bounds, dims = bounds or {}, dims or {}
    opened: list[Any] = []
    pss: list[int] = []
    data: list[int] = []
    ran = True
    classic = None
    with native_stderr_silenced():
        for _ in range(interpreters):
            try:
                instance, classic, ran = _run_helper(model_path, bounds, given["given"], dims, ran)
            except Exception as e:  # noqa: BLE001 -- any refusal is the answer
                return {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
            if getattr(instance, "weightshare_cache", None) is None:  # the cache stopped matching meanwhile
                return {"error": "weightshare.litert found no matching XNNPACK weight cache"}
            opened.append((instance, classic))
            pss.append(smaps_rollup()["Pss"])
            data.append(data_pss())
        try:  # after the measurements; the helper holds its own copy of every signature's inputs and outputs
            buffers = instance_buffers(model_path, classic, io_copies=True) if classic is not None else 0
        except Exception:  # noqa: BLE001 -- a figure beside the measurement, never a reason to drop it
            buffers = 0
    return {"pss": pss, "data_pss": data, "ran": ran, "buffers": buffers, "arena": [0] * len(pss)}
