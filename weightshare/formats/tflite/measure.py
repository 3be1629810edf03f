"""What one more LiteRT interpreter costs, measured: the PSS growth from 1 to 4 interpreters, per setting, in a child.

The static rules (``inventory.py``) say which buffers XNNPACK packs and which DEQUANTIZE/DENSIFY kernels
materialise; LiteRT itself is the authority on what a new interpreter copies (XNNPACK's packing of int8
weight-only and fp16 weights behind DEQUANTIZE included), so ``check`` and ``inspect`` ask it as they ask ONNX
Runtime (``formats/onnx/measure.py``): a fresh child per setting opens interpreters one by one, runs every
signature once (seeded random inputs, in range for index inputs), and reads its PSS after each. The growth is
that of the PSS of everything but program code (``_runtimes.memory.data_pss``), over 3. The child is bounded
(``TIMEOUT_S``) and started with ``MALLOC_MMAP_THRESHOLD_=1048576`` like the ONNX one. ``litert-compiled-cache``
(CompiledModel with an XNNPACK weight cache file) is not measured: its figure stays the static one.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from ...errors import WeightshareError
from ...report import JsonDict
from ..onnx.measure import ENV_SKIP, MALLOC_ENV, SESSIONS

SETTINGS = (("litert-builtin", True), ("litert-xnnpack", False))  # (setting id, without default delegates)
TIMEOUT_S = 600.0


def _run_signatures(model_path: str, interp: Any, bounds: dict[str, dict[str, int | None]]) -> bool:
    """Run every signature of ``interp`` once (seeded random inputs, index inputs in range); False when the inputs
    cannot be made up or LiteRT refuses them. The signature runners are dropped before returning: each holds the
    interpreter, and LiteRT refuses ``allocate_tensors`` ("at least 1 reference to internal data") while one
    lives."""
    from ..._runtimes.litert import entry_points

    entries = entry_points(interp, model_path, bounds)
    try:
        for _key, entry in entries:
            entry(entry.feeds(0, {}))
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


def probe(
    model_path: str, share: bool, interpreters: int = SESSIONS, bounds: dict[str, dict[str, int | None]] | None = None
) -> JsonDict:
    """In this (child) process: PSS after each of ``interpreters`` interpreters under the setting, or why LiteRT
    refused the model; ``buffers``: one interpreter's own buffers (``instance_buffers``: activations, inputs and
    outputs, KV cache), which are not weight copies."""
    from ..._runtimes.litert import instance_buffers, native_stderr_silenced, new_interpreter
    from ..._runtimes.memory import data_pss, smaps_rollup

    opened: list[Any] = []
    pss: list[int] = []
    data: list[int] = []
    ran = True
    buffers = 0
    with native_stderr_silenced():
        for _ in range(interpreters):
            try:
                interp = new_interpreter(model_path, share, allocate=False)
            except Exception as e:  # noqa: BLE001 -- any refusal is the answer
                return {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
            if ran:
                ran = _run_signatures(model_path, interp, bounds or {})
            if not ran:
                try:
                    _allocate_signatures(interp)
                except Exception as e:  # noqa: BLE001
                    return {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
            opened.append(interp)
            pss.append(smaps_rollup()["Pss"])
            data.append(data_pss())
        try:  # after the measurements: reading the graph leaves Python's own memory behind
            buffers = instance_buffers(model_path, opened[0])
        except Exception:  # noqa: BLE001 -- a figure beside the measurement, never a reason to drop it
            buffers = 0
    return {"pss": pss, "data_pss": data, "ran": ran, "buffers": buffers}


def buffers_note(setting: str, res: JsonDict) -> str | None:
    """The measured figure of ``setting`` includes each interpreter's own buffers: say how much they are."""
    buffers = int(res.get("buffers", 0) or 0)
    if buffers < (1 << 20) // 16:
        return None
    return (
        f"{setting}: of what one more interpreter costs, up to {buffers / (1 << 20):.1f} MiB are its own buffers "
        "(activations, inputs and outputs, KV cache: every non-constant tensor of its signatures), not weight copies"
    )


def available() -> bool:
    return importlib.util.find_spec("ai_edge_litert") is not None and os.environ.get(ENV_SKIP, "") != "1"


def measure_copies(path: Path) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """(setting id -> bytes one more interpreter costs, setting id -> PSS of the child with one interpreter,
    notes); ({}, {}, [why not]) when ai-edge-litert is not installed or measuring is off."""
    if not available():
        return (
            {},
            {},
            ["per-interpreter copies are the static estimate: ai-edge-litert is not installed (or measuring is off)"],
        )
    from ..._runtimes.litert import signature_bounds
    from ..._runtimes.memory import in_child

    try:
        bounds = signature_bounds(str(path))  # here: the child's memory must not count the graph reader
    except WeightshareError:
        bounds = {}
    out: dict[str, int] = {}
    one: dict[str, int] = {}
    notes: list[str] = []
    for setting, share in SETTINGS:
        try:
            res: JsonDict = in_child(
                __name__, "probe", [str(path), share, SESSIONS, bounds], MALLOC_ENV, timeout=TIMEOUT_S
            )
        except RuntimeError as e:
            notes.append(f"could not measure {setting}: {e}")
            continue
        if "error" in res:
            notes.append(f"LiteRT refuses the model under {setting}: {res['error']}")
            continue
        data = res["data_pss"]
        out[setting] = max(0, (data[-1] - data[0]) // (len(data) - 1))
        one[setting] = res["pss"][0]
        if not res["ran"]:
            notes.append(f"{setting}: interpreters measured without a run (inputs could not be generated)")
        note = buffers_note(setting, res)
        if note:
            notes.append(note)
    notes.append("litert-compiled-cache is not measured: its figure is the static estimate")
    return out, one, notes
