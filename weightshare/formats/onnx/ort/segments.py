"""ONNX Runtime's level-ALL optimization of a large model, segment by segment, in bounded memory.

Run on the whole graph, ORT's NCHWc transformer holds every reordered Conv weight (and the
transient copies it makes while reordering) until the session ends: a 1 GiB Conv model peaked at
~1.5 GiB. Here the graph is cut into consecutive segments of at most ``budget`` weight bytes (one
node heavier than that is a segment of its own), each optimized in its own session, and the
optimized segments are stitched into one graph.

Exactness: a cut must not change what ORT builds. ORT's fusions depend on facts about the whole graph
(how many nodes read a tensor; which nodes read the same inputs, which its common-subexpression
elimination merges), so a segment must see every reader of what it reads and makes: no graph input
or weight is read on both sides of a cut, and a tensor made in one segment is read by that segment
and the next one only (``locality``). Cuts go only before a weight-bearing node where
exactly one tensor crosses, or a few that the segment before the cut makes (a transformer layer
boundary: the residual stream and the branch added to it), each of a known element type (``plan``).
A cut whose check fails is first moved earlier (up to ``MAX_ALTERNATIVES`` places, back to the weight-bearing node
before it: a DynamicQuantizeLinear then stays with the MatMulInteger it fuses into).
Where a cut runs through an NCHWc region, the two halves
end in ``ReorderOutput`` and start with ``ReorderInput``; the stitch wires the NCHWc tensor
through instead, which is what the whole-graph optimizer builds, and the later segment reads its
input through a stand-in that ORT makes NCHWc, as the whole graph would have it (``extract``).
Everything else is checked, not assumed: for every cut, the two segments around it are optimized
together in one session and the result must equal the stitched pair node for node (op, domain,
attributes, wiring, initializer bytes: ``fingerprint``). A cut that fails the check is removed
(its segments merged) and the report says so; any failure of the cutting itself falls back to
the whole-graph session. A cut is first checked on segments optimized by sessions that save no weights
(``Segmenter.probe``): one that fails there costs none of the sessions that write a segment's weights and packed
copies; where it holds, those sessions run and the check is made again on what they made. What this leaves
unchecked is an optimizer whose effect reaches further than one whole segment on each side of a cut.

Context: a transformer's layers all read tensors the graph inputs alone make (a decoder's attention mask,
rotary tables; a ViT's mask), which no cut could hand over. Each segment computes them again from the inputs and
holds witnesses of the whole graph's other readers (``context``); the stitch keeps one copy (``_merge_context``).
Checked, not assumed: the whole graph in one session with every weight a graph input (it holds no weight)
against the stitch of the segments optimized alike (``Segmenter.context_differs``), node for node; any difference
puts the graph back in one piece. With context, the residual stream may also pass over one segment, made and
read by weight-free nodes (the Adds or norms after a layer's attention and after its MLP), so that an MLP larger
than the budget is cut between its projections; that check, not the pair checks, sees it as the whole graph does.

Memory (measured, ORT 1.32): about 90 MiB + the weights of two adjacent segments + ~3x the
largest Conv weight (ORT's transient copies while reordering one), whatever the model's size.
"""

from __future__ import annotations

import errno
import hashlib
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
from onnx import helper

from ...._checksum import new_hasher
from .context import (
    HALF,
    WITNESS,
    hoist_context,
    input_like,
    outside_readers,
    recomputed,
    shared_constants,
    trigger,
    unwitnessed,
    witness_copy,
    witness_nodes,
)
from .limits import BUDGET_ENV as BUDGET_ENV  # the tests and benches set it through this module
from .names import INSERTED_CAST, apply_saved_hook  # ORT's name for the Casts it puts around fp16/bf16 ops
from .types import at_default

# a disk or quota that is full: the cutting's files did not fit, the whole graph's would not either, and it would
# trade the child's memory bound for nothing
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)

NCHWC = "com.microsoft.nchwc"

Optimizer = Callable[[str, str, str], None]  # (model path, optimized model path, its external data file name)


def _tensor_bytes(t: onnx.TensorProto) -> int:
    """Payload size without reading it (an estimate for packed 4-bit types; 0 for strings)."""
    length = next((e.value for e in t.external_data if e.key == "length"), "")
    if length.isdigit():
        return int(length)
    n = 1
    for d in t.dims:
        n *= d
    try:
        return n * int(helper.tensor_dtype_to_np_dtype(t.data_type).itemsize)
    except (KeyError, TypeError, ValueError):
        return 0


@dataclass
class Plan:
    """Where the cuts go: segment k is ``graph.node[bounds[k]:bounds[k + 1]]``."""

    bounds: list[int]
    weights: list[int]  # weight bytes per node
    reason: str = ""  # why the graph stays in one piece, when it does
    # cut -> other places for it, tried in order when its pair check fails: earlier, back to the node after
    # the weight-bearing node before it (quantized MatMuls: the DynamicQuantizeLinear in front of them fuses
    # with them, so the cut goes before it)
    alternatives: dict[int, list[int]] = field(default_factory=dict)
    heavy: int = 65536  # initializers from this size on are weights (``_spanned``, ``locality``)
    reach: bool = False  # the residual stream may pass over a segment (``_passes_over``)

    def segment_bytes(self, k: int) -> int:
        return sum(self.weights[self.bounds[k] : self.bounds[k + 1]])


def _refusal(graph: onnx.GraphProto) -> str:
    """Why this graph is not cut at all ("" when it can be)."""
    if graph.sparse_initializer:
        return "sparse initializers"
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    for node in graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return f"{node.op_type} node with a subgraph"
        if any(i not in known for i in node.input):
            return "nodes not in topological order"
        known.update(node.output)
    produced = {o for n in graph.node for o in n.output}
    if any(o.name not in produced or not o.type.tensor_type.elem_type for o in graph.output):
        return "a graph output that no node produces, or of unknown type"
    return ""


def plan(
    graph: onnx.GraphProto,
    budget: int,
    typed: dict[str, onnx.ValueInfoProto],
    context: frozenset[str] = frozenset(),
    reach: bool = False,
) -> Plan:
    """Greedy cuts: before a weight-bearing node, once the segment would grow past ``budget``, where
    exactly one tensor (besides graph inputs and initializers) flows from before the cut to after it,
    or a few that the segment before the cut makes (``_cuttable``).

    Why one: everything the later segment learns about the earlier ones then comes through that
    tensor, produced in the segment right before the cut, so the pair check sees every node that
    can shape what ORT makes of the cut. A tensor reaching over a whole segment (a long skip
    connection) would escape it: with two crossing tensors, a residual Add's other input arrives
    as a plain graph input, and ORT does not fuse it into the Conv the way it does in the whole
    graph (measured). A segment starts with a weight-bearing node (a Conv re-decides its layout),
    so fusions that run forward from a node (Conv+BN/Add/Relu, MatMul+Add) stay inside.
    ``typed``: the tensors whose element type is known (``tensor_types``; the cut tensor becomes a segment input).
    ``context``: tensors derived from the graph inputs alone (``hoist_context``), handed to every segment that reads
    them: they do not count as crossing a cut. ``reach`` (with context): the residual stream may pass over a
    segment (``_passes_over``), and an over-full segment is cut at its latest place that splits no activation's
    readers (``Segmenter._with_context`` takes that plan where its largest segment is smaller).
    """
    inits = {t.name: _tensor_bytes(t) for t in graph.initializer}
    weights = [sum(inits.get(i, 0) for i in _reads(n)) for n in graph.node]
    reason = _refusal(graph)
    if not reason and sum(weights) <= budget:
        reason = f"within the {budget / 2**20:.1f} MiB segment budget"
    if reason:
        return Plan([0, len(graph.node)], weights, reason)
    heavy = heavy_bytes(budget)
    consts = constants(graph)
    last_use = {
        name: k
        for k, node in enumerate(graph.node)
        for name in node.input
        if name not in consts and name not in context
    }
    outputs = {o.name for o in graph.output}
    made = {o: k for k, node in enumerate(graph.node) for o in node.output}
    spanned = _spanned(graph, heavy)
    bounds, size, live = [0], 0, set[str]()
    crossings: list[list[str]] = []  # by node: the tensors a cut before it would hand over
    alternatives: dict[int, list[int]] = {}
    last_big = -1
    bigs = [max((inits.get(i, 0) for i in n.input), default=0) >= heavy for n in graph.node]
    readers: dict[str, list[int]] = {}
    for k, node in enumerate(graph.node):
        for name in node.input:
            readers.setdefault(name, []).append(k)

    # with context only (its whole-graph check compares the stitch with ORT's whole graph): the residual stream
    # between two weight-free nodes may pass over the segment between them (``_passes_over``)
    def cuttable(q: int, start: int) -> bool:
        def passes(t: str) -> bool:
            return reach and bool(context) and _passes_over(t, q, start, bounds, made, readers, bigs)

        return q not in spanned and _cuttable(crossings[q], typed, made, start, passes)

    def splits(q: int, start: int) -> bool:
        """Whether a weight-bearing node before ``q`` in the segment and one from ``q`` on read the same
        tensor (two projections of one activation): ORT handles such a tensor by its readers (the fp16
        activation's inserted Cast), which a cut between them divides; a place that splits none comes first."""
        return any(
            any(start <= r < q and bigs[r] for r in readers.get(t, ())) and any(r >= q and bigs[r] for r in readers[t])
            for t in crossings[q]
        )

    for p, node in enumerate(graph.node):
        big = bigs[p]
        crossing = [t for t in live if last_use.get(t, -1) >= p or t in outputs]
        crossings.append(crossing)
        at = -1
        if p > bounds[-1] and big and size + weights[p] > budget:
            start = bounds[-1]
            at = p if cuttable(p, start) else -1
            if reach and context:  # the latest place in the segment that splits no activation's readers, if any
                fits = (q for q in range(p, start, -1) if bigs[q] and cuttable(q, start) and not splits(q, start))
                at = next(fits, at)
        if 0 <= at < p:
            bounds.append(at)
            size = sum(weights[at:p])
        elif at == p:
            # where a failing cut moves: back towards the last weight-bearing node, and past it to a place where
            # only integer tensors cross (a QDQ graph's quantized activations: each DequantizeLinear stays with
            # the nodes it feeds, so ORT fuses them as in the whole graph), those first
            back = range(p - 1, max(start, p - ALTERNATIVE_REACH), -1)
            # (past it only while the segment from there stays within the budget: a mask's bool input before a whole
            # layer is no quantized activation)
            places = [
                q
                for q in back
                if q > last_big or (_integral(crossings[q], typed) and sum(weights[q : p + 1]) <= budget)
            ]
            places = [q for q in places if cuttable(q, start)]
            places.sort(key=lambda q: not _integral(crossings[q], typed))
            cut = p
            if places and _integral(crossings[places[0]], typed) and not _integral(crossing, typed):
                cut = places.pop(0)  # straight to where only quantized tensors cross: no failing check first
                places = [q for q in places if q < cut]
            bounds.append(cut)
            size = sum(weights[cut:p])
            alternatives[cut] = _distinct([cut, *places[:MAX_ALTERNATIVES]], graph)[1:]
        if big:
            last_big = p
        size += weights[p]
        live = {t for t in live if last_use.get(t, -1) > p or t in outputs} | (set(node.output) - set(consts) - context)
    bounds.append(len(graph.node))
    alternatives = {p: a for p, a in alternatives.items() if a}
    return Plan(bounds, weights, alternatives=alternatives, heavy=heavy, reach=reach and bool(context))


