"""What every layer of a transformer reads that the graph inputs alone make, for ``segments``: the context.

A decoder's attention mask, rotary cos/sin tables, position ids and reshape shapes, a ViT's mask built from the
pixels' shape: every layer reads them, so no cut between layers could hand them over (``segments.locality``).
``hoist_context`` moves the nodes that make them to the front; each later segment computes them again from the
inputs (``recomputed``), as the whole graph has them, and the stitch keeps one copy.

ORT decides some things by how many nodes read a tensor, which a segment sees fewer of than the whole graph:
it folds a Cast of an fp16 constant with one reader (then fuses the constant into a MatMul), it casts a Transpose
of the rotary tables before rather than after, it simplifies the Shape of a Cast nothing else reads, and it
optimizes the graph a second time only when it folded such a Cast (measured, ORT 1.32). Each segment therefore
holds witnesses that nothing outside reads and the stitch drops: a copy of its own nodes reading the context and
the constants other segments share (``witness_copy``), a copy of a reader elsewhere in the graph of what it
computes again (``outside_readers``), and in sessions whose weights are inputs one fp16 constant for ORT to fold
(``trigger``). None of this is trusted: ``segments.Segmenter.context_differs`` compares the stitch with ORT's
optimization of the whole graph, node for node, and any difference puts the graph back in one piece.
"""

from __future__ import annotations

import onnx
from onnx import helper


