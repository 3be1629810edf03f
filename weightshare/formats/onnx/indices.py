"""Which graph inputs index a table, and the exclusive bound of the values each may take (verify's and check's
generated inputs).

ONNX Runtime checks indices: a random token id beyond a table's rows fails the original ("indices element out of
data bounds"), and a random value of a small table (BERT's 2 segment rows) does the same. Exporters rarely feed a
graph input straight into the op that indexes: the transformers optimizer casts int64 ids to int32 before
``EmbedLayerNormalization``, a QDQ model gathers rows of a ``DequantizeLinear`` output, an OPT-like model adds an
offset to its positions, a genai int4 model gathers through ``GatherBlockQuantized``. So the rule is general: each
integer graph input is followed forward through the ops that carry its values unchanged (a cast, a reshape, a
slice, a concatenation, ...; an ``Add`` of a constant shifts them) to every op that uses them as indices, and is
bounded by the size of the axis each such op indexes, less the offset added on the way. The table's size is its
known shape, else that of the tensor a shape-preserving op (``DequantizeLinear``, ``Cast``) made it from.

Reads protobuf messages only (no ``import onnx``): the measuring child reads the model with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

__all__ = ["INDEXING", "index_bounds", "model_index_bounds"]

# op type -> [(position of an index input, position of the tensor it indexes, axis)]; axis None: the node's own
# ``axis`` attribute (``gather_axis`` for GatherBlockQuantized), default 0
INDEXING: dict[str, list[tuple[int, int, int | None]]] = {
    "Gather": [(1, 0, None)],
    "GatherElements": [(1, 0, None)],
    "GatherND": [(1, 0, None)],
    "GatherBlockQuantized": [(1, 0, None)],  # com.microsoft: rows of a block-quantized table (genai int4 embeddings)
    "ScatterElements": [(1, 0, None)],
    "ScatterND": [(1, 0, None)],
    "Scatter": [(1, 0, None)],
    "EmbedLayerNormalization": [(0, 2, 0), (1, 4, 0), (8, 3, 0)],  # input_ids, segment_ids, position_ids
    "RotaryEmbedding": [(1, 2, 0)],  # position_ids index cos_cache's rows
}
# ops whose outputs hold values of the given inputs unchanged (rearranged, selected, repeated):
# op type -> input positions that carry values (None: every input)
_CARRY: dict[str, tuple[int, ...] | None] = {
    "Cast": (0,),
    "CastLike": (0,),
    "Identity": (0,),
    "Reshape": (0,),
    "Unsqueeze": (0,),
    "Squeeze": (0,),
    "Flatten": (0,),
    "Slice": (0,),
    "Concat": None,
    "Expand": (0,),
    "Transpose": (0,),
    "Tile": (0,),
    "Split": (0,),
    "Gather": (0,),  # values picked from the index tensor itself
    "GatherElements": (0,),
    "Where": (1, 2),
    "Abs": (0,),
}
# ops whose output has its data input's shape: a table's size is read through them
_SAME_SHAPE = {"DequantizeLinear", "Cast", "CastLike", "Identity", "QuantizeLinear"}
_INTEGER_TYPES = {2, 3, 4, 5, 6, 7, 12, 13}  # uint8, int8, uint16, int16, int32, int64, uint32, uint64
_MAX_DEPTH = 64  # ops between a graph input and its use: deeper chains are not followed (a hostile graph)


def _graphs(graph: onnx.GraphProto, depth: int = 0) -> list[onnx.GraphProto]:
    out = [graph]
    if depth > 16:
        return out
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("g"):
                out += _graphs(a.g, depth + 1)
            for g in a.graphs:
                out += _graphs(g, depth + 1)
    return out


def _attr(node: onnx.NodeProto, *names: str) -> int | None:
    return next((int(a.i) for name in names for a in node.attribute if a.name == name), None)


def _ints(t: onnx.TensorProto) -> list[int] | None:
    """The values of a small integer constant, or None."""
    import numpy as np

    dtypes = {6: np.int32, 7: np.int64, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16}
    dtype = dtypes.get(t.data_type)
    count = 1
    for d in t.dims:
        count *= d
    if dtype is None or count > 4096:
        return None
    if t.raw_data:
        if len(t.raw_data) != count * np.dtype(dtype).itemsize:
            return None
        return [int(v) for v in np.frombuffer(t.raw_data, dtype)]
    values = list(t.int64_data) if t.data_type == 7 else list(t.int32_data)
    return [int(v) for v in values] if len(values) == count else None


def _shapes(graphs: Iterable[onnx.GraphProto]) -> dict[str, list[int | None]]:
    shapes: dict[str, list[int | None]] = {}
    for g in graphs:
        for t in g.initializer:
            shapes[t.name] = list(t.dims)
        for vi in list(g.input) + list(g.value_info) + list(g.output):
            if vi.name not in shapes and vi.type.HasField("tensor_type"):
                dims = vi.type.tensor_type.shape.dim
                shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
        for node in g.node:
            if node.op_type == "Constant" and node.output:
                value = next((a.t for a in node.attribute if a.name == "value" and a.HasField("t")), None)
                if value is not None:
                    shapes[node.output[0]] = list(value.dims)
    return shapes


def index_bounds(graph: onnx.GraphProto) -> dict[str, int | None]:
    """Integer graph inputs whose values reach an index input, directly or through ops that carry them: name ->
    exclusive bound (the smallest indexed axis, less what was added on the way), None when an input used directly
    as indices indexes a tensor of unknown size (random values would be out of range). Subgraphs (``If``,
    ``Loop`` bodies) are followed too: their nodes read outer-scope names."""
    graphs = _graphs(graph)
    shapes = _shapes(graphs)
    consts: dict[str, list[int] | None] = {}
    producer: dict[str, onnx.NodeProto] = {}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for g in graphs:
        for t in g.initializer:
            consts[t.name] = _ints(t)
        for node in g.node:
            for o in node.output:
                producer[o] = node
            if node.op_type == "Constant" and node.output:
                value = next((a.t for a in node.attribute if a.name == "value" and a.HasField("t")), None)
                consts[node.output[0]] = _ints(value) if value is not None else None
            for i, name in enumerate(node.input):
                if name:
                    consumers.setdefault(name, []).append((node, i))

    def table_shape(name: str) -> list[int | None] | None:
        for _ in range(_MAX_DEPTH):
            shape = shapes.get(name)
            if shape and all(shape):
                return shape
            node = producer.get(name)
            if node is None or node.op_type not in _SAME_SHAPE or not node.input:
                return shape
            name = node.input[0]
        return None

    def indexed(node: onnx.NodeProto, data: int, axis: int | None) -> int | None:
        shape = table_shape(node.input[data])
        if not shape:
            return None
        if node.op_type == "GatherND":  # the last index axis picks along data's axes after batch_dims
            known = shape[_attr(node, "batch_dims") or 0 :]
            return min(known) if known and all(known) else None  # type: ignore[type-var]
        ax = axis if axis is not None else (_attr(node, "gather_axis", "axis") or 0)
        if not -len(shape) <= ax < len(shape) or not shape[ax]:
            return None
        size = int(shape[ax] or 0)
        packed = node.op_type == "GatherBlockQuantized" and ax % len(shape) == len(shape) - 1
        if packed and (_attr(node, "bits") or 4) == 4 and _elem_type(graphs, node.input[data]) == 2:
            size *= 2  # two 4-bit values per uint8 along the last axis
        return size

    bounds: dict[str, int | None] = {}
    main_inputs = {t.name for t in graph.initializer}
    for inp in graph.input:
        if inp.name in main_inputs or inp.type.tensor_type.elem_type not in _INTEGER_TYPES:
            continue
        found: list[int | None] = []
        seen: set[tuple[str, int]] = set()
        todo = [(inp.name, 0, 0)]  # (tensor carrying the input's values, offset added so far, ops followed)
        while todo:
            name, offset, depth = todo.pop()
            if (name, offset) in seen or depth > _MAX_DEPTH:
                continue
            seen.add((name, offset))
            for node, i in consumers.get(name, []):
                for index, data, axis in INDEXING.get(node.op_type, []):
                    if i == index and len(node.input) > data and node.input[data]:
                        size = indexed(node, data, axis)
                        if size is not None:
                            found.append(max(size - max(offset, 0), 1))
                        elif depth == 0:  # used as indices as it is: random values cannot be made
                            found.append(None)
                for out, shift in _carried(node, i, consts):
                    todo.append((out, offset + shift, depth + 1))
        if found:
            bounds[inp.name] = None if None in found else min(b for b in found if b is not None)
    return bounds


def _carried(node: onnx.NodeProto, i: int, consts: dict[str, list[int] | None]) -> list[tuple[str, int]]:
    """The outputs of ``node`` that carry the values of its ``i``-th input, each with what it adds to them."""
    if node.op_type in ("Add", "Sub") and len(node.input) == 2 and node.output:
        other = consts.get(node.input[1 - i])
        if node.op_type == "Sub" and i == 1:
            return []  # negated: no longer an index of the same range
        if other is None:  # added to a value we cannot read: followed unshifted (the other input has its bound)
            return [(node.output[0], 0)]
        shift = max(other, default=0) if node.op_type == "Add" else -min(other, default=0)
        return [(node.output[0], shift)]
    carries = _CARRY.get(node.op_type, ())
    if carries is None or i in carries:
        outs = node.output if node.op_type == "Split" else node.output[:1]
        return [(o, 0) for o in outs if o]
    return []


def _elem_type(graphs: Iterable[onnx.GraphProto], name: str) -> int | None:
    for g in graphs:
        for t in g.initializer:
            if t.name == name:
                return int(t.data_type)
    return None


def model_index_bounds(model_path: str) -> dict[str, int | None]:
    """``index_bounds`` of the model file at ``model_path``: integer graph inputs whose values reach an index,
    name -> exclusive upper bound, None when a direct use indexes a tensor of unknown size.

    Random indices outside the indexed axis make the original model fail (ORT checks Gather indices), so they are
    drawn from [0, bound) (``_runtimes.ort.random_feeds``'s ``bounds``).
    """
    from ._proto import load_model  # the message classes only: `import onnx` costs ~1 CPU s

    return index_bounds(load_model(model_path).graph)
