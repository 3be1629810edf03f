"""Models that exercise every kind of weight ONNX Runtime copies per session at default settings:
MatMul and Gemm (MLAS pre-packing) and Conv (NCHWc reordering at ORT_ENABLE_ALL).

Used by the ``--prepack`` tests, ``scripts/bench_prepack.py`` and ``weightshare demo``. Weights
go to an external data file layer by layer, so a multi-GiB sample never sits in memory.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h


def mixed_onnx(path: str | os.PathLike[str], conv_layers: int = 2, channels: int = 32, mm_layers: int = 2,
               dim: int = 256, spatial: int = 8, seed: int = 0) -> Path:
    """Conv(3x3)+Relu x ``conv_layers`` -> GlobalAveragePool -> MatMul -> (Gemm transB | MatMul)+Relu x ``mm_layers``.

    Input ``x`` is [N, channels, spatial, spatial] (or [N, channels] without Conv layers); weights
    (fp32) live in ``<stem>.data`` beside the model.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    data_name = f"{path.stem}.data"
    nodes, inits = [], []
    with open(path.parent / data_name, "wb") as data:
        def weight(name: str, shape: tuple[int, ...], scale: float) -> str:
            arr = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
            t = onnx.TensorProto(name=name, data_type=T.FLOAT, dims=shape, data_location=T.EXTERNAL)
            offset = data.tell()
            data.write(arr.tobytes())
            for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(arr.nbytes))):
                e = t.external_data.add()
                e.key, e.value = k, v
            inits.append(t)
            return name

        cur = "x"
        for i in range(conv_layers):
            w = weight(f"conv{i}.w", (channels, channels, 3, 3), (2 / (9 * channels)) ** 0.5)
            b = weight(f"conv{i}.b", (channels,), 0.01)
            nodes += [h.make_node("Conv", [cur, w, b], [f"conv{i}"], pads=[1, 1, 1, 1]),
                      h.make_node("Relu", [f"conv{i}"], [f"relu{i}"])]
            cur = f"relu{i}"
        if conv_layers:
            nodes += [h.make_node("GlobalAveragePool", [cur], ["gap"]), h.make_node("Flatten", ["gap"], ["flat"])]
            cur = "flat"
        if mm_layers:
            nodes.append(h.make_node("MatMul", [cur, weight("proj.w", (channels, dim), channels ** -0.5)], ["proj"]))
            cur = "proj"
        for i in range(mm_layers):
            if i % 2 == 0:
                w, b = weight(f"gemm{i}.w", (dim, dim), dim ** -0.5), weight(f"gemm{i}.b", (dim,), 0.01)
                nodes.append(h.make_node("Gemm", [cur, w, b], [f"lin{i}"], transB=1))
            else:
                nodes.append(h.make_node("MatMul", [cur, weight(f"mm{i}.w", (dim, dim), dim ** -0.5)], [f"lin{i}"]))
            nodes.append(h.make_node("Relu", [f"lin{i}"], [f"act{i}"]))
            cur = f"act{i}"
    x_shape: list[str | int] = ["N", channels, spatial, spatial] if conv_layers else ["N", channels]
    nodes.append(h.make_node("Identity", [cur], ["y"]))
    graph = h.make_graph(nodes, "mixed", [h.make_tensor_value_info("x", T.FLOAT, x_shape)],
                         [h.make_tensor_value_info("y", T.FLOAT, ["N", None])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


def sample_input(model_path: str | os.PathLike[str], batch: int, seed: int = 1) -> dict[str, np.ndarray]:
    """A seeded input of ``batch`` rows for a ``mixed_onnx`` model."""
    model = onnx.load(str(model_path), load_external_data=False)
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal([batch, *dims[1:]], dtype=np.float32)}
