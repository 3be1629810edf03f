"""Rewrites of the skeleton graph that let weights be shared.

``fold_fp16_casts``: ONNX Runtime constant-folds ``Cast(fp16 initializer -> float)``
into a new fp32 heap tensor in every session. When every consumer
of an fp16/bf16 constant is such a Cast, we store the constant as fp32 instead
and drop the Casts. fp16->fp32 and bf16->fp32 are exact for every value but
signalling NaNs, which ORT's fp16 Cast quiets in its SIMD blocks and keeps in
the scalar tail (hardware-dependent): a payload holding one is not folded, so
ORT keeps computing it exactly as it does for the original.

Linear in the graph: one index per scope (uses, definitions, names nested
subgraphs define), every fold of a scope decided first, then applied in one pass.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping

from . import dtypes
from ._proto import pb
from .graph import Site, SiteMap, iter_scopes, subgraphs

# (op_type, input index) pairs that ONNX Runtime needs as constant data at graph
# load (shape inference); ORT refuses an external tensor for Reshape's shape, so
# int64 tensors used this way stay inline whatever their size.
SHAPE_INPUTS = {
    "Reshape": {1},
    "Expand": {1},
    "ConstantOfShape": {0},
    "Tile": {1},
    "Slice": {1, 2, 3, 4},
    "Unsqueeze": {1},
    "Squeeze": {1},
    "Pad": {1, 3},
    "Resize": {3},
    "TopK": {1},
    "Split": {1},
    "OneHot": {1},
    "Range": {0, 1, 2},
    "CumSum": {1},
    "ReduceSum": {1},
    "ReduceMean": {1},
    "ReduceMax": {1},
    "ReduceMin": {1},
    "ReduceProd": {1},
    "ReduceL1": {1},
    "ReduceL2": {1},
    "ReduceLogSum": {1},
    "ReduceLogSumExp": {1},
    "ReduceSumSquare": {1},
}


# SHAPE_INPUTS and the other (op_type, input index) pairs whose data ONNX shape inference reads when ONNX Runtime
# loads a graph, whatever their element type (Resize's float scales): ORT refuses the model when such a tensor is
# external ("Cannot parse data from external tensors"). ``--prepack`` keeps these inline in ORT's saved graph.
LOAD_READ_INPUTS = {
    **SHAPE_INPUTS,
    "Resize": {2, 3},
    "Upsample": {1},
    "CenterCropPad": {1, 2},
    "Col2Im": {1, 2},
    "AffineGrid": {1},
    "DFT": {1, 2},
    "STFT": {1, 3},
    "BlackmanWindow": {0},
    "HannWindow": {0},
    "HammingWindow": {0},
    "MelWeightMatrix": {0, 1},
    "SplitToSequence": {1},
}


def shape_tensor_names(model: pb.ModelProto, inputs: Mapping[str, set[int]] = SHAPE_INPUTS) -> set[str]:
    """The names read at ``inputs``' (op_type, input index) pairs, in every scope."""
    names = set()
    for scope in iter_scopes(model):
        for node in scope.node:
            for i in inputs.get(node.op_type, ()):
                if i < len(node.input) and node.input[i]:
                    names.add(node.input[i])
    return names


def _is_cast_to_float(node: pb.NodeProto) -> bool:
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or len(node.input) != 1:
        return False
    if len(node.output) != 1 or not node.output[0]:  # a Cast without an output computes nothing to fold into
        return False
    return any(a.name == "to" and a.i == dtypes.FLOAT for a in node.attribute)


class _ScopeIndex:
    """What a fold in one scope needs to know, built in one walk of the scope and its subgraphs."""

    def __init__(self, scope: pb.GraphProto | pb.FunctionProto) -> None:
        self.scope = scope
        if isinstance(scope, pb.GraphProto):
            self.inputs = {v.name for v in scope.input}
            self.outputs = {v.name for v in scope.output}
            defined = [
                *self.inputs,
                *(t.name for t in scope.initializer),
                *(sp.values.name for sp in scope.sparse_initializer),
            ]
        else:
            self.inputs, self.outputs = set(scope.input), set(scope.output)
            defined = list(scope.input)
        self.defs = Counter(defined)
        self.uses: dict[str, list[tuple[pb.NodeProto, bool]]] = {}  # name -> [(consumer, directly in scope)]
        self.nested_defs: set[str] = set()  # names a subgraph defines: they shadow the scope's own
        # Holding every node's wrapper keeps id(node) stable: protobuf hands back the same object only while
        # one is alive, and the delete pass and the use index compare nodes by id.
        self.nodes = list(scope.node)
        self.order = {id(node): i for i, node in enumerate(self.nodes)}
        for node in self.nodes:
            self.defs.update(o for o in node.output if o)
        self._walk_uses()

    def _walk_uses(self) -> None:
        stack = [(n, True) for n in self.nodes]
        while stack:
            node, direct = stack.pop()
            for name in node.input:
                if name:
                    self.uses.setdefault(name, []).append((node, direct))
            if not direct:
                self.nested_defs.update(node.output)
            for g in subgraphs(node):
                stack.extend((n, False) for n in g.node)
                self.nested_defs.update(v.name for v in g.input)
                self.nested_defs.update(t.name for t in g.initializer)
                self.nested_defs.update(sp.values.name for sp in g.sparse_initializer)
                for out in g.output:  # a subgraph may return an outer value directly
                    self.uses.setdefault(out.name, []).append((node, False))

    def foldable_casts(self, site: Site) -> list[pb.NodeProto] | None:
        """The Casts to drop if ``site`` can be folded, else None."""
        name = site.name
        if name in self.inputs or name in self.outputs or self.defs[name] != 1:
            return None  # duplicate names: ORT takes the last one; leaving them unfolded keeps exactly that
        uses = self.uses.get(name, [])
        if not uses or not all(direct and _is_cast_to_float(node) for node, direct in uses):
            return None
        casts = list({id(node): node for node, _ in uses}.values())
        names = [c.output[0] for c in casts]
        if any(self.defs[n] != 1 or n in self.nested_defs for n in names):
            return None  # renaming into a name a subgraph shadows would change what that subgraph reads
        if sum(1 for n in names if n in self.outputs) > 1:
            return None
        casts.sort(key=lambda n: self.order[id(n)])
        return casts


