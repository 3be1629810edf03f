"""Walking the parsed skeleton: scopes (graphs, subgraphs, functions) and where each payload sits."""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator, Mapping

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from ...errors import InvalidModel
from ._proto import pb
from .scan import REF_KEY


class Site:
    """Where the payload with ref ``index`` sits in the skeleton.

    ``name`` is the value name the graph knows it by (initializer name, Constant output, ...); ``kind`` is
    "initializer", "constant", "sparse", "sparse indices" or "attribute". An initializer's site keeps only its
    position in ``scope.initializer``: its tensor and name are looked up when asked for, so 200,000 sites hold
    no protobuf wrapper and no name string each.
    """

    __slots__ = ("_name", "_pos", "_tensor", "index", "kind", "node", "scope")

    def __init__(
        self,
        index: int,
        tensor: pb.TensorProto | None,
        name: str | None,
        kind: str,
        scope: pb.GraphProto | pb.FunctionProto,
        node: pb.NodeProto | None = None,
        pos: int = -1,
    ):
        self.index, self.kind, self.scope, self.node = index, kind, scope, node
        self._tensor, self._name, self._pos = tensor, name, pos

    @property
    def tensor(self) -> pb.TensorProto:
        if self._tensor is not None:
            return self._tensor
        return self.scope.initializer[self._pos]  # type: ignore[union-attr]

    @property
    def name(self) -> str:
        return self._name if self._name is not None else self.tensor.name

    @name.setter
    def name(self, value: str) -> None:
        self._name = None if self._tensor is None and value == self.tensor.name else value

    def __repr__(self) -> str:
        return f"Site({self.index}, {self.name!r}, {self.kind!r})"


class SiteMap(Mapping[int, Site]):
    """ref index -> Site, stored as a list by index (ref indices are dense), iterated in index order.

    An initializer's site is two numbers (its scope, its position there) until asked for: the ``Site`` is then
    made afresh, its tensor and name read from the model, so 200,000 initializers cost no object each while the
    parsed model lives. Such a site's state is the model's: renaming one means renaming its tensor.
    """

    def __init__(self) -> None:
        self._sites: list[Site | None] = []
        self._scopes: list[pb.GraphProto] = []
        self._scope_of = array("i")  # -1: in _sites (or no site)
        self._pos = array("q")
        self._count = 0

    def _grow(self, index: int) -> None:
        if index >= len(self._sites):
            more = index + 1 - len(self._sites)
            self._sites.extend([None] * more)
            self._scope_of.extend(array("i", [-1]) * more)
            self._pos.extend(array("q", [0]) * more)

    def __setitem__(self, index: int, site: Site) -> None:
        self._grow(index)
        if self._sites[index] is None and self._scope_of[index] < 0:
            self._count += 1
        self._sites[index] = site
        self._scope_of[index] = -1

    def add_initializer(self, index: int, scope_number: int, scope: pb.GraphProto, pos: int) -> None:
        """Record the site of ``scope.initializer[pos]``; ``scope_number`` counts scopes from 0, one per scope."""
        if scope_number == len(self._scopes):
            self._scopes.append(scope)
        self._grow(index)
        if self._sites[index] is None and self._scope_of[index] < 0:
            self._count += 1
        self._sites[index] = None
        self._scope_of[index] = scope_number
        self._pos[index] = pos

    def __getitem__(self, index: int) -> Site:
        if not (isinstance(index, int) and 0 <= index < len(self._sites)):
            raise KeyError(index)
        site = self._sites[index]
        if site is not None:
            return site
        scope = self._scope_of[index]
        if scope < 0:
            raise KeyError(index)
        return Site(index, None, None, "initializer", self._scopes[scope], pos=self._pos[index])

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        scope_of = self._scope_of
        return (i for i, site in enumerate(self._sites) if site is not None or scope_of[i] >= 0)


def subgraphs(node: pb.NodeProto) -> Iterator[pb.GraphProto]:
    for attr in node.attribute:
        if attr.HasField("g"):
            yield attr.g
        yield from attr.graphs