def _largest(p: Plan) -> int:
    return max(p.segment_bytes(k) for k in range(len(p.bounds) - 1))


def _distinct(places: list[int], graph: onnx.GraphProto) -> list[int]:
    """``places`` (a cut and where it moves, in the order tried) without a place right before a Constant node of
    no inputs whose next place was tried before it: the two cuts differ only by that node's side, and a segment
    holds its own copy of each constant it reads (``extract``), so ORT is given the same segments (BART's decoder:
    its cut moved from before the position Add to before its Constant, checked again for nothing)."""
    tried = set()
    kept = []
    for q in places:
        node = graph.node[q]
        if not (node.op_type == "Constant" and not node.domain and not node.input and q + 1 in tried):
            kept.append(q)
        tried.add(q)
    return kept


def heavy_bytes(budget: int) -> int:
    """Initializers from this size on are weights to the plan (``_spanned``, ``locality``, ``hoist_context``)."""
    return min(65536, max(budget // 8, 1))


def _small(graph: onnx.GraphProto, heavy: int) -> set[str]:
    """Constants that are not weights: initializers under ``heavy`` bytes and Constant nodes' outputs."""
    return {t.name for t in graph.initializer if _tensor_bytes(t) < heavy} | set(constants(graph))


def _spanned(graph: onnx.GraphProto, heavy: int) -> set[int]:
    """Places a cut must not go (before node p): where a graph input or a weight (an initializer of ``heavy``
    bytes or more) is read both before and after. ORT sees such a tensor's readers together only in the whole
    graph: there its common-subexpression elimination merges the identical nodes among them (and a fusion
    after them then sees other consumer counts), and a tied weight read by MatMul and Gemm is one tensor."""
    shared = {i.name for i in graph.input} | {t.name for t in graph.initializer if _tensor_bytes(t) >= heavy}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for k, node in enumerate(graph.node):
        for name in _reads(node) & shared:
            first.setdefault(name, k)
            last[name] = k
    return {p for name, k in first.items() for p in range(k + 1, last[name] + 1)}


def locality(
    graph: onnx.GraphProto, bounds: list[int], heavy: int, context: frozenset[str] = frozenset(), reach: bool = False
) -> str:
    """Why ORT's optimization of these segments may not be its optimization of the whole graph ("" when every
    fact its decisions read is inside one pair of adjacent segments, which the pair check optimizes together):
    a graph input or a weight read by two segments, or a tensor read by a segment other than the one that makes
    it and the next. ``context`` (``hoist_context``): tensors of the graph inputs every segment may read, whose
    readers' optimization the context windows check against the whole graph; ``reach``: a tensor that no
    weight-bearing node makes or reads may also be read two segments on, none reading it in between
    (``_passes_over``)."""
    shared = {i.name for i in graph.input} | {t.name for t in graph.initializer if _tensor_bytes(t) >= heavy}
    segment_of = [k for k in range(len(bounds) - 1) for _ in range(bounds[k], bounds[k + 1])]
    consts = constants(graph)  # each segment has its own copy (``extract``), as of a small initializer
    made: dict[str, int] = {}
    readers: dict[str, set[int]] = {}
    # tensors no weight-bearing node makes or reads: with ``reach``, one may pass over a segment (``_passes_over``)
    big = {t.name for t in graph.initializer if _tensor_bytes(t) >= heavy}
    heavy_io = {o for n in graph.node if _reads(n) & big for o in [*n.input, *n.output]}
    light = {o for n in graph.node for o in n.output if o and o not in heavy_io}
    for p, node in enumerate(graph.node):
        for name in _reads(node) - set(consts):
            readers.setdefault(name, set()).add(segment_of[p])
        made.update({o: segment_of[p] for o in node.output if o})
    for name, where in readers.items():
        if name in shared and len(where) > 1:
            return f"the graph input or weight {name!r} would be read in {len(where)} segments"
        k = made.get(name, -1)
        if name in made and name not in context and not where <= {k, k + 1}:
            if not (reach and context and name in light and where <= {k, k + 2} and k + 1 not in where):
                return f"{name!r} would be read beyond the segment after the one that makes it"
    # nodes that read only what every segment has (initializers, constants, graph inputs, such nodes' outputs):
    # identical ones in two segments are one node in the whole graph (common-subexpression elimination)
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | set(constants(graph)) | {""}
    known |= context
    twins: dict[Any, int] = {}
    for p, node in enumerate(graph.node):
        if node.op_type == "Constant" or not all(i in known for i in _reads(node)):
            continue
        known.update(node.output)
        key = (node.op_type, node.domain, sorted(a.SerializeToString() for a in node.attribute), list(node.input))
        if twins.setdefault(repr(key), segment_of[p]) != segment_of[p]:
            return f"identical {node.op_type} nodes of the graph's inputs and constants would be in two segments"
    return ""


def sink_weight_producers(graph: onnx.GraphProto) -> None:
    """Move each node that reads only initializers (a QDQ model's DequantizeLinear of a weight; quantizers
    put them all first) to just before the first node that reads it, so that a weight sits next to the node
    that uses it and the graph has places to cut between layers. A topological order still; subgraph-holding
    nodes and Constants stay where they are."""
    inits = {t.name for t in graph.initializer} | {""}
    nodes = list(graph.node)
    movable = {
        k
        for k, n in enumerate(nodes)
        if n.input
        and n.op_type != "Constant"
        and all(i in inits for i in n.input)
        and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)
    }
    if not movable:
        return
    first_reader: dict[str, int] = {}
    for k, n in enumerate(nodes):
        for i in _reads(n):
            first_reader.setdefault(i, k)
    before: dict[int, list[int]] = {}
    for k in sorted(movable):
        readers = [first_reader[o] for o in nodes[k].output if o in first_reader]
        at = min(readers) if readers else k
        before.setdefault(max(at, k), []).append(k)
    order = []
    for k in range(len(nodes)):
        order += before.get(k, [])
        if k not in movable:
            order.append(k)
    if order != list(range(len(nodes))):
        del graph.node[:]
        graph.node.extend(nodes[k] for k in order)


HEAVY_BYTES = 65536  # a window's initializers from this size on are weights: their values shape no decision of ORT
EXACT_FLOATS = 16  # float initializers up to this many elements are constants whose values ORT's fusions test
MAX_ALTERNATIVES = 2  # other places tried for a cut whose pair check fails, before its segments are merged
ALTERNATIVE_REACH = 32  # how many nodes back such a place may lie
FLOATS = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
)


