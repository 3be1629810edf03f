"""The graph rewrite that keeps ONNX Runtime from fusing a scale into a MatMul at load time (``unfuse_scales``), and
the clean-up after it (``drop_unused``): pure graph edits, used by ``cpu`` (``--unpack ort-cpu``) and ``prepack``;
``reload`` checks what ORT does with the result (see its docstring for why)."""

from __future__ import annotations

from .. import dtypes
from .._proto import pb


def _scalar(graph: pb.GraphProto) -> set[str]:
    """One-element fp32/fp16 tensors that are, or ORT's constant folding makes, constants: initializers, and Casts
    of them (the Casts ORT inserted for an fp16 model's CPU kernels)."""
    found = {
        t.name
        for t in graph.initializer
        if t.data_type in (dtypes.FLOAT, dtypes.FLOAT16) and dtypes.element_count(tuple(t.dims)) == 1
    }
    for n in graph.node:
        if n.op_type == "Cast" and len(n.input) == 1 and n.input[0] in found:
            found.add(n.output[0])
    return found


def unfuse_scales(model: pb.ModelProto) -> int:
    """Feed every ``Mul``/``Div`` by a one-element constant next to a ``MatMul`` (what MatMulScaleFusion folds) the
    scalar expanded to its other operand's shape, ``Expand(s, Shape(x))``: the same products element by element,
    and, the shape being known only at run time, no constant for the fusion to take (with a fully static shape
    ORT folds it into a constant of that shape, which the fusion does not take either). Returns the nodes
    changed."""
    g = model.graph
    scalars = _scalar(g)
    consumers: dict[str, list[pb.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    producer = {o: n for n in g.node for o in n.output}
    taken = {n.name for n in g.node} | set(producer) | {t.name for t in g.initializer} | {v.name for v in g.input}
    nodes: list[pb.NodeProto] = []
    changed = 0
    for n in g.node:
        slots = [k for k in ((1,) if n.op_type == "Div" else (0, 1)) if len(n.input) == 2 and n.input[k] in scalars]
        near_matmul = any(c.op_type == "MatMul" for c in consumers.get(n.output[0], [])) or any(
            (p := producer.get(i)) is not None and p.op_type == "MatMul" for i in n.input
        )
        if n.op_type in ("Mul", "Div") and slots and near_matmul:
            k = slots[0]
            base = f"{n.name or n.output[0]}.weightshare.unfused"
            shape, expanded = _fresh(f"{base}.shape", taken), _fresh(f"{base}.scale", taken)
            nodes.append(helper_node("Shape", [n.input[1 - k]], shape, _fresh(f"{base}.Shape", taken)))
            nodes.append(helper_node("Expand", [n.input[k], shape], expanded, _fresh(f"{base}.Expand", taken)))
            n.input[k] = expanded
            changed += 1
        nodes.append(n)
    if changed:
        copies = [_copy(n) for n in nodes]
        del g.node[:]
        g.node.extend(copies)
    return changed


def _fresh(name: str, taken: set[str]) -> str:
    out, k = name, 0
    while out in taken:
        k += 1
        out = f"{name}_{k}"
    taken.add(out)
    return out


def _copy(node: pb.NodeProto) -> pb.NodeProto:
    new = pb.NodeProto()
    new.CopyFrom(node)
    return new


def helper_node(op: str, inputs: list[str], output: str, name: str) -> pb.NodeProto:
    node = pb.NodeProto(op_type=op, name=name)
    node.input.extend(inputs)
    node.output.append(output)
    return node


def drop_unused(model: pb.ModelProto) -> None:
    """Remove nodes and small initializers nothing reads any more (the Casts of scalars ``unfuse_scales``
    replaced), so the written graph holds no dead branch."""
    g = model.graph
    while True:
        used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
        dead = [n for n in g.node if n.op_type == "Cast" and all(o not in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            g.node.remove(n)
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    for t in [t for t in g.initializer if t.name not in used and t.data_location != pb.TensorProto.EXTERNAL]:
        g.initializer.remove(t)
