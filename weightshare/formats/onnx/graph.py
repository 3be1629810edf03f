"""Walking the parsed skeleton: scopes (graphs, subgraphs, functions) and where each payload sits."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import onnx

from ...errors import InvalidModel
from .scan import REF_KEY


@dataclass
class Site:
    """Where the payload with ref ``index`` sits in the skeleton."""

    index: int
    tensor: onnx.TensorProto
    name: str  # the value name the graph knows it by (initializer name, Constant output, ...)
    kind: str  # "initializer", "constant", "sparse", "sparse indices", "attribute"
    scope: onnx.GraphProto | onnx.FunctionProto
    node: onnx.NodeProto | None = None


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.HasField("g"):
            yield attr.g
        yield from attr.graphs


def iter_scopes(model: onnx.ModelProto) -> Iterator[onnx.GraphProto | onnx.FunctionProto]:
    """Every graph (main, nested at any depth, training) and every model-local function."""
    stack: list[onnx.GraphProto | onnx.FunctionProto] = []
    if model.HasField("graph"):
        stack.append(model.graph)
    for info in model.training_info:
        stack.extend(g for g in (info.initialization, info.algorithm) if g.ByteSize())
    stack.extend(reversed(model.functions))
    seen: list[onnx.GraphProto | onnx.FunctionProto] = []
    while stack:
        scope = stack.pop()
        seen.append(scope)
        for node in scope.node:
            stack.extend(subgraphs(node))
    yield from seen


def ref_index(tensor: onnx.TensorProto) -> int | None:
    for entry in tensor.external_data:
        if entry.key == REF_KEY:
            return int(entry.value)
    return None


def collect_sites(model: onnx.ModelProto) -> dict[int, Site]:
    sites: dict[int, Site] = {}

    def add(tensor: onnx.TensorProto, name: str, kind: str, node: onnx.NodeProto | None = None) -> None:
        index = ref_index(tensor)
        if index is not None:
            # A Constant's value is known by the node's output name; the tensor's own name is decoration.
            sites[index] = Site(index, tensor, name if kind == "constant" else tensor.name or name, kind, scope,
                                node)

    for scope in iter_scopes(model):
        if isinstance(scope, onnx.GraphProto):
            for t in scope.initializer:
                add(t, t.name, "initializer")
            for sp in scope.sparse_initializer:
                add(sp.values, sp.values.name, "sparse")
                add(sp.indices, f"{sp.values.name}.indices", "sparse indices")
        for node in scope.node:
            owner = node.output[0] if node.output else node.name
            for attr in node.attribute:
                is_value = node.op_type == "Constant" and attr.name == "value"
                if attr.HasField("t"):
                    add(attr.t, owner if is_value else f"{owner}.{attr.name}", "constant" if is_value else "attribute",
                        node)
                for i, t in enumerate(attr.tensors):
                    add(t, f"{owner}.{attr.name}.{i}", "attribute", node)
                sparse = list(attr.sparse_tensors) + ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else [])
                for i, sp in enumerate(sparse):
                    add(sp.values, f"{owner}.{attr.name}.{i}.values", "sparse", node)
                    add(sp.indices, f"{owner}.{attr.name}.{i}.indices", "sparse indices", node)
    return sites


def check_unique_constants(model: onnx.ModelProto, path: str | os.PathLike[str]) -> None:
    """Refuse a scope that defines one constant name twice (initializers, sparse initializers, Constants).

    ORT loads such a model with a warning, but which definition wins depends on how each is stored
    (measured with ORT 1.32: inline, the first of two 2 KB initializers; external, the last), so a
    conversion that only moves bytes could change the model's outputs.
    """
    for scope in iter_scopes(model):
        seen: set[str] = set()
        names = [n.output[0] for n in scope.node if n.op_type == "Constant" and len(n.output) == 1]
        if isinstance(scope, onnx.GraphProto):
            names += [t.name for t in scope.initializer] + [sp.values.name for sp in scope.sparse_initializer]
        for name in names:
            if name in seen:
                where = f"graph {scope.name!r}" if isinstance(scope, onnx.GraphProto) else f"function {scope.name!r}"
                raise InvalidModel(f"tensor {name!r} is defined twice in {where}; ONNX Runtime picks one depending "
                                   "on how each is stored, so rename or remove one", path)
            seen.add(name)