def _integral(crossing: list[str], typed: dict[str, onnx.ValueInfoProto]) -> bool:
    """Whether every tensor of ``crossing`` has a known integer element type (quantized activations)."""
    return bool(crossing) and all(t in typed and typed[t].type.tensor_type.elem_type not in FLOATS for t in crossing)


MAX_CROSSING = 4  # tensors a cut may hand over (a pre-norm transformer layer boundary: the residual and a branch)


def _cuttable(
    crossing: list[str],
    typed: dict[str, onnx.ValueInfoProto],
    made: dict[str, int],
    start: int,
    passes: Callable[[str], bool] | None = None,
) -> bool:
    """Whether a cut may hand ``crossing`` to the next segment: one tensor, or a few (transformer layers: the
    residual stream next to the attention or MLP branch it is added to, so that the Add and the norm after it
    stay together and fuse as in the whole graph), each of a known element type. Several only when every one
    is made in the segment that ends at the cut (starting at node ``start``): then the pair check, which
    optimizes that segment and the next together, sees every node that makes a crossing tensor; a tensor
    from further back (a long skip connection) would reach the later segment unseen, unless ``passes`` says it
    passes over the segment (``_passes_over``)."""
    if not crossing or len(crossing) > MAX_CROSSING or any(t not in typed for t in crossing):
        return False
    return len(crossing) == 1 or all(made.get(t, -1) >= start or (passes and passes(t)) for t in crossing)


def _passes_over(
    t: str, q: int, start: int, bounds: list[int], made: dict[str, int], readers: dict[str, list[int]], bigs: list[bool]
) -> bool:
    """Whether ``t``, crossing a cut before node ``q`` that ends the segment starting at ``start``, is the residual
    stream passing over that segment: made in the segment before it, read by none of its nodes, and neither its
    maker nor any reader holds a weight (the Add or norm after one layer's attention and the one after its MLP).
    What ORT makes of such a tensor depends on no weight's values, so the context check, ORT's whole graph with
    every weight an input against the segments stitched, sees it as the whole graph has it
    (``Segmenter.context_differs``); a weight-bearing maker or reader (a Conv fusing the residual Add) would not
    be seen there."""
    k = made.get(t, -1)
    return (
        len(bounds) >= 2
        and bounds[-2] <= k < start
        and not bigs[k]
        and not any(start <= r < q for r in readers.get(t, ()))
        and not any(bigs[r] for r in readers.get(t, ()))
    )


def _reads(node: onnx.NodeProto) -> set[str]:
    """The tensors ``node`` reads, its subgraphs' outer-scope reads included (a merged decoder's If reads
    every weight through its branches)."""
    names = set(node.input)
    for a in node.attribute:
        for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
            for n in g.node:
                names |= _reads(n)
    return names


def constants(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """Outputs of input-less Constant nodes: like initializers, each segment gets its own copy."""
    return {
        n.output[0]: n for n in graph.node if n.op_type == "Constant" and not n.input and n.domain in ("", "ai.onnx")
    }


STANDIN = "__weightshare_standin"


def extract(
    model: onnx.ModelProto,
    start: int,
    stop: int,
    types: dict[str, onnx.ValueInfoProto],
    standin: frozenset[str] = frozenset(),
    as_inputs: frozenset[str] = frozenset(),
    context: frozenset[str] = frozenset(),
    witness: frozenset[str] | None = None,
) -> onnx.ModelProto:
    """``graph.node[start:stop]`` as a model: earlier tensors it reads become inputs, tensors later nodes
    (or the graph's outputs) read become outputs. Initializers keep their external data references, except those in
    ``as_inputs``: graph inputs of their type and shape (weights ORT must not see as constants: a context window).
    ``context`` (``hoist_context``): tensors of the graph inputs that the segment computes again from them (the
    nodes that make them, copied in front), as the whole graph has them, rather than reading them as inputs.
    ``witness``: when given, the constants other segments read too (``shared_constants``); the segment then holds a
    copy of its own nodes that reads them and the context as a second layer would (``context.witness_copy``).

    ``standin``: inputs that the whole-graph optimizer would see in NCHWc layout (the segment before
    ends them with a ReorderOutput). Each is read through an identity MaxPool (1x1) that ORT turns
    into an NCHWc node, so that the nodes reading it decide as they would in the whole graph (an
    Add after a Conv fuses into it only when its other input is NCHWc); ``stitch`` removes it.
    """
    g = model.graph
    consts = constants(g)
    nodes = list(g.node[start:stop])
    here = {o for n in nodes for o in n.output}
    read = {i for n in nodes for i in n.input if i}
    foreign = {id(consts[i]) for i in read if i in consts and i not in here}  # copies, not the segment's own
    extra: tuple[list[onnx.NodeProto], list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]] | None = None
    nodes = [consts[i] for i in sorted(read) if i in consts and i not in here] + nodes
    if context and read & context - here:
        again = recomputed(g, start, read & context - here)
        foreign |= {id(n) for n in again}
        nodes = again + nodes
        if witness is not None:
            extra = outside_readers(g, again, start, stop, types)
        here = {o for n in nodes for o in n.output}
        read = {i for n in nodes for i in n.input if i}
    own = [n for n in nodes if id(n) not in foreign]
    produced = {o for n in nodes for o in n.output if o}
    if standin:
        rewired = []
        for n in nodes:
            n2 = onnx.NodeProto()
            n2.CopyFrom(n)
            n2.input[:] = [f"{i}{STANDIN}" if i in standin else i for i in n.input]
            rewired.append(n2)
        nodes = [helper.make_node("MaxPool", [t], [f"{t}{STANDIN}"], kernel_shape=[1, 1]) for t in sorted(standin)]
        nodes += rewired
    later = {i for n in g.node[stop:] for i in n.input if i not in consts and i not in context}
    later |= {o.name for o in g.output}
    inits = [t for t in g.initializer if t.name in read and t.name not in as_inputs]
    overridable = {i.name for i in g.input}
    init_names = {t.name for t in g.initializer}
    inputs = [types[i] for i in sorted(read - produced) if i not in init_names or i in overridable]
    inputs += [input_like(t) for t in g.initializer if t.name in read and t.name in as_inputs - overridable]
    outputs = [types[o] for o in sorted(produced & later)]
    if extra is not None:
        nodes, inputs, outputs = nodes + extra[0], inputs + extra[1], outputs + extra[2]
    if witness is not None:
        keep = witness | context | {i.name for i in g.input} | {""}
        elsewhere: dict[str, set[tuple[str, str]]] = {}  # tensor -> the ops reading it outside the segment
        for n in [*g.node[:start], *g.node[stop:]]:
            for i in n.input:
                elsewhere.setdefault(i, set()).add((n.op_type, n.domain))
        copy = witness_copy(own, keep, types, {t.name: t for t in g.initializer}, outputs, elsewhere)
        if copy is not None:
            nodes, inputs, outputs = nodes + copy[0], inputs + copy[1], outputs + copy[2]
    half = [t.data_type for t in g.initializer if t.name in as_inputs and t.data_type in HALF]
    if half:  # weights made inputs: ORT's second pass as with them (``context.trigger``)
        extra_nodes, extra_inits, extra_in, extra_out = trigger(half[0])
        nodes, inits = nodes + extra_nodes, inits + extra_inits
        inputs, outputs = inputs + extra_in, outputs + extra_out
    value_info = [v for v in g.value_info if v.name in produced - later]
    graph = helper.make_graph(nodes, f"{g.name}[{start}:{stop}]", inputs, outputs, inits, value_info=value_info)
    m = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    m.functions.extend(model.functions)
    return m


