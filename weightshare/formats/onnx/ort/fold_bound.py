"""What ONNX Runtime's constant folding would compute for a model, bounded by what the model's size justifies.

ORT evaluates every node whose inputs are all constant while it optimizes a session. A few hundred bytes can
ask for a lot: ``ConstantOfShape([4096, 4096])`` feeding a chain of MatMuls is 64 MiB per step and 137 GFLOP per
MatMul; the ORT child of ``--prepack`` / ``--unpack ort-cpu`` then computes for minutes before any limit stops
it. Before that child starts, the constant part of the graph is walked here (shapes propagated from the constant
values and dims the model states; nothing is allocated from them) and a model whose folding would produce more
bytes than the child may write, or more arithmetic than its size justifies, is refused in one line.

The estimate errs on the side of letting a model through: a node whose output shape this walk cannot tell stops
the walk along that path (what follows is left to the child's derived time limit, ``limits``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

from ....errors import Unsupported
from .._proto import pb

FLOP_FLOOR = 1 << 32  # ~4 GFLOP: about a second of MLAS on one core; ordinary models fold far less
FLOPS_PER_BYTE = 64  # beyond the floor, arithmetic a model may ask of its constants per byte of input

_ITEMSIZE = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}
_SAME_SHAPE = {
    "Abs", "Cast", "Ceil", "Cos", "Erf", "Exp", "Floor", "Identity", "Log", "Neg", "Not", "Reciprocal", "Relu",
    "Round", "Sigmoid", "Sign", "Sin", "Softmax", "Sqrt", "Tanh", "Transpose", "LeakyRelu", "Gelu", "Clip",
}  # fmt: skip
_BROADCAST = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "Where", "Equal", "Less", "Greater", "And", "Or"}
_NOT_FOLDED = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}  # ORT keeps Q/DQ for its fusions
_MAX_VALUES = 64  # a shape / repeats input read as values: at most this many elements


def _dims_ok(dims: list[int]) -> bool:
    return all(0 <= d < (1 << 40) for d in dims)


def _int_values(t: pb.TensorProto) -> list[int] | None:
    """A small INT64/INT32 tensor's values (shape-like inputs), or None."""
    n = math.prod(t.dims)
    if n > _MAX_VALUES or t.data_type not in (6, 7):
        return None
    if t.int64_data or t.int32_data:
        values = list(t.int64_data or t.int32_data)
    elif t.raw_data:
        size = 8 if t.data_type == 7 else 4
        if len(t.raw_data) != n * size:
            return None
        values = [int.from_bytes(t.raw_data[i : i + size], "little", signed=True) for i in range(0, n * size, size)]
    else:
        return None if n else []
    return values if len(values) == n else None


def _broadcast(a: list[int], b: list[int]) -> list[int] | None:
    out = []
    for x, y in zip([1] * (len(b) - len(a)) + a, [1] * (len(a) - len(b)) + b):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return out


