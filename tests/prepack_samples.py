"""Models that exercise every kind of weight ONNX Runtime copies per session at default settings:
MatMul and Gemm (MLAS pre-packing) and Conv (NCHWc reordering at ORT_ENABLE_ALL).

Used by the ``--prepack`` tests, ``scripts/bench_prepack.py`` and ``weightshare demo``. Weights
go to an external data file layer by layer, so a multi-GiB sample never sits in memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx
import onnx.numpy_helper
from onnx import TensorProto as T
from onnx import helper as h


def mixed_onnx(
    path: str | os.PathLike[str],
    conv_layers: int = 2,
    channels: int = 32,
    mm_layers: int = 2,
    dim: int = 256,
    spatial: int = 8,
    seed: int = 0,
) -> Path:
    """Conv(3x3)+Relu x ``conv_layers`` -> GlobalAveragePool -> MatMul -> (Gemm transB | MatMul)+Relu x ``mm_layers``.

    Input ``x`` is [N, channels, spatial, spatial] (or [N, channels] without Conv layers); weights
    (fp32) live in ``<stem>.data`` beside the model.
    """
    path = Path(path)
    nodes: list[onnx.NodeProto] = []
    with open(path.parent / f"{path.stem}.data", "wb") as data:
        weight = _Weights(path, seed, data)
        cur = "x"
        for i in range(conv_layers):
            w = weight(f"conv{i}.w", (channels, channels, 3, 3), (2 / (9 * channels)) ** 0.5)
            b = weight(f"conv{i}.b", (channels,), 0.01)
            nodes += [
                h.make_node("Conv", [cur, w, b], [f"conv{i}"], pads=[1, 1, 1, 1]),
                h.make_node("Relu", [f"conv{i}"], [f"relu{i}"]),
            ]
            cur = f"relu{i}"
        if conv_layers:
            nodes += [h.make_node("GlobalAveragePool", [cur], ["gap"]), h.make_node("Flatten", ["gap"], ["flat"])]
            cur = "flat"
        if mm_layers:
            nodes.append(h.make_node("MatMul", [cur, weight("proj.w", (channels, dim), channels**-0.5)], ["proj"]))
            cur = "proj"
        for i in range(mm_layers):
            if i % 2 == 0:
                w, b = weight(f"gemm{i}.w", (dim, dim), dim**-0.5), weight(f"gemm{i}.b", (dim,), 0.01)
                nodes.append(h.make_node("Gemm", [cur, w, b], [f"lin{i}"], transB=1))
            else:
                nodes.append(h.make_node("MatMul", [cur, weight(f"mm{i}.w", (dim, dim), dim**-0.5)], [f"lin{i}"]))
            nodes.append(h.make_node("Relu", [f"lin{i}"], [f"act{i}"]))
            cur = f"act{i}"
    x_shape: list[str | int] = ["N", channels, spatial, spatial] if conv_layers else ["N", channels]
    nodes.append(h.make_node("Identity", [cur], ["y"]))
    return _save(path, "mixed", nodes, weight.inits, x_shape, ["N", None])


def _save(
    path: Path,
    name: str,
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    x_shape: list[str | int],
    y_shape: list[str | int | None],
) -> Path:
    """Write the model (opset 17, IR 8) with input ``x`` and output ``y``; its weights are already beside it."""
    graph = h.make_graph(
        nodes,
        name,
        [h.make_tensor_value_info("x", T.FLOAT, x_shape)],
        [h.make_tensor_value_info("y", T.FLOAT, y_shape)],
        inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


class _Weights:
    """Initializers written to ``<stem>.data`` beside the model as they are made (never all in memory)."""

    def __init__(self, path: Path, seed: int, file: BinaryIO) -> None:
        self.rng = np.random.default_rng(seed)
        self.name = f"{path.stem}.data"
        self.file = file
        self.inits: list[onnx.TensorProto] = []

    def __call__(self, name: str, shape: tuple[int, ...], scale: float, offset: float = 0.0) -> str:
        arr = (self.rng.standard_normal(shape, dtype=np.float32) * scale + offset).astype(np.float32)
        t = onnx.TensorProto(name=name, data_type=T.FLOAT, dims=shape, data_location=T.EXTERNAL)
        start = self.file.tell()
        self.file.write(arr.tobytes())
        for k, v in (("location", self.name), ("offset", str(start)), ("length", str(arr.nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.inits.append(t)
        return name


def cnn_onnx(
    path: str | os.PathLike[str],
    channels: int = 32,
    blocks: int = 3,
    spatial: int = 8,
    classes: int = 10,
    seed: int = 0,
) -> Path:
    """A small ResNet/Inception-like CNN: the fusions ORT makes around Conv, and branches.

    stem Conv+BatchNorm+Relu, MaxPool; then ``blocks`` blocks cycling through
    - residual: Conv+BN+Relu, Conv+BN, Add(skip), Relu;
    - residual with Clip (Relu6) activations and Conv biases;
    - branches: Conv1x1+Relu and Conv3x3+Relu side by side, Concat, AveragePool;
    then GlobalAveragePool, Flatten, Gemm. Input ``x`` is [N, 3, spatial, spatial]; ``channels`` even.
    """
    path = Path(path)
    with open(path.parent / f"{path.stem}.data", "wb") as data:
        nodes, inits = _cnn_nodes(_Weights(path, seed, data), channels, blocks, classes)
    return _save(path, "cnn", nodes, inits, ["N", 3, spatial, spatial], ["N", classes])


def _cnn_nodes(w: _Weights, c: int, blocks: int, classes: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    nodes: list[onnx.NodeProto] = []

    def conv(name: str, x: str, cin: int, cout: int, k: int, bias: bool) -> str:
        ins = [x, w(f"{name}.w", (cout, cin, k, k), (2 / (k * k * cin)) ** 0.5)]
        if bias:
            ins.append(w(f"{name}.b", (cout,), 0.01))
        nodes.append(h.make_node("Conv", ins, [name], pads=[k // 2] * 4))
        return name

    def bn(name: str, x: str, ch: int) -> str:
        params = [
            w(f"{name}.scale", (ch,), 0.1, 1.0),
            w(f"{name}.bias", (ch,), 0.1),
            w(f"{name}.mean", (ch,), 0.1),
            w(f"{name}.var", (ch,), 0.1, 1.0),
        ]
        nodes.append(h.make_node("BatchNormalization", [x, *params], [name], epsilon=1e-5))
        return name

    def op(kind: str, ins: list[str], out: str, **attrs: Any) -> str:
        nodes.append(h.make_node(kind, ins, [out], **attrs))
        return out

    clip = [
        op("Constant", [], "zero", value=h.make_tensor("zero_v", T.FLOAT, [], [0.0])),
        op("Constant", [], "six", value=h.make_tensor("six_v", T.FLOAT, [], [6.0])),
    ]
    cur = op("Relu", [bn("stem.bn", conv("stem", "x", 3, c, 3, False), c)], "stem.relu")
    cur = op("MaxPool", [cur], "pool", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    for i in range(blocks):
        b = f"block{i}"
        if i % 3 == 0:
            y = op("Relu", [bn(f"{b}.bn1", conv(f"{b}.conv1", cur, c, c, 3, False), c)], f"{b}.relu1")
            y = bn(f"{b}.bn2", conv(f"{b}.conv2", y, c, c, 3, False), c)
            cur = op("Relu", [op("Add", [y, cur], f"{b}.add")], f"{b}.out")
        elif i % 3 == 1:
            y = op("Clip", [conv(f"{b}.conv1", cur, c, c, 1, True), *clip], f"{b}.clip1")
            y = conv(f"{b}.conv2", y, c, c, 3, True)
            cur = op("Clip", [op("Add", [cur, y], f"{b}.add"), *clip], f"{b}.out")
        else:
            left = op("Relu", [conv(f"{b}.left", cur, c, c // 2, 1, True)], f"{b}.left.relu")
            right = op("Relu", [conv(f"{b}.right", cur, c, c // 2, 3, True)], f"{b}.right.relu")
            cat = op("Concat", [left, right], f"{b}.cat", axis=1)
            cur = op("AveragePool", [cat], f"{b}.out", kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=0)
    cur = op("Flatten", [op("GlobalAveragePool", [cur], "gap")], "flat")
    op("Gemm", [cur, w("fc.w", (classes, c), c**-0.5), w("fc.b", (classes,), 0.01)], "y", transB=1)
    return nodes, w.inits


def downsample_onnx(
    path: str | os.PathLike[str], channels: int = 16, blocks: int = 4, spatial: int = 16, seed: int = 0
) -> Path:
    """A CNN as PyTorch exports it: residual blocks that double the channels at stride 2 every other block
    (1x1 projection shortcut), Conv biases, then GlobalAveragePool, a Reshape to [N, -1] computed from
    Shape/Gather/Unsqueeze/Concat, and MatMul+Add layers (which ORT fuses into Gemm)."""
    path = Path(path)
    nodes: list[onnx.NodeProto] = []
    with open(path.parent / f"{path.stem}.data", "wb") as data:
        w = _Weights(path, seed, data)

        def conv(name: str, x: str, cin: int, cout: int, k: int, stride: int = 1) -> str:
            ins = [x, w(f"{name}.w", (cout, cin, k, k), (2 / (k * k * cin)) ** 0.5), w(f"{name}.b", (cout,), 0.01)]
            nodes.append(h.make_node("Conv", ins, [name], pads=[k // 2] * 4, strides=[stride] * 2))
            return name

        c = channels
        nodes.append(h.make_node("Relu", [conv("stem", "x", 3, c, 3)], ["stem.relu"]))
        cur = "stem.relu"
        for i in range(blocks):
            cout, stride = (2 * c, 2) if i % 2 else (c, 1)
            nodes.append(h.make_node("Relu", [conv(f"b{i}.conv1", cur, c, cout, 3, stride)], [f"b{i}.relu1"]))
            main = conv(f"b{i}.conv2", f"b{i}.relu1", cout, cout, 3)
            skip = conv(f"b{i}.proj", cur, c, cout, 1, stride) if cout != c else cur
            nodes += [
                h.make_node("Add", [main, skip], [f"b{i}.add"]),
                h.make_node("Relu", [f"b{i}.add"], [f"b{i}.out"]),
            ]
            cur, c = f"b{i}.out", cout
        consts = [
            onnx.numpy_helper.from_array(np.array(v, np.int64), n)
            for n, v in (("zero", 0), ("axis0", [0]), ("minus1", [-1]))
        ]
        nodes += [
            h.make_node("GlobalAveragePool", [cur], ["gap"]),
            h.make_node("Shape", ["gap"], ["shape"]),
            h.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
            h.make_node("Unsqueeze", ["n", "axis0"], ["n1"]),
            h.make_node("Concat", ["n1", "minus1"], ["flat.shape"], axis=0),
            h.make_node("Reshape", ["gap", "flat.shape"], ["flat"]),
        ]
        nodes += [
            h.make_node("MatMul", ["flat", w("fc1.w", (c, 64), c**-0.5)], ["fc1.mm"]),
            h.make_node("Add", ["fc1.mm", w("fc1.b", (64,), 0.01)], ["fc1"]),
            h.make_node("Relu", ["fc1"], ["fc1.relu"]),
            h.make_node("MatMul", ["fc1.relu", w("fc2.w", (64, 10), 0.125)], ["fc2.mm"]),
            h.make_node("Add", ["fc2.mm", w("fc2.b", (10,), 0.01)], ["y"]),
        ]
        inits = [*w.inits, *consts]
    return _save(path, "downsample", nodes, inits, ["N", 3, spatial, spatial], ["N", 10])


def upsample_onnx(path: str | os.PathLike[str], channels: int = 8, spatial: int = 8, seed: int = 0) -> Path:
    """A CNN with an FPN-like neck as exporters write ``interpolate(top, size=lateral.shape)``: a stride-2 Conv's
    output Resized (nearest) to the shape of the lateral feature map and added to it, the Resize's ``roi`` an
    empty initializer (a zero-length payload, stored first); then Conv, GlobalAveragePool, Flatten, Gemm. No
    other constant than the weights. Input ``x`` is [N, 3, spatial, spatial]."""
    path = Path(path)
    roi = onnx.numpy_helper.from_array(np.zeros((0,), np.float32), "roi")
    with open(path.parent / f"{path.stem}.data", "wb") as data:
        w = _Weights(path, seed, data)
        c = channels

        def conv(name: str, x: str, cin: int, stride: int = 1) -> list[onnx.NodeProto]:
            ins = [x, w(f"{name}.w", (c, cin, 3, 3), (2 / (9 * cin)) ** 0.5), w(f"{name}.b", (c,), 0.01)]
            return [
                h.make_node("Conv", ins, [name], pads=[1] * 4, strides=[stride] * 2),
                h.make_node("Relu", [name], [f"{name}.relu"]),
            ]

        nodes = [
            *conv("lateral", "x", 3),
            *conv("top", "lateral.relu", c, 2),
            h.make_node("Shape", ["lateral.relu"], ["lateral.shape"]),
            h.make_node("Resize", ["top.relu", "roi", "", "lateral.shape"], ["up"], mode="nearest"),
            h.make_node("Add", ["up", "lateral.relu"], ["merged"]),
            *conv("neck", "merged", c),
            h.make_node("GlobalAveragePool", ["neck.relu"], ["gap"]),
            h.make_node("Flatten", ["gap"], ["flat"]),
            h.make_node("Gemm", ["flat", w("fc.w", (10, c), c**-0.5), w("fc.b", (10,), 0.01)], ["y"], transB=1),
        ]
        inits = [roi, *w.inits]
    return _save(path, "upsample", nodes, inits, ["N", 3, spatial, spatial], ["N", 10])


def sample_input(model_path: str | os.PathLike[str], batch: int, seed: int = 1) -> dict[str, np.ndarray]:
    """A seeded input of ``batch`` rows for a ``mixed_onnx`` model."""
    model = onnx.load(str(model_path), load_external_data=False)
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal([batch, *dims[1:]], dtype=np.float32)}
