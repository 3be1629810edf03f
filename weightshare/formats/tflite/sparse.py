"""``--unpack sparse``: DENSIFY of a constant sparse tensor becomes a dense constant.

LiteRT runs DENSIFY once per interpreter into a private buffer; storing the dense
tensor in the file lets every interpreter share it (the trade: a larger file).
The decoding follows TFLite's ``FormatConverter::SparseToDense``: the
``dim_metadata`` levels, in traversal order, are either DENSE (``dense_size``
positions) or SPARSE_CSR (``array_segments`` / ``array_indices``); the stored
values come in that traversal order; block dimensions (``block_map``) multiply
into the original dimension they split. It runs level by level on numpy index
arrays rather than element by element, and it does hold the tensor in memory:
this is opt-in, and sparse weights are small next to dense ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from ..._tensors import BytesSource, PayloadSource, read_all
from ...errors import InvalidModel, Unsupported
from .graph import DENSIFY, TYPE_NAMES, builtin_code, element_count, indices, tensor_name

_VALUE_TYPES = {schema.TensorType.FLOAT32: "<f4", schema.TensorType.FLOAT16: "<f2", schema.TensorType.INT8: "i1"}
MAX_DENSE_BYTES = 1 << 30  # a dense tensor materialised in memory; beyond this the model is refused


@dataclass
class DensifyFold:
    subgraph: int
    operator: int
    sparse_tensor: int
    dense_tensor: int
    sparse_buffer: int


def _vector(
    v: schema.Int32VectorT | schema.Uint16VectorT | schema.Uint8VectorT | None, what: str, path: str
) -> np.ndarray:
    if v is None or getattr(v, "values", None) is None:
        raise InvalidModel(f"sparsity {what} is missing", path)
    return np.asarray(v.values, dtype=np.int64)


def densify(sparsity: schema.SparsityParametersT, shape: list[int], values: np.ndarray, path: str) -> np.ndarray:
    """The dense tensor (C order) that ``values`` encode under ``sparsity``; every index is checked."""
    rank = len(shape)
    order = [int(v) for v in (sparsity.traversalOrder if sparsity.traversalOrder is not None else [])]
    block_map = [int(v) for v in (sparsity.blockMap if sparsity.blockMap is not None else [])]
    levels = sparsity.dimMetadata or []
    if sorted(order) != list(range(len(order))) or len(order) != rank + len(block_map) or len(levels) != len(order):
        raise InvalidModel("sparsity traversal order, block map and dimension metadata disagree", path)
    if any(not 0 <= d < rank for d in block_map) or sorted(order[:rank]) != list(range(rank)):
        raise InvalidModel("sparsity block map or traversal order names a dimension the tensor lacks", path)
    block_size = [int(levels[rank + i].denseSize) for i in range(len(block_map))]
    dense_count = int(np.prod(shape, dtype=np.int64))
    prev = np.zeros(1, np.int64)
    columns: list[np.ndarray] = []
    for level, meta in enumerate(levels):
        if meta.format == schema.DimensionType.DENSE:
            n = int(meta.denseSize)
            if n < 0 or len(prev) * n > dense_count:
                raise InvalidModel(f"sparsity level {level}: dense size {n} is implausible", path)
            columns = [np.repeat(c, n) for c in columns] + [np.tile(np.arange(n, dtype=np.int64), len(prev))]
            prev = (prev[:, None] * n + np.arange(n, dtype=np.int64)).ravel()
        else:
            segments = _vector(meta.arraySegments, "array_segments", path)
            indices = _vector(meta.arrayIndices, "array_indices", path)
            if prev.size and (prev.max() + 1 >= segments.size):
                raise InvalidModel(f"sparsity level {level}: array_segments is too short", path)
            lo, hi = segments[prev], segments[prev + 1]
            if np.any(hi < lo) or (hi.size and (lo.min() < 0 or hi.max() > indices.size)):
                raise InvalidModel(f"sparsity level {level}: array_segments out of range", path)
            counts = hi - lo
            positions = np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts) + np.arange(
                counts.sum(), dtype=np.int64
            )
            columns = [np.repeat(c, counts) for c in columns] + [indices[positions]]
            prev = positions
    if prev.size != values.size:
        raise InvalidModel(f"sparse tensor stores {values.size} values but its sparsity describes {prev.size}", path)
    orig: list[np.ndarray] = [np.zeros(0, np.int64)] * rank  # every dimension is set from ``order`` below
    for i in range(rank):
        orig[order[i]] = columns[i]
    for i in range(rank, len(order)):
        b = order[i] - rank
        orig[block_map[b]] = orig[block_map[b]] * block_size[b] + columns[i]
    flat = np.zeros(prev.size, np.int64)
    for d in range(rank):
        if orig[d].size and (orig[d].min() < 0 or orig[d].max() >= shape[d]):
            raise InvalidModel(f"sparse index out of range for dimension {d} of size {shape[d]}", path)
        flat = flat * shape[d] + orig[d]
    dense = np.zeros(dense_count, values.dtype)
    dense[flat] = values
    return dense


def plan_densify(
    graph: schema.ModelT, sources: list[PayloadSource | None], path: str
) -> list[tuple[DensifyFold, PayloadSource]]:
    """Every DENSIFY of a constant sparse tensor, with the dense payload it becomes."""
    codes = [builtin_code(c) for c in graph.operatorCodes or []]
    folds: list[tuple[DensifyFold, PayloadSource]] = []
    for si, sg in enumerate(graph.subgraphs):
        for oi, op in enumerate(sg.operators or []):
            if codes[op.opcodeIndex] != DENSIFY:
                continue
            ins, outs = indices(op.inputs), indices(op.outputs)
            if len(ins) != 1 or len(outs) != 1 or min(ins + outs) < 0:
                raise InvalidModel(f"subgraph {si}: DENSIFY operator {oi} needs one input and one output", path)
            src, dst = sg.tensors[ins[0]], sg.tensors[outs[0]]
            where = f"subgraph {si}: DENSIFY operator {oi} of {tensor_name(src)!r}"
            source = sources[src.buffer] if src.buffer else None
            if source is None or src.sparsity is None:
                continue
            if src.type not in _VALUE_TYPES or dst.type != src.type:
                raise Unsupported(
                    f"{where}: type {TYPE_NAMES.get(src.type, src.type)} -> "
                    f"{TYPE_NAMES.get(dst.type, dst.type)} is not densified",
                    path,
                )
            count = element_count(dst)
            itemsize = np.dtype(_VALUE_TYPES[src.type]).itemsize
            if count is None or count * itemsize > MAX_DENSE_BYTES:
                raise Unsupported(f"{where}: dense size is unknown or above {MAX_DENSE_BYTES >> 20} MiB", path)
            if source.nbytes > count * itemsize:
                raise InvalidModel(f"{where}: {source.nbytes} bytes of values for {count} dense elements", path)
            raw = read_all(source)
            if len(raw) % itemsize:
                raise InvalidModel(f"{where}: payload is not a whole number of elements", path)
            shape = [int(d) for d in (dst.shape if dst.shape is not None else ())]
            dense = densify(src.sparsity, shape, np.frombuffer(raw, _VALUE_TYPES[src.type]), path)
            folds.append((DensifyFold(si, oi, ins[0], outs[0], src.buffer), BytesSource(dense.tobytes())))
    return folds


def apply_densify(graph: schema.ModelT, folds: list[DensifyFold], first_new_buffer: int) -> None:
    removed: dict[int, set[int]] = {}
    for k, fold in enumerate(folds):
        sg = graph.subgraphs[fold.subgraph]
        sg.tensors[fold.dense_tensor].buffer = first_new_buffer + k
        removed.setdefault(fold.subgraph, set()).add(fold.operator)
    for si, ops in removed.items():
        sg = graph.subgraphs[si]
        sg.operators = [op for oi, op in enumerate(sg.operators) if oi not in ops]
    # A sparse tensor no op reads any more is detached, so its buffer can be dropped.
    for fold in folds:
        sg = graph.subgraphs[fold.subgraph]
        read = any(fold.sparse_tensor in indices(op.inputs) for op in sg.operators)
        if not read and fold.sparse_tensor not in indices(sg.outputs):
            sg.tensors[fold.sparse_tensor].buffer = 0
