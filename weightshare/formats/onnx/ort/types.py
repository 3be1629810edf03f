"""Element types of every tensor of an ORT-optimized graph, inferred from ONNX Runtime's own op schemas.

The node-by-node pre-packing (``child.pack``) runs each weight-bearing node alone, so its
activation inputs need their real types: MatMulNBits takes float/fp16 activations next to uint8
weights, QLinearMatMul uint8/int8 next to float scales, and a wrong guess makes ORT refuse the node
(which then keeps no packed copy). The optimized graph ORT saves carries few ``value_info`` entries,
and onnx's type inference does not know ORT's contrib and NCHWc ops, so the types are propagated
here through the schemas ORT registers (``get_all_operator_schema``): an output's type variable is
bound by the inputs that share it, or is the one type it allows. Subgraph bodies (If/Loop/Scan)
see the types of their enclosing graphs, never a sibling body's: optimum's merged decoders name tensors alike in
both branches (Marian's ``/model/decoder/Add_4_output_0``: int64 positions in one, the float embeddings its
MatMuls read in the other). Runs in the ORT child (imports onnxruntime).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterator, Mapping
from functools import cache
from typing import Any

import onnx

Types = dict[str, int]  # tensor name -> onnx.TensorProto element type


@cache
def _schemas() -> dict[tuple[str, str], list[tuple[int, Any]]]:
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    table: dict[tuple[str, str], list[tuple[int, Any]]] = {}
    for s in C.get_all_operator_schema():
        table.setdefault((s.domain, s.name), []).append((s.since_version, s))
    for versions in table.values():
        versions.sort(key=lambda v: v[0])
    return table


def _schema(node: onnx.NodeProto, opsets: dict[str, int]) -> Any:
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    opset = opsets.get(domain, opsets.get("ai.onnx", 1) if domain == "" else 1)
    return _schema_at(domain, node.op_type, opset)


@cache
def _schema_at(domain: str, op_type: str, opset: int) -> Any:
    versions = _schemas().get((domain, op_type), [])
    fitting = [s for v, s in versions if v <= opset]
    return fitting[-1] if fitting else (versions[-1][1] if versions else None)


@cache
def _signature(schema: Any) -> tuple[list[Any], list[Any], dict[str, list[str]]]:
    """(formal inputs, formal outputs, allowed types per type variable) of ``schema``: read from ORT's objects once
    per schema, not once per node (a family's thousands of nodes)."""
    allowed = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    return list(schema.inputs), list(schema.outputs), allowed


def at_default(node: onnx.NodeProto, opsets: dict[str, int]) -> set[str]:
    """Names of ``node``'s attributes whose value is the default ORT's schema of it gives. ORT 1.32 writes such an
    attribute in one save route and leaves it out in another (com.microsoft Attention's ``unidirectional``): the
    same node either way."""
    schema = _schema(node, opsets)
    if schema is None:
        return set()
    found = set()
    for a in node.attribute:
        formal = schema.attributes.get(a.name)
        raw = getattr(formal, "_default_value", b"") if formal is not None else b""
        if not raw:
            continue
        default = onnx.AttributeProto()
        default.ParseFromString(raw)
        if default.type == a.type and onnx.helper.get_attribute_value(default) == onnx.helper.get_attribute_value(a):
            found.add(a.name)
    return found


def _elem(type_str: str) -> int | None:
    """'tensor(float16)' -> TensorProto.FLOAT16; None for a type variable or a non-tensor type."""
    if not type_str.startswith("tensor(") or not type_str.endswith(")"):
        return None
    value = getattr(onnx.TensorProto, type_str[len("tensor(") : -1].upper(), None)
    return value if isinstance(value, int) else None


def _formal(params: list[Any], i: int) -> Any | None:
    """The schema parameter of actual position ``i`` (the last one repeats when it is variadic)."""
    if i < len(params):
        return params[i]
    if params and str(params[-1].option).endswith("Variadic"):
        return params[-1]
    return None


def node_types(node: onnx.NodeProto, opsets: dict[str, int], known: Mapping[str, int]) -> tuple[Types, Types]:
    """(the types of ``node``'s inputs, of its outputs) that ``known`` and ORT's schema of it determine."""
    schema = _schema(node, opsets)
    ins = {i: known[i] for i in node.input if i and i in known}
    if schema is None:
        return ins, {}
    formal_ins, formal_outs, allowed = _signature(schema)
    bound: dict[str, int] = {}
    for i, name in enumerate(node.input):
        formal = _formal(formal_ins, i)
        if formal is not None and name in known and formal.typeStr in allowed:
            bound.setdefault(formal.typeStr, known[name])

    def resolve(type_str: str) -> int | None:
        if type_str in bound:
            return bound[type_str]
        fixed = _elem(type_str)
        if fixed is not None:
            return fixed
        only = allowed.get(type_str, [])
        return _elem(only[0]) if len(only) == 1 else None

    for i, name in enumerate(node.input):
        formal = _formal(formal_ins, i)
        if name and name not in ins and formal is not None and (t := resolve(formal.typeStr)) is not None:
            ins[name] = t
    outs: Types = {}
    to = next((a.i for a in node.attribute if a.name == "to"), None)  # Cast and its kin: the attribute decides
    for i, name in enumerate(node.output):
        formal = _formal(formal_outs, i)
        if not name or formal is None:
            continue
        t = resolve(formal.typeStr)
        if t is None and to is not None and formal.typeStr not in bound:
            t = int(to)
        if t is not None:
            outs[name] = t
    return ins, outs


def _declared(graph: onnx.GraphProto) -> Types:
    found: Types = {}
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            found[vi.name] = vi.type.tensor_type.elem_type
    for t in graph.initializer:
        found[t.name] = t.data_type
    return found


class ScopeTypes:
    """Every tensor's element type that can be told, per scope: a graph's own over its enclosing graphs'.

    Each graph is typed once, when a node of it is first asked about (``of``)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._opsets = {o.domain or "": o.version for o in model.opset_import}
        # keyed by the ids of the scope's graphs; the scope is held so that no other graph takes one of those ids
        self._scopes: dict[tuple[int, ...], tuple[list[onnx.GraphProto], ChainMap[str, int]]] = {}

    def of(self, scope: list[onnx.GraphProto]) -> Mapping[str, int]:
        """The types visible in the innermost graph of ``scope`` (outermost first, as ``all_nodes`` gives it)."""
        return self._chain(scope)

    def _chain(self, scope: list[onnx.GraphProto]) -> ChainMap[str, int]:
        key = tuple(map(id, scope))
        held = self._scopes.get(key)
        if held is None:
            outer: ChainMap[str, int] = self._chain(scope[:-1]) if len(scope) > 1 else ChainMap()
            held = (scope, outer.new_child(_graph_types(scope[-1], self._opsets, outer)))
            self._scopes[key] = held
        return held[1]


def _graph_types(graph: onnx.GraphProto, opsets: dict[str, int], outer: ChainMap[str, int]) -> Types:
    """The types of the tensors ``graph`` itself declares or computes, its enclosing graphs' ``outer`` seen."""
    own = _declared(graph)
    seen = outer.new_child(own)
    for node in graph.node:
        _, outs = node_types(node, opsets, seen)
        for name, t in outs.items():
            if name not in seen:
                own[name] = t
    return own


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def all_nodes(graph: onnx.GraphProto) -> Iterator[tuple[onnx.NodeProto, list[onnx.GraphProto]]]:
    """Every node with the graphs enclosing it (outermost first), subgraph bodies included."""
    stack: list[tuple[onnx.GraphProto, list[onnx.GraphProto]]] = [(graph, [graph])]
    while stack:
        g, scope = stack.pop()
        for node in g.node:
            yield node, scope
            stack.extend((sub, [*scope, sub]) for sub in subgraphs(node))