def tensor_types(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Element types (and shapes where ONNX infers them) of every tensor, without loading weights."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # noqa: BLE001 - shapes are a help, not a need: untyped tensors are simply not cut at
        inferred = model.graph
    types = {}
    for v in [*inferred.value_info, *inferred.input, *inferred.output]:
        if v.type.tensor_type.elem_type:
            types[v.name] = v
    return types


# ---------------------------------------------------------------- stitching


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def stitch(
    parts: list[onnx.ModelProto],
    inputs: Iterable[onnx.ValueInfoProto],
    outputs: Iterable[onnx.ValueInfoProto],
    name: str = "stitched",
    standins: list[frozenset[str]] | None = None,
    directory: Path | None = None,
    context: frozenset[str] = frozenset(),
) -> onnx.ModelProto:
    """Optimized segments, in order, as one graph; names each segment made up are kept apart. ``directory``: where
    the parts' external data lies (equal small constants are found by their bytes). ``context``: tensors of the graph
    inputs that several segments read (``hoist_context``); identical nodes of them are one (``_merge_context``).

    A tensor a segment passes on in NCHW (``ReorderOutput``) that the next one turns back into
    NCHWc (``ReorderInput``) is passed on in NCHWc instead: the whole-graph optimizer leaves no
    such pair inside an NCHWc region. ``standins[k]``: the inputs of part k read through a stand-in
    (``extract``), which is taken out.
    """
    boundary = {v.name for p in parts for v in [*p.graph.input, *p.graph.output]}
    taken, node_names = set(boundary), set()
    nodes, inits, value_info = [], [], []
    init_names: set[str] = set()
    part_index: dict[int, int] = {}  # id(node) -> its segment
    for k, part in enumerate(parts):
        # a segment's outputs (read by later segments) and inputs (an overridable initializer is both an
        # input and an initializer) keep their names; anything else it defines is renamed on a clash
        keep = {v.name for v in [*part.graph.input, *part.graph.output]}
        defined = [t.name for t in part.graph.initializer] + [o for n in part.graph.node for o in n.output if o]
        rename = {}
        for d in defined:
            if d in keep:
                continue
            new, i = d, 0
            while new in taken:
                i += 1
                new = f"{d}__s{k}_{i}"
            taken.add(new)
            rename[d] = new
        for t in part.graph.initializer:
            t2 = onnx.TensorProto()
            t2.CopyFrom(t)
            t2.name = rename.get(t.name, t.name)
            if t2.name not in init_names:  # an overridable initializer read by several segments: once
                init_names.add(t2.name)
                inits.append(t2)
        drop, aliases = _standin_aliases(part, standins[k] if standins else frozenset())
        drop |= witness_nodes(part)
        for j, n in enumerate(part.graph.node):
            if j in drop:
                continue
            n2 = onnx.NodeProto()
            n2.CopyFrom(n)
            n2.input[:] = [rename.get(i, i) for i in (aliases.get(i, i) for i in n.input)]
            n2.output[:] = [rename.get(o, o) for o in n.output]
            base, i = n2.name or n2.op_type, 0
            while n2.name in node_names or not n2.name:
                i += 1
                n2.name = f"{base}__s{k}_{i}"
            node_names.add(n2.name)
            nodes.append(n2)
            part_index[id(n2)] = k
        for v in part.graph.value_info:
            if v.name not in keep:
                v2 = onnx.ValueInfoProto()
                v2.CopyFrom(v)
                v2.name = rename.get(v.name, v.name)
                value_info.append(v2)
    outputs = list(outputs)
    inputs = list(inputs)
    nodes = _splice_reorders(nodes, boundary, {o.name for o in outputs})
    nodes = _splice_casts(nodes, boundary, {o.name for o in outputs})
    nodes = _merge_casts(nodes, inits, {o.name for o in outputs}, directory)
    if context:
        part_of = [part_index[id(n)] for n in nodes]
        nodes = _merge_context(nodes, part_of, inits, {i.name for i in inputs}, {o.name for o in outputs}, directory)
    read = {i for n in nodes for i in n.input}
    inits = [t for t in inits if t.name in read or t.name in {i.name for i in inputs}]
    made = {o for n in nodes for o in n.output}
    value_info = [v for v in value_info if v.name in made]
    graph = helper.make_graph(nodes, name, list(inputs), outputs, inits, value_info=value_info)
    opsets: dict[str, int] = {}
    for part in parts:
        for o in part.opset_import:
            opsets[o.domain] = max(opsets.get(o.domain, 0), o.version)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
        ir_version=max(p.ir_version for p in parts),
    )
    seen = set()
    for part in parts:
        for f in part.functions:
            if (f.domain, f.name) not in seen:
                seen.add((f.domain, f.name))
                model.functions.append(f)
    return model


def _standin_aliases(part: onnx.ModelProto, standin: frozenset[str]) -> tuple[set[int], dict[str, str]]:
    """The stand-in MaxPools of ``part`` (indices of nodes to drop) and what their outputs stand for: the
    NCHWc tensor ORT reordered the input into, or the input itself where ORT kept it in NCHW."""
    if not standin:
        return set(), {}
    nodes = part.graph.node
    reorder = {n.output[0]: n.input[0] for n in nodes if n.domain == NCHWC and n.op_type == "ReorderInput"}
    drop, aliases = set(), {}
    for j, n in enumerate(nodes):
        if n.op_type != "MaxPool" or not n.input or _attr(n, "kernel_shape", None) != [1, 1]:
            continue
        # nothing else in the segment reads these inputs (extract rewired their readers to the stand-in)
        if n.input[0] in standin or reorder.get(n.input[0]) in standin:
            drop.add(j)
            aliases[n.output[0]] = n.input[0]
    return drop, aliases


def _splice_reorders(nodes: list[onnx.NodeProto], boundary: set[str], outputs: set[str]) -> list[onnx.NodeProto]:
    def reorder(node: onnx.NodeProto, op: str) -> bool:
        return node.domain == NCHWC and node.op_type == op and _attr(node, "channels_last", 0) == 0

    return _splice(
        nodes, boundary, outputs, lambda n: reorder(n, "ReorderInput"), lambda n: reorder(n, "ReorderOutput")
    )


def _splice(
    nodes: list[onnx.NodeProto],
    boundary: set[str],
    outputs: set[str],
    undo: Callable[[onnx.NodeProto], bool],
    do: Callable[[onnx.NodeProto], bool],
) -> list[onnx.NodeProto]:
    """Where a segment ends in a node ``do`` accepts and the next starts with one ``undo`` accepts on the tensor
    handed over, the readers of the ``undo`` node read what the ``do`` node read; the ``undo`` node goes, and the
    ``do`` node too once nothing reads it (``outputs``: the graph's, always read)."""
    producer = {o: n for n in nodes for o in n.output}
    alias: dict[str, str] = {}
    kept = []
    for n in nodes:
        src = producer.get(n.input[0]) if n.input else None
        if undo(n) and n.input[0] in boundary and src is not None and do(src):
            alias[n.output[0]] = src.input[0]
            continue
        kept.append(n)
    if not alias:
        return nodes
    for n in kept:
        n.input[:] = [alias.get(i, i) for i in n.input]
    read = {i for n in kept for i in n.input} | outputs
    done = {id(producer[i]) for i in boundary if i in producer}
    return [n for n in kept if not (id(n) in done and do(n) and n.output[0] not in read)]


def _inserted_cast(node: onnx.NodeProto, to: int) -> bool:
    return (
        node.op_type == "Cast"
        and node.domain in ("", "ai.onnx")
        and node.name.startswith(INSERTED_CAST)
        and len(node.input) == 1
        and _attr(node, "to", 0) == to
    )


def _splice_casts(nodes: list[onnx.NodeProto], boundary: set[str], outputs: set[str]) -> list[onnx.NodeProto]:
    """A cut through a run of fp16 ops that ORT computes in fp32 (its CPU provider has no fp16 kernel for them):
    the segment before ends in an inserted ``Cast(-> fp16)`` of the fp32 tensor, the segment after starts with an
    inserted ``Cast(-> float)`` of it. The whole graph has neither (the run stays in fp32, no rounding to fp16 in
    between: ORT's InsertCastTransformer casts only at the run's ends), so the readers get the fp32 tensor and
    both Casts go, as NCHWc reorders do (``_splice_reorders``). The pair check compares the result with the two
    segments optimized together, so a splice the whole graph would not make fails that check."""
    return _splice(
        nodes,
        boundary,
        outputs,
        lambda n: _inserted_cast(n, onnx.TensorProto.FLOAT),
        lambda n: _inserted_cast(n, onnx.TensorProto.FLOAT16),
    )


def _content_key(t: onnx.TensorProto, directory: Path | None) -> tuple[Any, ...] | None:
    """What makes two initializers equal: their bytes (inline, or read from the file when small), else the same
    region of one file."""
    if t.data_location == onnx.TensorProto.EXTERNAL:
        e = {x.key: x.value for x in t.external_data}
        where = (e.get("location", ""), int(e.get("offset", "0")), int(e.get("length", "-1")))
        if directory is not None and 0 <= where[2] <= HEAVY_BYTES:
            try:
                with open(directory / where[0], "rb") as f:
                    f.seek(where[1])
                    data = f.read(where[2])
            except OSError:
                return None
            if len(data) == where[2]:
                return ("bytes", t.data_type, tuple(t.dims), data)
        return ("file", t.data_type, tuple(t.dims), *where)
    if t.raw_data:
        return ("bytes", t.data_type, tuple(t.dims), t.raw_data)
    return None


