"""Random layered ONNX models built in code, for checking ``convert --prepack`` against ONNX Runtime on the original.

Every model has a symbolic batch dim and the structures whose ORT optimization depends on facts about the WHOLE
graph, not about one neighbourhood: one weight read by several nodes (MatMul twice, MatMul and
Gemm(transB=1) of a tied weight), identical nodes that common-subexpression elimination merges, tensors computed
from the graph inputs and read by layers far apart, decomposed Gelu and LayerNorm (fused by ORT only where their
intermediate tensors have one consumer), MatMul+Add (fused into Gemm only where the MatMul's output has one
consumer). Weights are 128x128 float32 (64 KiB: what the segmenter counts as a weight), so that a small segment
budget (``WEIGHTSHARE_ORT_SEGMENT_BYTES``) really cuts the graph.

Also the two reproductions of the stitching failures (``cse_shared_weight_model``, ``derived_two_segments_model``).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

D = 512  # hidden size: K this large makes MLAS accumulate in blocks, so MatMul+Add and Gemm round apart
P = 16  # width of the narrow input p: a P x D float32 weight (32 KiB) is a small constant to the segmenter
BATCHES = (1, 8, 32, 64)  # MLAS picks other kernels (and blockings) as the row count grows
SEGMENT_BUDGET = str(2 * D * D * 4 + 65536)  # two weights per segment: cuts between every couple of layers
SEGMENT_BUDGET_FP16 = str(2 * D * D * 2 + 65536)  # the same for ``random_model(fp16=True)``


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.n = 0

    def name(self, stem: str) -> str:
        self.n += 1
        return f"{stem}{self.n}"

    def init(self, shape: tuple[int, ...], scale: float = 0.1, stem: str = "w") -> str:
        name = self.name(stem)
        arr = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        self.inits.append(nh.from_array(arr, name))
        return name

    def scalar(self, value: float) -> str:
        name = self.name("c")
        self.inits.append(nh.from_array(np.array(value, np.float32), name))
        return name

    def op(self, op_type: str, inputs: list[str], **attrs: object) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(h.make_node(op_type, inputs, [out], name=self.name("n"), **attrs))
        return out

    def gelu(self, x: str) -> str:
        """x * 0.5 * (1 + erf(x / sqrt 2)): the decomposition ORT's GeluFusion turns into com.microsoft Gelu."""
        d = self.op("Div", [x, self.scalar(math.sqrt(2.0))])
        e = self.op("Erf", [d])
        a = self.op("Add", [e, self.scalar(1.0)])
        m = self.op("Mul", [x, a])
        return self.op("Mul", [m, self.scalar(0.5)])

    def layernorm(self, x: str) -> str:
        """The decomposition ORT's LayerNormFusion turns into LayerNormalization."""
        mean = self.op("ReduceMean", [x], axes=[-1], keepdims=1)
        d = self.op("Sub", [x, mean])
        p = self.op("Pow", [d, self.scalar(2.0)])
        var = self.op("ReduceMean", [p], axes=[-1], keepdims=1)
        s = self.op("Sqrt", [self.op("Add", [var, self.scalar(1e-5)])])
        n = self.op("Div", [d, s])
        return self.op("Add", [self.op("Mul", [n, self.init((D,), 1.0, "g")]), self.init((D,), 0.1, "b")])

    def model(self, inputs: list[str], outputs: list[str]) -> onnx.ModelProto:
        ins = [h.make_tensor_value_info(i, T.FLOAT, ["batch", P if i == "p" else D]) for i in inputs]
        outs = [h.make_tensor_value_info(o, T.FLOAT, ["batch", D]) for o in outputs]
        graph = h.make_graph(self.nodes, "random_layered", ins, outs, self.inits)
        m = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
        m.ir_version = 8
        return m


def save(model: onnx.ModelProto, path: Path) -> Path:
    """With its weights in an external file, as exporters write large models."""
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path), save_as_external_data=True, location=f"{path.stem}.data", size_threshold=1024)
    return path