def _subgraphs(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def hoist_context(
    graph: onnx.GraphProto, small: set[str], typed: dict[str, onnx.ValueInfoProto]
) -> tuple[frozenset[str], frozenset[str]]:
    """Move the nodes that compute from the graph inputs and small constants alone (a decoder's attention mask, its
    rotary cos/sin tables and position ids, the shapes its reshapes read; a ViT's mask from the pixels' shape) to
    the front; return the tensors they make that later nodes read (the ``context`` every layer reads) and all they
    make. ``small``: the constants (small initializers, Constant nodes' outputs) a node of context may read.

    Only what ORT cannot fold is context: a node counts when it reads a graph input or another context tensor (a
    tensor of constants alone would reach later segments as an input, no longer a constant ORT folds). A node of
    constants alone that only context nodes read moves with them. Nothing when a context tensor's type is unknown
    (it would become a segment input of no type)."""
    small = small | {""}
    dynamic = {i.name for i in graph.input}
    nodes = list(graph.node)
    # candidates: weight-free nodes whose inputs are constants, graph inputs or other candidates' outputs
    ctx: set[int] = set()
    made: dict[str, int] = {}
    for k, n in enumerate(nodes):
        if n.op_type == "Constant" and not n.input or _subgraphs(n) or not n.input:
            continue
        if all(i in small or i in dynamic or i in made for i in n.input):
            ctx.add(k)
            made.update({o: k for o in n.output if o})
    while True:  # nodes of constants alone leave unless only context nodes read them; their readers then too
        readers: dict[int, set[int]] = {}
        for k, n in enumerate(nodes):
            for i in n.input:
                if i in made and made[i] in ctx:
                    readers.setdefault(made[i], set()).add(k)
        gone = set()
        for k in ctx:
            if any(i in made and made[i] not in ctx for i in nodes[k].input):
                gone.add(k)  # a producer left
            elif not _derives_from_inputs(nodes[k], dynamic, made, nodes, ctx) and not readers.get(k, set()) <= ctx:
                gone.add(k)
        if not gone:
            break
        ctx -= gone
    outputs = {o.name for o in graph.output}
    context = {o for k in ctx for o in nodes[k].output if o}
    read_later = {i for k, n in enumerate(nodes) if k not in ctx for i in n.input if i in context}
    if not read_later or read_later & outputs or any(t not in typed for t in read_later):
        return frozenset(), frozenset()
    order = sorted(ctx) + [k for k in range(len(nodes)) if k not in ctx]
    if order != list(range(len(nodes))):
        del graph.node[:]
        graph.node.extend(nodes[k] for k in order)
    return frozenset(read_later), frozenset(context)


def _derives_from_inputs(
    node: onnx.NodeProto, dynamic: set[str], made: dict[str, int], nodes: list[onnx.NodeProto], ctx: set[int]
) -> bool:
    """Whether ``node`` reads a graph input, directly or through other ``ctx`` nodes."""
    seen: set[int] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        for i in n.input:
            if i in dynamic:
                return True
            k = made.get(i)
            if k is not None and k in ctx and k not in seen:
                seen.add(k)
                todo.append(nodes[k])
    return False


def shared_constants(graph: onnx.GraphProto, bounds: list[int], small: set[str]) -> frozenset[str]:
    """Small initializers and Constant nodes' outputs that nodes of more than one segment read (a decoder's
    attention scale, a norm's epsilon): a segment's witness (``witness_copy``) reads them as the segment does, as the
    whole graph's other layers do; any other constant it reads through an input of its own (a constant of one
    reader has one reader in the whole graph too). ``small``: the constants (``hoist_context``); a graph with
    subgraphs is not cut, so a node's inputs are what it reads."""
    where: dict[str, set[int]] = {}
    for k in range(len(bounds) - 1):
        for node in graph.node[bounds[k] : bounds[k + 1]]:
            for i in set(node.input) & small:
                where.setdefault(i, set()).add(k)
    return frozenset(name for name, segments in where.items() if len(segments) > 1)


WITNESS = "__weightshare_witness"


def witness_copy(
    nodes: list[onnx.NodeProto],
    keep: frozenset[str],
    types: dict[str, onnx.ValueInfoProto],
    inits: dict[str, onnx.TensorProto],
    outputs: list[onnx.ValueInfoProto],
    elsewhere: dict[str, set[tuple[str, str]]],
) -> tuple[list[onnx.NodeProto], list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]] | None:
    """A copy of ``nodes`` (nodes, inputs, outputs) reading the tensors in ``keep`` (the context, the graph inputs
    and the constants other segments read too) as they do, and everything else through graph inputs of its
    type: a second reader of each tensor every layer reads. In the whole graph such a tensor (the rotary tables,
    the Transpose ORT pushes onto them, the inserted Cast of a shared fp16 scale) has a reader in every layer,
    and ORT decides by whether it has one or several: a Cast of one reader it folds into a constant
    (FuseInitializersTransformer; then MatMulScaleFusion fuses the scale), a Transpose of one reader it casts
    before rather than after (measured, ORT 1.32). Nothing outside the copy reads it; ``stitch`` drops it.
    None when a tensor it would read has no known type."""
    kept = set(keep)
    made: set[str] = set()
    copies, inputs, names = [], [], {}
    for n in nodes:
        # of the context alone, or making it: one node in the whole graph, not a copy
        if all(i in kept for i in n.input) or all(o in kept for o in n.output):
            kept.update(n.output)
            continue
        made.update(o for o in n.output if o)
        # a kept tensor is read as it is only where a node of the same op reads it outside the segment: the copy
        # stands for that reader (a SkipLayerNormalization's fp16 weight that the ViT's one LayerNormalization
        # reads through a Cast: one reader of the Cast in the whole graph, which ORT folds)
        alike = {i for i in n.input if (n.op_type, n.domain) in elsewhere.get(i, set())}
        for i in n.input:
            if not i or (i in kept and i in alike) or i in made or i in names:
                continue
            if i in inits:
                v = input_like(inits[i])
            elif i in types:
                v = onnx.ValueInfoProto()
                v.CopyFrom(types[i])
            else:
                return None
            v.name = names[i] = f"{i}{WITNESS}_in"
            inputs.append(v)
        w = onnx.NodeProto()
        w.CopyFrom(n)
        w.name = f"{n.name}{WITNESS}" if n.name else ""
        w.input[:] = [
            f"{i}{WITNESS}" if i in made else i if (i in kept and i in alike) or not i else names[i] for i in n.input
        ]
        w.output[:] = [f"{o}{WITNESS}" if o else "" for o in n.output]
        copies.append(w)
    outs = []
    for o in outputs:
        if o.name not in made:
            continue
        v = onnx.ValueInfoProto()
        v.CopyFrom(o)
        v.name = f"{o.name}{WITNESS}"
        outs.append(v)
    return copies, inputs, outs


def witness_nodes(part: onnx.ModelProto) -> set[int]:
    """Indices of the nodes of ``part`` that only its witnesses' outputs need (``witness_copy``)."""
    nodes = part.graph.node
    witness_out = {o.name for o in part.graph.output if o.name.endswith(WITNESS)}
    if not witness_out:
        return set()
    readers: dict[str, list[int]] = {}
    for j, n in enumerate(nodes):
        for i in n.input:
            readers.setdefault(i, []).append(j)
    outputs = {o.name for o in part.graph.output}
    only: set[int] = set()
    for j in range(len(nodes) - 1, -1, -1):
        outs = [o for o in nodes[j].output if o]
        needed = [o for o in outs if o in outputs - witness_out or any(r not in only for r in readers.get(o, []))]
        if outs and not needed and any(o in witness_out or readers.get(o) for o in outs):
            only.add(j)
    return only