def _merge_casts(
    nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], outputs: set[str], directory: Path | None
) -> list[onnx.NodeProto]:
    """Casts of equal constants in different segments as one: in the whole graph ORT shares equal initializers
    (an untrained model's LayerNorm weights, all ones, become one tensor read by every layer), so the Cast its CPU
    provider inserts in front of them is one node, run once; each segment has its own copy. The pair check
    compares the result with the two segments optimized together."""
    content = {t.name: k for t in inits if (k := _content_key(t, directory)) is not None}
    first: dict[tuple[Any, ...], str] = {}
    alias: dict[str, str] = {}
    kept = []
    for n in nodes:
        key = content.get(n.input[0]) if n.op_type == "Cast" and len(n.input) == 1 else None
        if key is not None and n.output[0] not in outputs:
            key = (key, _attr(n, "to", 0))
            if key in first:
                alias[n.output[0]] = first[key]
                continue
            first[key] = n.output[0]
        kept.append(n)
    return _aliased(nodes, kept, alias)


def _aliased(nodes: list[onnx.NodeProto], kept: list[onnx.NodeProto], alias: dict[str, str]) -> list[onnx.NodeProto]:
    """``kept`` reading each merged output under the name of the one it merged into; ``nodes`` when none was."""
    if not alias:
        return nodes
    for n in kept:
        n.input[:] = [alias.get(i, i) for i in n.input]
    return kept


def _merge_context(
    nodes: list[onnx.NodeProto], part_of: list[int], inits: list[onnx.TensorProto], inputs: set[str],
    outputs: set[str], directory: Path | None,
) -> list[onnx.NodeProto]:  # fmt: skip
    """The nodes each segment computes again from the graph inputs (``extract``'s ``context``) as one, as the whole
    graph computes them once: a node of a later segment identical (op, attributes, inputs: graph inputs by name,
    constants by their bytes, other such nodes' outputs) to one of the first segment that has it. Within one
    segment ORT's own choice stands (it keeps two inserted Casts of one tensor apart). ``part_of``: each node's
    segment. The context windows compare the result with the whole graph optimized by ORT, so a merge the whole
    graph would not make fails that check."""
    ids: dict[str, str] = {i: f"input:{i}" for i in inputs}
    ids.update((t.name, repr(k)) for t in inits if (k := _content_key(t, directory)) is not None)
    ids[""] = ""
    first: dict[str, tuple[int, list[list[str]]]] = {}  # key -> (its first segment, the outputs of each there)
    seen: Counter[tuple[int, str]] = Counter()  # (segment, key) -> how many so far
    alias: dict[str, str] = {}
    kept = []
    for n, part in zip(nodes, part_of, strict=True):
        ins = [alias.get(i, i) for i in n.input]
        if ins and all(i in ids for i in ins) and not any(o in outputs for o in n.output):
            attrs = sorted(a.SerializeToString() for a in n.attribute)
            key = hashlib.sha256(repr((n.op_type, n.domain, attrs, [ids[i] for i in ins])).encode()).hexdigest()
            j = seen[(part, key)]
            seen[(part, key)] += 1
            home, made = first.setdefault(key, (part, []))
            if home != part and j < len(made):
                alias.update(zip(n.output, made[j]))
                continue
            if home == part:
                made.append(list(n.output))
            ids.update((o, f"{key}:{j}:{k}") for k, o in enumerate(n.output) if o)
        kept.append(n)
    return _aliased(nodes, kept, alias)


# ---------------------------------------------------------------- comparing graphs


_digests: dict[tuple[str, int, int], bytes] = {}  # payloads of files that never change (not a window's file)
digested = _digests  # the child's: cleared per model, read for its packing keys (``Sharer.staged_digests``)
REWRITTEN = ("win", "seg", "probe")  # the tags (``Segmenter._tag``, the cut checks') of files rewritten in place


def _digest_payload(t: onnx.TensorProto, directory: Path) -> str:
    """The blob's own checksum (BLAKE3 where installed) of ``t``'s bytes: each segment's payloads are read
    once however many windows they are compared in."""
    head = f"{t.data_type}:{list(t.dims)}:"
    if t.data_location == onnx.TensorProto.EXTERNAL:
        e = {x.key: x.value for x in t.external_data}
        path, offset, length = directory / e["location"], int(e.get("offset", "0")), int(e.get("length", "-1"))
        key = (str(path), offset, length)
        if key in _digests:
            return head + _digests[key].hex()
        h = new_hasher()
        remaining = length
        with open(path, "rb") as f:  # streamed: a segment's weights never sit in memory
            f.seek(offset)
            while remaining != 0:
                chunk = f.read(1 << 20 if remaining < 0 else min(remaining, 1 << 20))
                if not chunk:
                    break
                h.update(chunk)
                remaining -= len(chunk)
        if not any(f".{t}" in path.name for t in REWRITTEN):  # ORT rewrites these under the same name
            _digests[key] = h.digest()
        return head + h.hexdigest()
    # small: whether ORT stored it inline or outside must not matter
    from onnx import numpy_helper

    h = new_hasher()
    h.update(numpy_helper.to_array(t).tobytes())
    return head + h.hexdigest()


def window_references(part: onnx.ModelProto) -> bool:
    """Whether a cut check may save its optimized window without an initializers file: ORT 1.32 then saves each
    external initializer it did not change as its reference (no copy of the two segments' weights beside the staged
    model: the temporary disk of a model whose kernels pack nothing was 1.5x its outputs) and writes what it
    changed inline, in its memory while it serializes. Only where little changes: no Conv (NCHWc reorders every
    Conv weight) and no fp16/bf16 initializer (constant folding casts each)."""
    half = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    return not any(n.op_type == "Conv" for n in part.graph.node) and not any(
        t.data_type in half for t in part.graph.initializer
    )


WHOLE_REFERENCES_BYTES = 1 << 30  # weights up to which a one-piece session saves references (``whole_references``)