def random_model(seed: int, fp16: bool = False) -> onnx.ModelProto:
    """A model of 6-14 random layers on a [batch, 128] stream ``x``, with inputs ``m`` [batch, 128] and ``p``
    [batch, 16] that derived tensors are computed from. ``fp16``: the same model with fp16 weights, constants,
    inputs and outputs (``to_fp16``)."""
    m = _random_model(seed)
    return to_fp16(m) if fp16 else m


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every float initializer, input and output as fp16, as a torch ``model.half()`` export has them: ORT's CPU
    provider has no fp16 kernel for most of these ops and runs them in fp32 between Casts it inserts, so a cut
    can fall inside such a run."""
    for i, t in enumerate(model.graph.initializer):
        if t.data_type == T.FLOAT:
            model.graph.initializer[i].CopyFrom(nh.from_array(nh.to_array(t).astype(np.float16), t.name))
    for v in [*model.graph.input, *model.graph.output]:
        if v.type.tensor_type.elem_type == T.FLOAT:
            v.type.tensor_type.elem_type = T.FLOAT16
    return model


def _random_model(seed: int) -> onnx.ModelProto:
    rnd = random.Random(seed)
    b = _Builder(seed)
    weights: list[str] = []  # D x D weights, as [in, out]

    def weight() -> str:
        if weights and rnd.random() < 0.35:  # read again: one weight, several nodes
            return rnd.choice(weights)
        weights.append(b.init((D, D), 1.0 / math.sqrt(D)))
        return weights[-1]

    derived: list[str] = []  # computed from the input m only (and small constants): every layer may read them

    def derive() -> str:
        kind = rnd.randrange(4)
        if kind == 0:  # a small MatMul (8 KiB: not a weight to the segmenter) of the narrow input p
            out = b.op("MatMul", ["p", b.init((P, D), 0.1, "s")])
        elif kind == 1:
            out = b.gelu("m")
        elif kind == 2:
            out = b.op("Sigmoid", [b.op("Mul", ["m", b.scalar(0.5)])])
        else:
            out = b.layernorm("m")
        derived.append(out)
        return out

    x = "x"
    for _ in range(rnd.randrange(6, 15)):
        kind = rnd.randrange(10)
        if kind == 0:  # MatMul (+ bias) (+ Relu)
            y = b.op("MatMul", [x, weight()])
            if rnd.random() < 0.7:
                y = b.op("Add", [y, b.init((D,), 0.1, "bias")])
            x = b.op("Relu", [y]) if rnd.random() < 0.5 else y
        elif kind == 1:  # tied: Gemm(transB=1) reads a weight a MatMul reads too (an LM head tied to the embedding)
            w = weight()
            x = b.op("Gemm", [x, w, b.init((D,), 0.1, "bias")], transB=1)
        elif kind == 2:  # two identical MatMuls (CSE merges them) with different biases
            w = weight()
            a = b.op("Add", [b.op("MatMul", [x, w]), b.init((D,), 0.1, "bias")])
            c = b.op("Add", [b.op("MatMul", [x, w]), b.init((D,), 0.1, "bias")])
            x = b.op("Add", [a, c])
        elif kind == 3:
            x = b.gelu(x)
        elif kind == 4:
            x = b.layernorm(x)
        elif kind == 5:  # a tensor derived from the inputs, new or one an earlier (maybe far-apart) layer read
            d = rnd.choice(derived) if derived and rnd.random() < 0.6 else derive()
            x = b.op(rnd.choice(["Add", "Mul"]), [x, d])
        elif kind == 6:  # a derived tensor through its own MatMul+Add (fused into Gemm only with one consumer)
            d = rnd.choice(derived) if derived and rnd.random() < 0.5 else derive()
            x = b.op("Add", [x, b.op("Add", [b.op("MatMul", [d, weight()]), b.init((D,), 0.1, "bias")])])
        elif kind == 7:  # residual block: x + W2 gelu(W1 x + b1)
            y = b.gelu(b.op("Add", [b.op("MatMul", [x, weight()]), b.init((D,), 0.1, "bias")]))
            x = b.op("Add", [x, b.op("MatMul", [y, weight()])])
        elif kind == 8:  # a derived tensor plus a bias of this layer's (MatMul+Add -> Gemm on a derived MatMul)
            d = rnd.choice(derived) if derived and rnd.random() < 0.6 else derive()
            x = b.op("Add", [x, b.op("Add", [d, b.init((D,), 0.1, "bias")])])
        else:  # the input stream read again much later: a long skip
            x = b.op("Add", [x, b.op("MatMul", ["x", weight()])])
    out = b.op("Add", [x, derived[0]]) if derived and rnd.random() < 0.5 else x
    b.nodes.append(h.make_node("Identity", [out], ["y"]))
    return b.model(["x", "m", "p"], ["y"])


def _const(b: _Builder, values: list[int]) -> str:
    name = b.name("i")
    b.inits.append(nh.from_array(np.array(values, np.int64), name))
    return name


def cse_shared_weight_model(layers: int = 8, shared: int = 4) -> onnx.ModelProto:
    """Stitching failure (1). Each layer: ``x = Relu(x W0)``, then two branches ``x W1 + b1`` and
    ``x W2 + b2`` added together. In layer ``shared`` W2 is W1: ORT's common-subexpression elimination merges
    the two MatMuls, whose output then has two consumers, so MatMul+Add -> Gemm does not happen in the whole
    graph. With two weights per segment a cut falls between the branches; its window "has the same shape"
    (weights compared by type and shape) as one of a layer with two weights, whose answer (exact) is reused,
    and the stitched graph keeps two Gemms."""
    b = _Builder(7)
    x = "x"
    for layer in range(layers):
        x = b.op("Relu", [b.op("MatMul", [x, b.init((D, D), 1.0 / math.sqrt(D))])])
        w1 = b.init((D, D), 1.0 / math.sqrt(D))
        w2 = w1 if layer == shared else b.init((D, D), 1.0 / math.sqrt(D))
        a = b.op("Add", [b.op("MatMul", [x, w1]), b.init((D,), 0.1, "bias")])
        c = b.op("Add", [b.op("MatMul", [x, w2]), b.init((D,), 0.1, "bias")])
        x = b.op("Add", [a, c])
    b.nodes.append(h.make_node("Identity", [x], ["y"]))
    return b.model(["x"], ["y"])


def derived_two_segments_model() -> onnx.ModelProto:
    """Stitching failure (2). ``d`` = MatMul(m, small) is computed from the graph input ``m`` and read by
    an early and a late layer (each adds its own bias to it); ``g`` = a decomposed Gelu of ``m``, read likewise.
    In the whole graph ``d`` has two consumers: no MatMul+Add -> Gemm; ``g``'s input has more consumers: no
    Gelu fusion of it. Recomputed in each segment, each copy has one consumer and fuses."""
    b = _Builder(11)
    d = b.op("MatMul", ["m", b.init((D, P), 0.1, "s")])  # [batch, P], 32 KiB: a small constant to the segmenter
    g = b.gelu("m")
    x = "x"
    for layer in range(8):
        x = b.op("Relu", [b.op("MatMul", [x, b.init((D, D), 1.0 / math.sqrt(D))])])
        if layer in (0, 7):
            widened = b.op("Tile", [b.op("Add", [d, b.init((P,), 0.1, "bias")]), _const(b, [1, D // P])])
            x = b.op("Mul", [b.op("Add", [x, widened]), g])
    b.nodes.append(h.make_node("Identity", [x], ["y"]))
    return b.model(["x", "m"], ["y"])


def feeds(batch: int, seed: int = 1, dtype: type = np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + batch)
    return {n: rng.standard_normal((batch, P if n == "p" else D)).astype(dtype) for n in ("x", "m", "p")}


def differences(original: Path, converted: Path, batches: tuple[int, ...] = BATCHES) -> list[str]:
    """Where a default-option session of ``converted`` does not compute bit for bit what one of ``original``
    does: one line per batch size that differs (max abs difference), empty when they agree."""
    import onnxruntime as ort

    a = ort.InferenceSession(str(original), providers=["CPUExecutionProvider"])
    c = ort.InferenceSession(str(converted), providers=["CPUExecutionProvider"])
    names = {i.name for i in a.get_inputs()}
    dtype = np.float16 if a.get_inputs()[0].type == "tensor(float16)" else np.float32
    found = []
    for batch in batches:
        f = {k: v for k, v in feeds(batch, dtype=dtype).items() if k in names}
        for want, got in zip(a.run(None, f), c.run(None, f)):
            if not np.array_equal(want, got):
                found.append(f"batch {batch}: max |diff| {float(np.max(np.abs(want - got))):.3g}")
    return found
