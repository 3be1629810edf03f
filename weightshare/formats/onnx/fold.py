"""Rewrites of the skeleton graph that let weights be shared.

``fold_fp16_casts``: ONNX Runtime constant-folds ``Cast(fp16 initializer -> float)``
into a new fp32 heap tensor in every session (DESIGN.md 1). When every consumer
of an fp16/bf16 constant is such a Cast, we store the constant as fp32 instead
and drop the Casts; fp16->fp32 and bf16->fp32 are exact, so outputs are
bit-identical.
"""

from __future__ import annotations

import onnx

from . import dtypes
from .graph import Site, iter_scopes, subgraphs

# (op_type, input index) pairs that ONNX Runtime needs as constant data at graph
# load (shape inference); ORT refuses an external tensor for Reshape's shape, so
# int64 tensors used this way stay inline whatever their size.
SHAPE_INPUTS = {
    "Reshape": {1}, "Expand": {1}, "ConstantOfShape": {0}, "Tile": {1}, "Slice": {1, 2, 3, 4},
    "Unsqueeze": {1}, "Squeeze": {1}, "Pad": {1, 3}, "Resize": {3}, "TopK": {1}, "Split": {1},
    "OneHot": {1}, "Range": {0, 1, 2}, "CumSum": {1}, "ReduceSum": {1}, "ReduceMean": {1},
    "ReduceMax": {1}, "ReduceMin": {1}, "ReduceProd": {1}, "ReduceL1": {1}, "ReduceL2": {1},
    "ReduceLogSum": {1}, "ReduceLogSumExp": {1}, "ReduceSumSquare": {1},
}


def shape_tensor_names(model: onnx.ModelProto) -> set[str]:
    names = set()
    for scope in iter_scopes(model):
        for node in scope.node:
            for i in SHAPE_INPUTS.get(node.op_type, ()):
                if i < len(node.input) and node.input[i]:
                    names.add(node.input[i])
    return names


def _scope_io(scope) -> tuple[set[str], set[str]]:
    if isinstance(scope, onnx.GraphProto):
        return {v.name for v in scope.input}, {v.name for v in scope.output}
    return set(scope.input), set(scope.output)


def _uses(scope) -> dict[str, list[tuple[onnx.NodeProto, bool]]]:
    """name -> [(consumer node, consumer is directly in ``scope``)], nested subgraphs included."""
    uses: dict[str, list] = {}
    stack = [(n, True) for n in scope.node]
    while stack:
        node, direct = stack.pop()
        for name in node.input:
            if name:
                uses.setdefault(name, []).append((node, direct))
        for g in subgraphs(node):
            stack.extend((n, False) for n in g.node)
            for out in g.output:  # a subgraph may return an outer value directly
                uses.setdefault(out.name, []).append((node, False))
    return uses


def _is_cast_to_float(node: onnx.NodeProto) -> bool:
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or len(node.input) != 1:
        return False
    return any(a.name == "to" and a.i == dtypes.FLOAT for a in node.attribute)


def _rename_inputs(nodes, mapping: dict[str, str]) -> None:
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


def fold_fp16_casts(model: onnx.ModelProto, sites: dict[int, Site]) -> tuple[set[int], int]:
    """Fold Cast(to=FLOAT) of fp16/bf16 constants. Returns (folded ref indices, Cast nodes removed)."""
    folded: set[int] = set()
    removed = 0
    uses_by_scope: dict[int, dict] = {}  # a fold only touches its own Casts, so one index per scope stays valid
    for site in sorted(sites.values(), key=lambda s: s.index):
        if site.tensor.data_type not in (dtypes.FLOAT16, dtypes.BFLOAT16) or site.kind not in ("initializer",
                                                                                              "constant"):
            continue
        if id(site.scope) not in uses_by_scope:
            uses_by_scope[id(site.scope)] = _uses(site.scope)
        uses = uses_by_scope[id(site.scope)]
        casts = _foldable_casts(site.scope, site, uses.get(site.name, []))
        if casts is None:
            continue
        _apply_fold(site.scope, site, casts)
        folded.add(site.index)
        removed += len(casts)
    return folded, removed


def _foldable_casts(scope, site: Site, uses: list) -> list[onnx.NodeProto] | None:
    inputs, outputs = _scope_io(scope)
    if site.name in inputs or site.name in outputs:
        return None
    if not uses or not all(direct and _is_cast_to_float(node) for node, direct in uses):
        return None
    casts = []
    for node, _ in uses:
        if not any(node is c for c in casts):
            casts.append(node)
    if sum(1 for c in casts if c.output[0] in outputs) > 1:
        return None
    return casts


def _apply_fold(scope, site: Site, casts: list[onnx.NodeProto]) -> None:
    _, outputs = _scope_io(scope)
    order = {id(n): i for i, n in enumerate(scope.node)}
    casts.sort(key=lambda n: order[id(n)])
    keep = next((c.output[0] for c in casts if c.output[0] in outputs), casts[0].output[0])
    mapping = {c.output[0]: keep for c in casts if c.output[0] != keep}
    site.tensor.data_type = dtypes.FLOAT
    if site.kind == "initializer":
        site.tensor.name = keep
    else:
        site.node.output[0] = keep
    old_name, site.name = site.name, keep
    doomed = {id(c) for c in casts}
    # Delete in place, last first: rebuilding the repeated field would copy every node and
    # orphan the references that sites and the use index hold.
    for i in range(len(scope.node) - 1, -1, -1):
        if id(scope.node[i]) in doomed:
            del scope.node[i]
    _rename_inputs(scope.node, mapping)
    if isinstance(scope, onnx.GraphProto):
        stale = {old_name, *mapping}
        kept_vi = [v for v in scope.value_info if v.name not in stale]
        del scope.value_info[:]
        scope.value_info.extend(kept_vi)