def whole_references(model: onnx.ModelProto) -> bool:
    """``window_references`` for the whole graph's one session, subgraphs included: its output then references
    the staged payloads instead of writing every weight again (a second copy of the weights written per model).
    Up to ``WHOLE_REFERENCES_BYTES`` of weights: what ORT changes is serialized inline, in its memory (an fp32
    BERT's Attention fusion concatenates every Q, K and V weight)."""
    graphs, nodes, inits = [model.graph], list[onnx.NodeProto](), list[onnx.TensorProto]()
    while graphs:
        g = graphs.pop()
        nodes += g.node
        inits += g.initializer
        for n in g.node:
            for a in n.attribute:
                graphs += [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
    half = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    return (
        not any(n.op_type == "Conv" for n in nodes)
        and not any(t.data_type in half for t in inits)
        and sum(_tensor_bytes(t) for t in inits) <= WHOLE_REFERENCES_BYTES
    )


def window_shape(
    window: onnx.ModelProto, right: int, standin: frozenset[str], standin_right: frozenset[str], directory: Path
) -> str:
    """What ORT's decisions about a window can depend on, independent of tensor and node names: every node's op,
    domain, attributes, inputs and side of the cut (the last ``right`` nodes are the segment after it), graph inputs
    by type and shape in the order nodes first read them (symbolic dimensions by which are equal), the shapes
    the window gives its inner tensors; initializers: integer ones and floats of up to
    ``EXACT_FLOATS`` elements under ``HEAVY_BYTES`` by their bytes, longer float vectors by type, shape and which of
    them are equal to each other (ORT compares scales, it does not read a bias), weights by type and shape; the
    tensors each side reads in NCHWc (``standin``, ``standin_right``) and the outputs. Weights are numbered in
    the order nodes first read them: a window where two nodes read one weight is not one where they read two
    (ORT's common-subexpression elimination merges identical nodes of one weight; a fusion after them then
    sees two consumers). What lies outside the window cannot change its answer: ``locality`` holds for the
    segments (every reader of a tensor a cut hands over is in the window)."""
    g = window.graph
    inits = {t.name: t for t in g.initializer}
    inputs = {i.name: i for i in g.input}
    ids: dict[str, str] = {"": ""}

    classes: dict[str, int] = {}  # a float vector's digest -> its class: which ones are equal, not their values
    weights: list[str] = []
    symbols: dict[str, int] = {}  # a symbolic dimension's name -> its number here (``_canonical``)

    def ident(name: str) -> str:
        if name not in ids:
            if name in inits:
                t = inits[name]
                if _tensor_bytes(t) >= HEAVY_BYTES:  # numbered: which nodes read the SAME weight (CSE merges them)
                    weights.append(name)
                    ids[name] = f"weight{len(weights)}:{t.data_type}:{list(t.dims)}"
                elif t.data_type in FLOATS and math.prod(t.dims) > EXACT_FLOATS:
                    digest = _digest_payload(t, directory)  # a bias, a per-channel scale
                    ids[name] = f"floats:{t.data_type}:{list(t.dims)}:{classes.setdefault(digest, len(classes))}"
                else:  # scalars (epsilon, exponents, scales), zero points, shapes, axes, indices: their values
                    ids[name] = f"init:{_digest_payload(t, directory)}"
            elif name in inputs:
                ids[name] = f"input{len(ids)}:{_canonical(inputs[name].type, symbols)}"
            else:
                ids[name] = f"unknown:{name}"  # not from this window: never equal to another window's
        return ids[name]

    first_right = len(g.node) - right
    h = hashlib.sha256()
    for j, n in enumerate(g.node):
        attrs = sorted(a.SerializeToString() for a in n.attribute)
        side = "R" if j >= first_right else "L"
        node = hashlib.sha256(repr((side, n.op_type, n.domain, attrs, [ident(i) for i in n.input])).encode())
        h.update(node.digest())
        for k, o in enumerate(n.output):
            ids[o] = f"{node.hexdigest()}:{k}"
    typed = {v.name: v.type for v in g.value_info}  # shapes ORT reads inside the window, numbered alike
    inner = [(ids[o], _canonical(typed[o], symbols)) for n in g.node for o in n.output if o in typed]
    h.update(repr(inner).encode())
    ends = (sorted(ident(o.name) for o in g.output), sorted(ident(t) for t in standin))
    h.update(repr((*ends, sorted(ident(t) for t in standin_right))).encode())
    return h.hexdigest()


def _canonical(t: onnx.TypeProto, symbols: dict[str, int]) -> str:
    """``t`` with each symbolic dimension named by the order it first appears in a window (``symbols``): shape
    inference names unknown dimensions one by one ("unk__4" in one layer, "unk__13" in the next), while ORT reads
    only which of them are equal, so a window of one layer is a window of the next."""
    c = onnx.TypeProto()
    c.CopyFrom(t)
    for d in c.tensor_type.shape.dim:
        if d.HasField("dim_param"):
            d.dim_param = f"s{symbols.setdefault(d.dim_param, len(symbols))}"
    return c.SerializeToString().hex()


def fingerprint(model: onnx.ModelProto, directory: Path) -> tuple[Counter[str], list[str]]:
    """What a graph computes, independent of tensor and node names: every node as a hash of its op,
    domain, attributes (those at their schema's default left out) and (recursively) its inputs; initializers by
    their bytes."""
    g = model.graph
    ids = {i.name: f"input:{i.name}" for i in g.input}
    live = _live(g)
    for t in g.initializer:
        if t.name in live.inputs:
            ids.setdefault(t.name, f"init:{_digest_payload(t, directory)}")
    ids[""] = ""
    nodes: Counter[str] = Counter()
    opsets = {o.domain or "": o.version for o in model.opset_import}
    for j, n in enumerate(g.node):
        if j not in live.nodes:
            continue
        # an attribute at its schema's default is left out: ORT's save routes differ in writing it (``at_default``)
        defaults = at_default(n, opsets) if n.attribute else set()
        attrs = sorted(a.SerializeToString() for a in n.attribute if a.name not in defaults)
        h = hashlib.sha256(repr((n.op_type, n.domain or "", attrs, [ids[i] for i in n.input])).encode()).hexdigest()
        nodes[h] += 1
        for k, o in enumerate(n.output):
            ids[o] = f"{h}:{k}"
    return nodes, [ids[o.name] for o in g.output]


@dataclass
class _Live:
    nodes: set[int]  # indices of the nodes a graph output depends on
    inputs: set[str]  # the tensors they read


def _live(g: onnx.GraphProto) -> _Live:
    """What the graph's outputs depend on. ORT leaves some nodes nothing reads (a Cast it inserted for a small
    fp16 constant whose readers it then fused, in one window and not in another): they compute nothing that is
    used, so the comparison leaves them out."""
    needed = {o.name for o in g.output}
    nodes: set[int] = set()
    for j in range(len(g.node) - 1, -1, -1):
        n = g.node[j]
        if any(o in needed for o in n.output if o):
            nodes.add(j)
            needed |= _reads(n)
    return _Live(nodes, needed)


# ---------------------------------------------------------------- driving ORT


PACKED_SHARE = 0.25  # of all weights: a larger segment is packed node by node (``Segmenter.packs_itself``)


@dataclass
class Report:
    segments: int = 1
    largest_bytes: int = 0
    merged: int = 0  # cuts removed because the pair check failed
    moved: int = 0  # cuts moved to another place after their pair check failed
    reason: str = ""  # why there is one segment
    checked: int = 0
    reused: int = 0  # of the checked cuts, those answered by an earlier window of the same shape
    details: list[str] = field(default_factory=list)
    unpacked: int = 0  # segments too large a share of the weights for their session to save packed copies

    def as_dict(self) -> dict[str, Any]:
        return {
            "segments": self.segments,
            "largest_segment_bytes": self.largest_bytes,
            "unsafe_cuts": self.merged,
            "moved_cuts": self.moved,
            "checked_cuts": self.checked,
            "checks_reused": self.reused,
            "single_reason": self.reason,
            "dropped_cuts": self.details[:10],
            "segments_packed_node_by_node": self.unpacked,
        }


def _handed_over(prev: onnx.ModelProto) -> frozenset[str]:
    """What the optimized segment ``prev`` hands the next one through a ReorderOutput (``Segmenter.standin``)."""
    made = {o: n for n in prev.graph.node for o in n.output}
    return frozenset(
        v.name
        for v in prev.graph.output
        if v.name in made and made[v.name].domain == NCHWC and made[v.name].op_type == "ReorderOutput"
    )


def _left_differs(
    left: onnx.ModelProto, together: onnx.ModelProto, whole: Counter[str], directory: Path, context: frozenset[str]
) -> bool:
    """Whether the stitch of ``left`` with any segment after it must differ from ``together`` (the two optimized in
    one session, ``whole`` its fingerprint): a node ``left`` makes for its outputs that the window does not have.
    The stitch keeps every node of the first segment that its outputs need, under the same fingerprint (its
    inputs are the window's, the segment after reads its outputs), so such a node is in the pair and not in the
    window: the pair check fails (Marian's decoder: ``Mul`` of the embeddings by its scale of 1, which ORT drops
    in the whole graph and keeps where its output is the segment's). Not decided here (False): a segment ending
    where the stitch splices (an NCHWc reorder, an inserted fp16 Cast), whose last nodes the pair drops. Left to
    the pair check: a tensor handed over that the next segment's session stops reading, whose nodes the pair
    would not need (a failing answer here then refuses a cut that held: the graph stays in one piece, exact)."""
    made = {o: n for n in left.graph.node for o in n.output}
    outputs = [o for o in left.graph.output if not o.name.endswith(WITNESS)]
    ends = [made[o.name] for o in outputs if o.name in made]
    half = onnx.TensorProto.FLOAT16
    if any((n.domain == NCHWC and n.op_type == "ReorderOutput") or _inserted_cast(n, half) for n in ends):
        return False
    alone = stitch([left], together.graph.input, outputs, standins=[frozenset()], directory=directory, context=context)
    return bool(fingerprint(alone, directory)[0] - whole)


class Segmenter:
    """Optimizes ``model_path`` segment by segment into ``out_model`` (external data beside it)."""

    def __init__(
        self,
        model_path: str,
        out_model: str,
        optimize: Optimizer,
        budget: int,
        settle: Callable[[onnx.ModelProto, str], list[str]] | None = None,
        reset: Callable[[], None] | None = None,
        optimize_packed: Optimizer | None = None,
        optimize_referenced: Optimizer | None = None,
        settles_inline: bool = False,
    ) -> None:
        # ``settle`` moves what ORT wrote inline out of the graph: the one-piece session may then save references
        # (``optimize_referenced``) to the staged payloads instead of a second copy of every weight, where
        # ``whole_references`` holds
        self.settles_inline = settles_inline
        self.optimize_packed = optimize_packed  # a segment's session that also saves ORT's packed copies
        # a cut check's session that saves no initializers file (``window_references``)
        self.optimize_referenced = optimize_referenced
        self.settle = settle  # re-points a segment's initializers off ORT's file (which it removes), if given
        self.reset = reset  # forgets what ``settle`` kept, when the graph goes back to one piece
        self.src = Path(model_path)
        self.out = Path(out_model)
        self.optimize = optimize
        self.model = onnx.load(str(self.src), load_external_data=False)
        sink_weight_producers(self.model.graph)
        self.types = tensor_types(self.model)
        self.plan = plan(self.model.graph, budget, self.types)
        self.context: frozenset[str] = frozenset()  # what every segment computes again (``context``)
        # what a segment's witness reads as the segment does (``context.witness_copy``); None: no witness
        self.shared: frozenset[str] | None = None
        self.plain = (self.model, self.plan)  # the cut without context, where the context check fails
        self._with_context(budget)
        self.stem = self.out.name.removesuffix(".onnx")
        self.optimized: dict[tuple[int, int, frozenset[str]], onnx.ModelProto] = {}
        self.answers: dict[str, bool] = {}  # window_shape -> whether the cut in it was exact
        self.reused = 0  # cut checks answered by an earlier window of the same shape
        self.files: dict[tuple[int, int, frozenset[str]], list[str]] = {}
        # the last probed window (its nodes, standin), its optimization and fingerprint: a cut moved within it (the
        # window of a graph's one cut is the whole graph) is probed again against the same window, which the same
        # session would make again
        self.last_window: (
            tuple[tuple[int, int, frozenset[str]], onnx.ModelProto, tuple[Counter[str], list[str]]] | None
        ) = None

    def _with_context(self, budget: int) -> None:
        """Cut where the context crosses (``context``), when that gives cuts the plain plan cannot make: the graph's
        nodes that make the context first, each segment computing it again and holding its witnesses (handed over
        as an input instead, even to the next segment only, ORT casts and transposes the rotary tables otherwise
        than in the whole graph: a pair check fails). Otherwise the graph is cut as without context, node for node
        the same sessions."""
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        small = _small(model.graph, heavy_bytes(budget))
        context, prologue = hoist_context(model.graph, small, self.types)
        if not context:
            return
        cut = plan(model.graph, budget, self.types, context)
        # the residual stream passing over a segment where that makes the largest segment smaller (an fp16
        # decoder's or ViT's MLP, more than the budget in one piece otherwise); elsewhere the cuts as they were (a
        # dynamic-int8 decoder's: its DynamicQuantizeLinear must stay with the MatMulInteger after it)
        reach = plan(model.graph, budget, self.types, context, reach=True)
        if _largest(reach) < _largest(cut):
            cut = reach
        if len(cut.bounds) <= len(self.plan.bounds):
            return  # nothing gained: the plain plan
        self.model, self.plan, self.context = model, cut, context
        self.shared = shared_constants(model.graph, cut.bounds, small) | prologue

    def _locality(self, bounds: list[int]) -> str:
        return locality(self.model.graph, bounds, self.plan.heavy, self.context, self.plan.reach)

    def _without_context(self) -> None:
        """Back to the plain plan (the context check failed): every session made with context is dropped."""
        self._clean(set())
        self.model, self.plan = self.plain
        self.context, self.shared = frozenset(), None
        self.answers.clear()
        self.last_window = None  # of the graph with context

    def _bin(self, tag: str) -> Path:
        return self.out.parent / f"{self.stem}.{tag}.bin"

    def _run(
        self,
        start: int,
        stop: int,
        standin: frozenset[str],
        tag: str,
        prepack: bool = False,
        window: bool = False,
        as_inputs: frozenset[str] = frozenset(),
    ) -> onnx.ModelProto:
        """ORT's optimization of ``graph.node[start:stop]``, saved beside the output (``as_inputs``: ``extract``)."""
        whole = (start, stop) == (0, len(self.model.graph.node))  # a context window's reference: as the graph is
        witness = None if whole else self.shared
        part = extract(self.model, start, stop, self.types, standin, as_inputs, self.context, witness)
        # beside the source model, so that the initializers' relative external data locations resolve
        tmp = self.src.parent / f"{self.stem}.{tag}.in.onnx"
        opt = self.out.parent / f"{self.stem}.{tag}.onnx"
        tmp.write_bytes(part.SerializeToString())
        try:
            run = self.optimize_packed if prepack and self.optimize_packed is not None else self.optimize
            if window and self.optimize_referenced is not None and window_references(part):
                run = self.optimize_referenced
            run(str(tmp), str(opt), self._bin(tag).name)
        finally:
            tmp.unlink()
        result = onnx.load(str(opt), load_external_data=False)
        opt.unlink()
        apply_saved_hook(result)  # tests rename what ORT emits here (``names``)
        return result

    def standin(self, bounds: list[int], k: int) -> frozenset[str]:
        """Inputs of segment k that the segment before hands over through a ReorderOutput."""
        if k == 0:
            return frozenset()
        return _handed_over(self.segment(bounds, k - 1))

    def packs_itself(self, key: tuple[int, int, frozenset[str]]) -> bool:
        """Whether the segment's session saves its packed copies. That session writes the segment's weights and
        their packed copies into ORT's file while the staged model holds them too: for a segment of more than
        PACKED_SHARE of the weights that would take the temporary disk past 1.5x the outputs (a 2-segment
        transformer: 1.85x), so such a segment is optimized without packing and packed node by node afterwards
        (each node's copy written and removed in turn, as for a graph in one piece)."""
        return sum(self.plan.weights[key[0] : key[1]]) <= PACKED_SHARE * sum(self.plan.weights)

    def segment(self, bounds: list[int], k: int) -> onnx.ModelProto:
        key = (bounds[k], bounds[k + 1], self.standin(bounds, k))
        if key not in self.optimized:
            # a segment's session saves its weights again even where it packs nothing (ORT 1.32's reference route
            # leaves out attributes at their defaults that its file route writes: ``fingerprint`` ignores those)
            part = self._run(*key, tag=self._tag(key), prepack=self.packs_itself(key))
            if self.settle is not None:  # ORT's copy of the segment's weights leaves the disk now
                self.files[key] = self.settle(part, self._tag(key))
            self.optimized[key] = part
        return self.optimized[key]

    @staticmethod
    def _tag(key: tuple[int, int, frozenset[str]]) -> str:
        return f"seg{key[0]}-{key[1]}" + ("s" if key[2] else "")

    def cut_is_exact(self, bounds: list[int], k: int) -> bool:
        """Segments k and k + 1 stitched equal the two optimized in one session.

        A window of the same shape as one already checked (``window_shape``: ops, attributes, wiring, tensor
        types and shapes, the bytes of every small initializer; the large weights by type and shape) gets that
        check's answer without a session of its own: a transformer's or a Conv chain's layer boundaries are all
        alike, and ORT decides its fusions and layouts from that shape, not from the values of large weights.

        A cut that fails is known before its segments' own sessions run (``probe``)."""
        together = None
        if (probed := self.probe(bounds, k)) is not None:
            together, exact = probed
            if not exact:
                return False
        left, right = self.segment(bounds, k), self.segment(bounds, k + 1)
        a, c, standin = bounds[k], bounds[k + 2], self.standin(bounds, k)
        window = extract(self.model, a, c, self.types, standin, context=self.context, witness=self.shared)
        shape = window_shape(window, c - bounds[k + 1], standin, self.standin(bounds, k + 1), self.src.parent)
        if shape in self.answers:
            self.reused += 1
            return self.answers[shape]
        if together is None:
            together = self._run(a, c, standin, f"win{a}-{c}", window=True)
        try:
            pair = stitch(
                [left, right],
                together.graph.input,
                [o for o in window.graph.output if not o.name.endswith(WITNESS)],
                standins=[frozenset(), self.standin(bounds, k + 1)],
                directory=self.out.parent,
                context=self.context,
            )
            seen = self.last_window
            if seen is not None and seen[0] == (a, c, standin) and seen[1] is together:
                reference = seen[2]  # the probe's fingerprint of this window
            else:
                reference = fingerprint(unwitnessed(together), self.out.parent)
            exact = fingerprint(pair, self.out.parent) == reference
        finally:
            self._bin(f"win{a}-{c}").unlink(missing_ok=True)
        self.answers[shape] = exact
        return exact

    def probe(self, bounds: list[int], k: int) -> tuple[onnx.ModelProto | None, bool] | None:
        """The cut check of ``cut_is_exact`` on segments optimized by sessions that save no weights (ORT 1.32 saves
        each weight it left as it was as its reference, as the window's session does: ``window_references``):
        (the window's optimization, whether the stitch equals it). A segment's own session writes its weights
        and their packed copies and has them compared byte for byte (``settle``): a decoder whose one cut fails
        at each place tried (BART's, Marian's: a fusion through the cut) paid that for nothing, three times. Only
        a failing answer is taken: where it passes, the segments' own sessions run and the check is made on
        them, as without the probe; a window answered before (``window_shape``) gives its answer. None where
        it does not apply: both segments optimized already, no referencing session (a Conv, fp16 weights).
        The segment before the cut is compared with the window before the one after it is optimized
        (``_left_differs``): a decoder's one cut leaves that segment ~80% of the weights, and where ORT's whole
        graph fused through the cut it costs a session three times over for nothing."""
        done = {key[:2]: model for key, model in self.optimized.items()}
        spans = [(bounds[j], bounds[j + 1]) for j in (k, k + 1)]
        if self.optimize_referenced is None or all(span in done for span in spans):
            return None
        a, b, c, standin = bounds[k], bounds[k + 1], bounds[k + 2], self.standin(bounds, k)
        window = extract(self.model, a, c, self.types, standin, context=self.context, witness=self.shared)
        if not window_references(window):
            return None
        tags = [f"probe{a}-{b}", f"probe{b}-{c}", f"win{a}-{c}"]
        try:
            left = done[a, b] if (a, b) in done else self._run(a, b, standin, tags[0], window=True)
            right_standin = _handed_over(left)
            shape = window_shape(window, c - b, standin, right_standin, self.src.parent)
            if shape in self.answers:
                if self.answers[shape]:
                    return None
                self.reused += 1
                return None, False
            if self.last_window is None or self.last_window[0] != (a, c, standin):
                together = self._run(a, c, standin, tags[2], window=True)
                self.last_window = ((a, c, standin), together, fingerprint(unwitnessed(together), self.out.parent))
            together, whole = self.last_window[1:]
            exact = not _left_differs(left, together, whole[0], self.out.parent, self.context)
            if exact:
                right = done[b, c] if (b, c) in done else self._run(b, c, right_standin, tags[1], window=True)
                pair = stitch(
                    [left, right],
                    together.graph.input,
                    [o for o in window.graph.output if not o.name.endswith(WITNESS)],
                    standins=[frozenset(), right_standin],
                    directory=self.out.parent,
                    context=self.context,
                )
                exact = fingerprint(pair, self.out.parent) == whole
        finally:
            for tag in tags:  # a session that saved its weights after all (a part ORT could not reference)
                self._bin(tag).unlink(missing_ok=True)
        if not exact:
            self.answers[shape] = False
        return together, exact

    def context_differs(self, bounds: list[int]) -> str:
        """Why the segments, where they compute the context again (``hoist_context``), may not be what ORT makes of
        the whole graph ("" when they are, or when the graph is cut without context).

        The check: the whole graph in one session with every weight a graph input of its type and shape (its
        session holds no weight, whatever the model's size) against the stitch of every segment optimized alike,
        node for node (``fingerprint``). Every fact ORT reads from the whole graph about the context is in both:
        how many nodes read a context tensor or a shared scalar, which nodes its common-subexpression elimination
        merges, the layout its transpose optimizer gives the rotary tables, a fusion through the mask's nodes. The
        pair checks cover what ORT makes of the weights (constant there) at each cut. Unchecked: a decision that
        needs a weight constant and reads a fact of the whole graph that the segment's witnesses (``context``: a
        second reader of each context tensor) do not reproduce."""
        graph = self.model.graph
        if not self.context:
            return ""
        n = len(bounds) - 1
        every = frozenset(self._heavy_names())
        standins = [self.standin(bounds, k) for k in range(n)]
        # not "win...": the scratch drops a window's file (".win" in its name) before the next session
        tags = ["wholectx"] + [f"seg{bounds[k]}-{bounds[k + 1]}b" for k in range(n)]
        try:
            reference = self._run(0, len(graph.node), frozenset(), tags[0], as_inputs=every)
            bare = [self._run(bounds[k], bounds[k + 1], standins[k], tags[k + 1], as_inputs=every) for k in range(n)]
            stitched = stitch(
                bare, reference.graph.input, graph.output, standins=standins, directory=self.out.parent,
                context=self.context,
            )  # fmt: skip
            if fingerprint(stitched, self.out.parent) != fingerprint(unwitnessed(reference), self.out.parent):
                return "the segments read what every layer reads (mask, rotary tables) otherwise than the whole graph"
        finally:
            for tag in tags:
                self._bin(tag).unlink(missing_ok=True)
        return ""

    def _heavy_names(self) -> set[str]:
        return {t.name for t in self.model.graph.initializer if _tensor_bytes(t) >= self.plan.heavy}

    def _clean(self, keep: set[tuple[int, int, frozenset[str]]]) -> None:
        for key in [k for k in self.optimized if k not in keep]:
            del self.optimized[key]
            self._bin(self._tag(key)).unlink(missing_ok=True)
            for name in self.files.pop(key, []):  # what ``settle`` kept of it
                (self.out.parent / name).unlink(missing_ok=True)
        if not keep and self.reset is not None:
            self.reset()

    def _keep_current(self, bounds: list[int]) -> None:
        """Drop the optimized segments (and their files) that a moved or removed cut made obsolete."""
        current = set(zip(bounds, bounds[1:]))
        self._clean({key for key in self.optimized if (key[0], key[1]) in current} or {(-1, -1, frozenset())})

    def run(self) -> Report:
        try:
            return self._segmented()
        except OSError as e:
            self._clean(set())
            if e.errno in _NO_ROOM:  # the whole graph would need more of it, and more memory: the run fails
                raise
            return self._whole_after(e)
        except Exception as e:  # noqa: BLE001 - any failure of the cutting itself: the whole graph, as before
            self._clean(set())
            return self._whole_after(e)

    def _whole_after(self, e: Exception) -> Report:
        self.optimize(str(self.src), str(self.out), f"{self.stem}.bin")
        return Report(reason=f"cutting failed: {type(e).__name__}", largest_bytes=sum(self.plan.weights))

    def _whole(self) -> None:
        if self.settles_inline and self.optimize_referenced is not None and whole_references(self.model):
            try:
                self.optimize_referenced(str(self.src), str(self.out), f"{self.stem}.bin")
                return
            except Exception:  # noqa: BLE001 - e.g. more changed bytes than one protobuf holds: the file route
                self.out.unlink(missing_ok=True)
        self.optimize(str(self.src), str(self.out), f"{self.stem}.bin")

    def _segmented(self) -> Report:
        report = self._cut()
        report.reused = self.reused
        return report

    def _cut(self) -> Report:
        bounds = list(self.plan.bounds)
        report = Report(reason=self.plan.reason)
        if len(bounds) > 2 and (why := self._locality(bounds)):
            bounds, report.reason = [bounds[0], bounds[-1]], why
        if len(bounds) > 2:
            k = 0
            while k < len(bounds) - 2:
                report.checked += 1
                if self.cut_is_exact(bounds, k):
                    k += 1
                    continue
                tried = self.plan.alternatives.get(bounds[k + 1], [])
                report.details.append(f"node {bounds[k + 1]} ({self.model.graph.node[bounds[k + 1]].op_type})")
                moves = [q for q in tried if bounds[k] < q < bounds[k + 1]]
                if moves:  # the cut moves earlier; the segment left of it changed, so its own cut is re-checked
                    self.plan.alternatives[moves[0]] = moves[1:]
                    bounds[k + 1] = moves[0]
                    self._keep_current(bounds)
                    report.moved += 1
                    k = max(k - 1, 0)
                    if report.merged + report.moved > max(8, 2 * len(self.plan.bounds)):
                        bounds = [bounds[0], bounds[-1]]  # as below: this graph does not cut
                    continue
                report.merged += 1
                del bounds[k + 1]
                self._keep_current(bounds)
                k = max(k - 1, 0)  # the merged segment changes the pair to its left too
                failed = report.merged + report.moved
                if report.merged > max(8, len(self.plan.bounds) // 2) or failed > max(8, 2 * len(self.plan.bounds)):
                    # re-checking merged (ever larger) pairs would cost
                    bounds = [bounds[0], bounds[-1]]  # more than it saves: this graph does not cut
        if len(bounds) > 2 and (why := self._locality(bounds)):
            bounds, report.reason = [bounds[0], bounds[-1]], why  # a moved cut: as before the checks
        if len(bounds) == 2:  # one piece (small, uncuttable, or no cut was exact): the whole-graph session
            self._clean(set())
            self._whole()
            if report.merged:
                report.reason = "the cuts changed ORT's graph"
            elif len(self.plan.bounds) == 2 and not report.reason:
                report.reason = "no place to cut (one tensor crossing, before a weight-bearing node)"
            report.largest_bytes = sum(self.plan.weights)
            return report
        if len(bounds) > 2 and (why := self.context_differs(bounds)):
            self._without_context()  # fail closed: cut as without context (a graph of context: one piece, mostly)
            report = self._cut()
            report.details.insert(0, why)
            report.reason = why if report.segments == 1 else report.reason
            return report
        keys = [(bounds[k], bounds[k + 1], self.standin(bounds, k)) for k in range(len(bounds) - 1)]
        parts = [self.segment(bounds, k) for k in range(len(bounds) - 1)]
        self._clean(set(keys))
        whole = stitch(
            parts,
            self.model.graph.input,
            self.model.graph.output,
            self.model.graph.name,
            [key[2] for key in keys],
            self.out.parent,
            self.context,
        )
        self.out.write_bytes(whole.SerializeToString())
        report.segments = len(parts)
        report.unpacked = sum(not self.packs_itself(key) for key in keys)
        report.largest_bytes = max(sum(self.plan.weights[a:b]) for a, b, _ in keys)
        return report