HALF = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def trigger(
    dtype: int,
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    """An fp16 (``dtype``) initializer read by one Add of a graph input (nodes, initializers, inputs, outputs).

    ORT 1.32 optimizes a graph once more at its default loop level only when it folded an fp16 initializer into an
    fp32 reader (FuseFp16InitializerToFp32NodeTransformer, its level 4), and fusions that need that second pass
    (QuickGelu of a SiLU computed in fp32) follow from it: a graph of fp16 weights always has such an initializer,
    the same graph with its weights as inputs may not. This one stands in for them; ``stitch`` drops it."""
    c = helper.make_tensor(f"trigger{WITNESS}_c", dtype, [1], [0.0])
    node = helper.make_node("Add", [c.name, f"trigger{WITNESS}_in"], [f"trigger{WITNESS}"])
    io = [helper.make_tensor_value_info(n, dtype, [1]) for n in (f"trigger{WITNESS}_in", f"trigger{WITNESS}")]
    return [node], [c], io[:1], io[1:]


def unwitnessed(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without its witness (``witness_copy``): the nodes only it needs, its inputs and outputs."""
    drop = witness_nodes(model)
    if not drop:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    kept = [n for j, n in enumerate(g.node) if j not in drop]
    del g.node[:]
    g.node.extend(kept)
    outs = [o for o in g.output if not o.name.endswith(WITNESS)]
    del g.output[:]
    g.output.extend(outs)
    read = {i for n in kept for i in n.input}
    ins = [i for i in g.input if WITNESS not in i.name or i.name in read]
    del g.input[:]
    g.input.extend(ins)
    return m


def outside_readers(
    g: onnx.GraphProto, again: list[onnx.NodeProto], start: int, stop: int, types: dict[str, onnx.ValueInfoProto]
) -> tuple[list[onnx.NodeProto], list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    """Witnesses (nodes, inputs, outputs) for the tensors a segment computes again (``again``) that other nodes of
    the whole graph read: for each, a copy of the first such reader, its other inputs graph inputs of their types.
    Recomputed alone, a tensor has only the readers in the segment, and ORT simplifies what the whole graph keeps
    (Shape of a Cast of the pixels read by the ViT's Conv: Shape of the pixels, measured, ORT 1.32)."""
    inside = {id(n) for n in again} | {id(n) for n in g.node[start:stop]}
    made = {o for n in again for o in n.output if o}
    inits = {t.name: t for t in g.initializer}
    nodes, inputs, outputs, names = [], [], [], {}
    for t in sorted(made):
        reader = next((n for n in g.node if id(n) not in inside and t in n.input), None)
        if reader is None or any(o and o not in types for o in reader.output):
            continue
        fresh = [i for i in reader.input if i and i != t and i not in names]
        if any(i not in inits and i not in types for i in fresh):
            continue
        for i in dict.fromkeys(fresh):
            v = input_like(inits[i]) if i in inits else onnx.ValueInfoProto()
            if i not in inits:
                v.CopyFrom(types[i])
            v.name = names[i] = f"{i}_r{WITNESS}_in"
            inputs.append(v)
        w = onnx.NodeProto()
        w.CopyFrom(reader)
        w.name = f"{reader.name}_r{WITNESS}" if reader.name else ""
        w.input[:] = [i if i == t else names.get(i, i) for i in reader.input]
        w.output[:] = [f"{o}_r{WITNESS}" if o else "" for o in reader.output]
        nodes.append(w)
        for o in reader.output:
            if o:
                v = onnx.ValueInfoProto()
                v.CopyFrom(types[o])
                v.name = f"{o}_r{WITNESS}"
                outputs.append(v)
    return nodes, inputs, outputs


def recomputed(g: onnx.GraphProto, start: int, wanted: set[str]) -> list[onnx.NodeProto]:
    """The nodes before ``start`` that make ``wanted`` from the graph inputs and constants, in graph order."""
    producer = {o: k for k, n in enumerate(g.node[:start]) for o in n.output if o}
    todo, take = list(wanted), set()
    while todo:
        k = producer.get(todo.pop(), -1)
        if k >= 0 and k not in take:
            take.add(k)
            todo += list(g.node[k].input)
    return [g.node[k] for k in sorted(take)]


def input_like(t: onnx.TensorProto) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