def iter_scopes(model: pb.ModelProto) -> Iterator[pb.GraphProto | pb.FunctionProto]:
    """Every graph (main, nested at any depth, training) and every model-local function."""
    stack: list[pb.GraphProto | pb.FunctionProto] = []
    if model.HasField("graph"):
        stack.append(model.graph)
    for info in model.training_info:
        stack.extend(g for g in (info.initialization, info.algorithm) if g.ByteSize())
    stack.extend(reversed(model.functions))
    seen: list[pb.GraphProto | pb.FunctionProto] = []
    while stack:
        scope = stack.pop()
        seen.append(scope)
        for node in scope.node:
            stack.extend(subgraphs(node))
    yield from seen


def ref_index(tensor: pb.TensorProto) -> int | None:
    for entry in tensor.external_data:
        if entry.key == REF_KEY:
            return int(entry.value)
    return None


def collect_sites(model: pb.ModelProto) -> SiteMap:
    sites = SiteMap()

    def add(tensor: pb.TensorProto, name: str, kind: str, node: pb.NodeProto | None = None) -> None:
        index = ref_index(tensor)
        if index is not None:
            # A Constant's value is known by the node's output name; the tensor's own name is decoration.
            sites[index] = Site(index, tensor, name if kind == "constant" else tensor.name or name, kind, scope, node)

    graphs = 0
    for scope in iter_scopes(model):
        if isinstance(scope, pb.GraphProto):
            found = False
            for pos, t in enumerate(scope.initializer):
                index = ref_index(t)
                if index is not None:
                    sites.add_initializer(index, graphs, scope, pos)
                    found = True
            graphs += found
            for sp in scope.sparse_initializer:
                add(sp.values, sp.values.name, "sparse")
                add(sp.indices, f"{sp.values.name}.indices", "sparse indices")
        for node in scope.node:
            owner = node.output[0] if node.output else node.name
            for attr in node.attribute:
                is_value = node.op_type == "Constant" and attr.name == "value"
                if attr.HasField("t"):
                    add(
                        attr.t,
                        owner if is_value else f"{owner}.{attr.name}",
                        "constant" if is_value else "attribute",
                        node,
                    )
                for i, t in enumerate(attr.tensors):
                    add(t, f"{owner}.{attr.name}.{i}", "attribute", node)
                sparse = list(attr.sparse_tensors) + ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else [])
                for i, sp in enumerate(sparse):
                    add(sp.values, f"{owner}.{attr.name}.{i}.values", "sparse", node)
                    add(sp.indices, f"{owner}.{attr.name}.{i}.indices", "sparse indices", node)
    return sites


def check_unique_constants(model: pb.ModelProto, path: str | os.PathLike[str]) -> None:
    """Refuse a scope that defines one constant name twice (initializers, sparse initializers, Constants).

    ORT loads such a model with a warning, but which definition wins depends on how each is stored
    (measured with ORT 1.32: inline, the first of two 2 KB initializers; external, the last), so a
    conversion that only moves bytes could change the model's outputs.
    """
    for scope in iter_scopes(model):
        seen: set[str] = set()
        names = [n.output[0] for n in scope.node if n.op_type == "Constant" and len(n.output) == 1]
        if isinstance(scope, pb.GraphProto):
            names += [t.name for t in scope.initializer] + [sp.values.name for sp in scope.sparse_initializer]
        for name in names:
            if name in seen:
                where = f"graph {scope.name!r}" if isinstance(scope, pb.GraphProto) else f"function {scope.name!r}"
                raise InvalidModel(
                    f"tensor {name!r} is defined twice in {where}; ONNX Runtime picks one depending "
                    "on how each is stored, so rename or remove one",
                    path,
                )
            seen.add(name)


def external_tensors(msg: Message) -> Iterator[pb.TensorProto]:
    """Every tensor with external data anywhere in ``msg`` (initializers, attributes, subgraphs, functions)."""
    if isinstance(msg, pb.TensorProto):
        if msg.data_location == pb.TensorProto.EXTERNAL:
            yield msg
        return
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        for item in value if _repeated(field) else [value]:
            yield from external_tensors(item)


def _repeated(field: FieldDescriptor) -> bool:
    # protobuf >= 5 dropped FieldDescriptor.label for is_repeated; older versions have only label.
    repeated = getattr(field, "is_repeated", None)
    return bool(repeated) if repeated is not None else getattr(field, "label", None) == 3  # LABEL_REPEATED