def protected_names(model: pb.ModelProto) -> set[str]:
    """Names a fold must not rename or retype: training bindings and what training graphs read from the model
    graph (they refer to its initializers by name), and quantization annotations."""
    names: set[str] = set()
    for info in model.training_info:
        for binding in (*info.initialization_binding, *info.update_binding):
            names.update((binding.key, binding.value))
        for g in (info.initialization, info.algorithm):
            for scope in _graph_and_subgraphs(g):
                for node in scope.node:
                    names.update(node.input)
    names.update(a.tensor_name for a in model.graph.quantization_annotation)
    return names


def _graph_and_subgraphs(graph: pb.GraphProto) -> Iterator[pb.GraphProto]:
    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for node in g.node:
            stack.extend(subgraphs(node))


def fold_fp16_casts(
    model: pb.ModelProto, sites: Mapping[int, Site], keeps_bits: Callable[[Site], bool] = lambda site: True
) -> tuple[set[int], int]:
    """Fold Cast(to=FLOAT) of fp16/bf16 constants. Returns (folded ref indices, Cast nodes removed).

    ``keeps_bits(site)`` says whether converting the payload gives the bits ORT's own Cast gives
    (False for an fp16 payload holding a signalling NaN); asked only for sites that could fold.
    """
    protected = protected_names(model)
    by_scope: dict[int, list[Site]] = {}
    scopes: dict[int, pb.GraphProto | pb.FunctionProto] = {}
    # A SiteMap iterates in index order and makes an initializer's Site only when asked: one at a time here
    ordered = sites if isinstance(sites, SiteMap) else sorted(sites)
    for site in map(sites.__getitem__, ordered):
        if site.tensor.data_type not in (dtypes.FLOAT16, dtypes.BFLOAT16):
            continue
        if site.kind not in ("initializer", "constant") or site.name in protected:
            continue
        by_scope.setdefault(id(site.scope), []).append(site)
        scopes[id(site.scope)] = site.scope
    folded: set[int] = set()
    removed = 0
    for key, group in by_scope.items():
        index = _ScopeIndex(scopes[key])
        decided = []
        for site in group:
            casts = index.foldable_casts(site)
            if casts is not None and keeps_bits(site):
                decided.append((site, casts))
        _apply_folds(index, decided)
        folded.update(site.index for site, _ in decided)
        removed += sum(len(casts) for _, casts in decided)
    return folded, removed


def _apply_folds(index: _ScopeIndex, decided: list[tuple[Site, list[pb.NodeProto]]]) -> None:
    """Retype and rename every folded constant of one scope, drop its Casts, rename their readers: one pass each."""
    if not decided:
        return
    scope = index.scope
    mapping: dict[str, str] = {}
    stale: set[str] = set()  # value_info of the fp16 names and of the dropped Cast outputs
    doomed: set[int] = set()
    for site, casts in decided:
        keep = next((c.output[0] for c in casts if c.output[0] in index.outputs), casts[0].output[0])
        mapping.update((c.output[0], keep) for c in casts if c.output[0] != keep)
        site.tensor.data_type = dtypes.FLOAT
        if site.kind == "initializer":
            site.tensor.name = keep
        else:
            assert site.node is not None, "a Constant's site records its node"
            site.node.output[0] = keep
        stale.add(site.name)
        site.name = keep
        doomed.update(id(c) for c in casts)
    stale.update(mapping)
    # Delete in place, last first: rebuilding the repeated field would copy every node and orphan the
    # references that sites hold. Each delete is a pointer move in C; the Python walk happens once.
    for i in range(len(scope.node) - 1, -1, -1):
        if id(scope.node[i]) in doomed:
            del scope.node[i]
    if mapping:
        _rename_inputs(scope.node, mapping)
    if isinstance(scope, pb.GraphProto) and any(v.name in stale for v in scope.value_info):
        kept_vi = [v for v in scope.value_info if v.name not in stale]
        del scope.value_info[:]
        scope.value_info.extend(kept_vi)


def _rename_inputs(nodes: Iterable[pb.NodeProto], mapping: dict[str, str]) -> None:
    stack = list(nodes)
    while stack:
        node = stack.pop()
        for i, name in enumerate(node.input):
            if name in mapping:
                node.input[i] = mapping[name]
        for g in subgraphs(node):
            stack.extend(g.node)
            for out in g.output:
                if out.name in mapping:
                    out.name = mapping[out.name]