def _graphs(graph: pb.GraphProto) -> Iterator[pb.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == pb.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            for g in attr.graphs:
                yield from _graphs(g)


def folding_work(model: pb.ModelProto) -> tuple[int, int]:
    """(bytes, multiply-adds x 2) that constant folding would produce in ``model``, as far as shapes tell."""
    total_bytes = flops = 0
    for graph in _graphs(model.graph):
        shapes: dict[str, list[int]] = {}
        sizes: dict[str, int] = {}
        values: dict[str, list[int]] = {}
        constant: set[str] = set()
        for t in graph.initializer:
            constant.add(t.name)
            shapes[t.name] = list(t.dims)
            sizes[t.name] = _ITEMSIZE.get(t.data_type, 4)
            if (v := _int_values(t)) is not None:
                values[t.name] = v
        for node in graph.node:
            ins = [i for i in node.input if i]
            if node.op_type == "Constant":
                for attr in node.attribute:
                    if attr.name == "value" and attr.type == pb.AttributeProto.TENSOR:
                        shapes[node.output[0]] = list(attr.t.dims)
                        sizes[node.output[0]] = _ITEMSIZE.get(attr.t.data_type, 4)
                        if (v := _int_values(attr.t)) is not None:
                            values[node.output[0]] = v
                constant.update(node.output)
                continue
            if node.domain not in ("", "ai.onnx") or node.op_type in _NOT_FOLDED:
                continue
            if not ins or not all(i in constant for i in ins) or not node.output:
                continue
            constant.update(o for o in node.output if o)
            shape, size, work = _output(node, ins, shapes, sizes, values)
            if shape is None or not _dims_ok(shape):
                continue  # unknown: the child's time limit covers what follows
            out = node.output[0]
            shapes[out], sizes[out] = shape, size
            total_bytes += math.prod(shape) * size
            flops += work
    return total_bytes, flops


def _output(
    node: pb.NodeProto,
    ins: list[str],
    shapes: dict[str, list[int]],
    sizes: dict[str, int],
    values: dict[str, list[int]],
) -> tuple[list[int] | None, int, int]:
    """(output shape or None, its item size, arithmetic) of one folded node."""
    op = node.op_type
    first = shapes.get(ins[0])
    size = sizes.get(ins[0], 4)
    if op == "ConstantOfShape":
        size = 4
        for attr in node.attribute:
            if attr.name == "value" and attr.type == pb.AttributeProto.TENSOR:
                size = _ITEMSIZE.get(attr.t.data_type, 4)
        return values.get(ins[0]), size, 0
    if first is None:
        return None, size, 0
    if op in _SAME_SHAPE:
        return first, size, math.prod(first)
    if op in _BROADCAST:
        shape: list[int] | None = first
        for name in ins[1:]:
            other = shapes.get(name)
            shape = _broadcast(shape, other) if shape is not None and other is not None else None
        return shape, size, math.prod(shape) if shape is not None else 0
    if op in ("MatMul", "Gemm") and len(ins) >= 2 and (b := shapes.get(ins[1])) is not None:
        if len(first) < 2 or len(b) < 2:
            return None, size, 0
        if op == "Gemm":
            trans = {a.name: a.i for a in node.attribute}
            m, k = (first[1], first[0]) if trans.get("transA") else (first[0], first[1])
            n = b[0] if trans.get("transB") else b[1]
            return [m, n], size, 2 * m * k * n
        batch = _broadcast(first[:-2], b[:-2])
        if batch is None:
            return None, size, 0
        m, k, n = first[-2], first[-1], b[-1]
        return [*batch, m, n], size, 2 * math.prod(batch) * m * k * n
    if op == "Expand" and len(ins) == 2 and (target := values.get(ins[1])) is not None:
        return _broadcast(first, target), size, 0
    if op == "Tile" and len(ins) == 2 and (reps := values.get(ins[1])) is not None and len(reps) == len(first):
        return [d * r for d, r in zip(first, reps)], size, 0
    return None, size, 0


def check_constant_folding(
    model: pb.ModelProto, input_bytes: int, where: str | os.PathLike[str], growth: float | None = None
) -> None:
    """Refuse a model whose constant folding would produce more bytes than the ORT child may write for it
    (``limits.limits_for``: ``--ort-max-growth`` x the input, 16 MiB at least) or more arithmetic than
    ``FLOP_FLOOR`` plus ``FLOPS_PER_BYTE`` per input byte (scaled with a larger --ort-max-growth)."""
    from .limits import DEFAULT_GROWTH, limits_for

    output_bytes = limits_for(input_bytes, where, growth=growth).output_bytes
    produced, flops = folding_work(model)
    scale = max(1.0, (growth or DEFAULT_GROWTH) / DEFAULT_GROWTH)
    flop_bound = int((FLOP_FLOOR + FLOPS_PER_BYTE * input_bytes) * scale)
    if produced > output_bytes or flops > flop_bound:
        raise Unsupported(
            f"onnxruntime's constant folding would compute {produced / (1 << 20):.0f} MiB "
            f"({flops / 1e9:.1f} GFLOP) from the constants of this {input_bytes}-byte model, more than its size "
            f"justifies ({output_bytes >> 20} MiB, {flop_bound / 1e9:.1f} GFLOP); allow it with --ort-max-growth "
            "FACTOR",
            where,
        )


def check_staged(
    model: os.PathLike[str], where: str | os.PathLike[str], growth: float | None, loaded: pb.ModelProto | None = None
) -> None:
    """``check_constant_folding`` of a staged model file (its directory holds it and its weights); ``loaded``: the
    file already parsed."""
    from pathlib import Path

    from .._proto import load_model

    staged = Path(model)
    input_bytes = sum(f.stat().st_size for f in staged.parent.iterdir() if f.is_file())
    check_constant_folding(loaded if loaded is not None else load_model(staged), input_bytes, where, growth)
