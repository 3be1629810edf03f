"""Readers during re-conversion: a session opened at any moment computes with the old or the new weights, exactly.

ONNX Runtime opens OUT/a.onnx and then its blob by name. A separate process loads
sessions in a loop while this process re-converts OUT, swapping v1 <-> v2 weights.
Every session's output must equal v1's or v2's bytes; no load may fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import weightshare
from weightshare.api import convert_zoo

DIM = 64
SWAPS = 120

READER = r"""
import json, os, sys, time
import numpy as np, onnxruntime as ort
model, want1, want2, stop, ready = sys.argv[1:6]
want = {np.load(want1).tobytes(): "v1", np.load(want2).tobytes(): "v2"}
x = np.load(os.path.join(os.path.dirname(want1), "x.npy"))
counts = {"v1": 0, "v2": 0, "mixed": 0, "failed": 0}
errors = []
so = ort.SessionOptions()
so.log_severity_level = 4
while not os.path.exists(stop):
    try:
        y = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    except Exception as e:
        counts["failed"] += 1
        errors.append(str(e)[:200])
        continue
    counts[want.get(y.tobytes(), "mixed")] += 1
    if not os.path.exists(ready):
        open(ready, "w").close()
print(json.dumps({"counts": counts, "errors": errors[:3]}))
"""


def mlp(path: Path, seed: int) -> Path:
    """x[1, DIM] through 3 (MatMul of fp16 weights behind Cast, + bias) layers.

    The weights go to the blob; the biases (256 bytes) stay inline in the model file, so a session
    that pairs one version's model with the other's blob computes neither version's output.
    """
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(3):
        inits.append(nh.from_array((rng.standard_normal((DIM, DIM)) / 8).astype(np.float16), f"w{i}"))
        inits.append(nh.from_array(rng.standard_normal(DIM).astype(np.float32), f"b{i}"))
        nodes.append(h.make_node("Cast", [f"w{i}"], [f"w{i}_f"], to=T.FLOAT))
        nodes.append(h.make_node("MatMul", [x, f"w{i}_f"], [f"m{i}"]))
        y = "y" if i == 2 else f"h{i}"
        nodes.append(h.make_node("Add", [f"m{i}", f"b{i}"], [y]))
        x = y
    g = h.make_graph(
        nodes,
        "mlp",
        [h.make_tensor_value_info("x", T.FLOAT, [1, DIM])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, DIM])],
        inits,
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(m.SerializeToString())
    return path


def outputs(model: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def race(tmp_path: Path, convert_v1, convert_v2, v1: Path, v2: Path, reader_code: str = READER) -> dict:
    """Swap v1 <-> v2 SWAPS times while a reader process loads OUT/a.onnx in a loop; return its counts.
    ``reader_code``: the reader's loop (default: plain ``InferenceSession``; READER with another open)."""
    x = np.random.default_rng(7).standard_normal((1, DIM)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "want1.npy", outputs(v1, x))
    np.save(tmp_path / "want2.npy", outputs(v2, x))
    assert outputs(v1, x).tobytes() != outputs(v2, x).tobytes()
    out = tmp_path / "out"
    convert_v1(out)
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            reader_code,
            str(out / "a.onnx"),
            str(tmp_path / "want1.npy"),
            str(tmp_path / "want2.npy"),
            str(stop),
            str(ready),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and reader.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the reader has loaded one session: from here on it loads in a tight loop
        assert ready.exists(), "reader did not start"
        for i in range(SWAPS):
            (convert_v2 if i % 2 == 0 else convert_v1)(out)
    finally:
        stop.touch()
        stdout, _ = reader.communicate(timeout=60)
    return json.loads(stdout)


@pytest.mark.slow
def test_plain_mode_readers_see_old_or_new_never_a_mix(tmp_path):
    v1, v2 = mlp(tmp_path / "v1" / "a.onnx", 1), mlp(tmp_path / "v2" / "a.onnx", 2)
    result = race(tmp_path, lambda out: weightshare.convert(v1, out), lambda out: weightshare.convert(v2, out), v1, v2)
    counts = result["counts"]
    assert counts["mixed"] == 0 and counts["failed"] == 0, result
    assert counts["v1"] > 0 and counts["v2"] > 0, result  # the reader did run during the swaps
    # both versions' blobs are still there (grace period), nothing else accumulated
    assert len(list((tmp_path / "out").glob("a.weights.*.safetensors"))) == 2


@pytest.mark.slow
def test_zoo_mode_readers_see_old_or_new_never_a_mix(tmp_path):
    v1 = [mlp(tmp_path / "v1" / "a.onnx", 1), mlp(tmp_path / "v1" / "b.onnx", 3)]
    v2 = [mlp(tmp_path / "v2" / "a.onnx", 2), mlp(tmp_path / "v2" / "b.onnx", 3)]
    result = race(
        tmp_path,
        lambda out: convert_zoo(v1, out, "zoo.safetensors"),
        lambda out: convert_zoo(v2, out, "zoo.safetensors"),
        v1[0],
        v2[0],
    )
    counts = result["counts"]
    assert counts["mixed"] == 0 and counts["failed"] == 0, result
    assert counts["v1"] > 0 and counts["v2"] > 0, result
    assert len(list((tmp_path / "out").glob("zoo.*.safetensors"))) == 2
