"""What the measuring and verifying code needs to know of a TFLite graph beside what LiteRT shows: which signature
inputs index a table (and how large it is), and how many bytes one interpreter's own buffers take.

Read from the flatbuffer (``flatbuf.py``, ``graph.py``): the runtime code (``_runtimes/litert.py``) takes these
figures from its caller and never reads a format itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# op -> (position of the index input, position of the indexed tensor)
_INDEXING = {"GATHER": (1, 0), "GATHER_ND": (1, 0), "EMBEDDING_LOOKUP": (0, 1)}
# ops whose output carries an index input's values on to a lookup: litert-torch reshapes token ids before its
# EMBEDDING_LOOKUP, and wraps positions as torch does for negative indices (SELECT(LESS(p, 0), ADD(p, n), p))
# before its GATHER_ND and scatter into the KV cache
_PASS_THROUGH = ("RESHAPE", "SQUEEZE", "EXPAND_DIMS", "CAST", "IDENTITY", "SELECT", "SELECT_V2", "ADD", "SUB")


def _subgraph_bounds(graph: Any, sg: Any) -> dict[int, int | None]:
    """Tensor index of a subgraph input whose values index a table -> exclusive bound (None: size unknown)."""
    from ai_edge_litert import schema_py_generated as schema

    from .graph import builtin_code, indices

    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    codes = [names.get(builtin_code(c), "") for c in graph.operatorCodes or []]
    tensors = sg.tensors or []
    carries = {i: i for i in indices(sg.inputs)}  # tensor -> the subgraph input whose values it holds
    bounds: dict[int, int | None] = {}
    for op in sg.operators or []:
        name = codes[op.opcodeIndex] if 0 <= op.opcodeIndex < len(codes) else ""
        ins, outs = indices(op.inputs), indices(op.outputs)
        carried = next((carries[i] for i in ins if i in carries), None)
        if name in _PASS_THROUGH and carried is not None:
            for o in outs:
                carries[o] = carried
            continue
        where = _INDEXING.get(name)
        if where is None or len(ins) <= max(where) or ins[where[0]] not in carries:
            continue
        table = tensors[ins[where[1]]] if 0 <= ins[where[1]] < len(tensors) else None
        shape = None if table is None else table.shapeSignature if table.shapeSignature is not None else table.shape
        dims = [] if shape is None else [int(d) for d in shape]
        if name == "GATHER":
            axis = int(getattr(op.builtinOptions, "axis", 0) or 0)
            dims = dims[axis:] if 0 <= axis < len(dims) else dims[axis:][:1] if -len(dims) <= axis < 0 else []
        if name == "GATHER_ND":  # the indices' last dim k addresses the table's first k dims
            index = tensors[ins[where[0]]] if 0 <= ins[where[0]] < len(tensors) else None
            k = int(index.shape[-1]) if index is not None and index.shape is not None and len(index.shape) else 0
            dims = dims[:k] if 0 < k <= len(dims) else dims
        size = (min(dims) if name == "GATHER_ND" else dims[0]) if dims else -1
        source = carries[ins[where[0]]]
        known = bounds.get(source)
        if size < 1:
            bounds.setdefault(source, None)
        else:
            bounds[source] = size if known is None else min(known, size)
    return bounds


def _text(value: bytes | str | None) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value or "")


def signature_bounds(model_path: str) -> dict[str, dict[str, int | None]]:
    """Signature key -> input name -> exclusive bound of the values it must take, for inputs used as indices
    (GATHER, GATHER_ND, EMBEDDING_LOOKUP, directly or through a reshape/cast), read from the model's graph: each
    signature runs its own subgraph, whose ops the Interpreter's ``_get_ops_details`` (primary subgraph only) does
    not list. Names are the signature's (``tokens``, not ``prefill_tokens:0``); the primary subgraph of a model
    without SignatureDefs is key "" with tensor names."""
    from .flatbuf import check_header, open_model, read_graph
    from .graph import tensor_name

    with open_model(model_path) as (reader, mapping):
        check_header(reader)
        graph = read_graph(reader, mapping)
    subgraphs = graph.subgraphs or []
    out: dict[str, dict[str, int | None]] = {}
    if not graph.signatureDefs:
        if subgraphs:
            sg = subgraphs[0]
            out[""] = {tensor_name(sg.tensors[i]): b for i, b in _subgraph_bounds(graph, sg).items()}
        return out
    for sd in graph.signatureDefs:
        key = _text(sd.signatureKey)
        if not 0 <= sd.subgraphIndex < len(subgraphs):
            continue
        by_tensor = _subgraph_bounds(graph, subgraphs[sd.subgraphIndex])
        names = {int(m.tensorIndex): _text(m.name) for m in sd.inputs or []}
        out[key] = {names[i]: b for i, b in by_tensor.items() if i in names}
    return out


def instance_buffers(model_path: str, interp: Any, io_copies: bool = False) -> int:
    """Bytes of one instance's own buffers after its signatures ran: every tensor an op of a signature's subgraph
    reads or writes that is not a weight (activations, inputs and outputs, the KV cache fed in and out), at the
    shapes ``interp`` allocated. Weights and their per-interpreter copies (the outputs of DEQUANTIZE and DENSIFY
    of constants) are not buffers. An upper bound of LiteRT's arena, which reuses memory between tensors whose
    lifetimes do not overlap. ``io_copies``: the instance also holds its own copy of every signature's inputs and
    outputs (``weightshare.litert.interpreter``'s TensorBuffers). ``interp``: a LiteRT Interpreter of the model."""
    from ai_edge_litert import schema_py_generated as schema

    from .flatbuf import check_header, open_model, read_buffer_refs, read_graph
    from .graph import builtin_code, indices

    with open_model(model_path) as (reader, mapping):
        check_header(reader)
        sizes = [r.nbytes for r in read_buffer_refs(reader)]
        graph = read_graph(reader, mapping)
    codes = [builtin_code(c) for c in graph.operatorCodes or []]
    unpacking = {schema.BuiltinOperator.DEQUANTIZE, schema.BuiltinOperator.DENSIFY}
    subgraphs = sorted({int(sd.subgraphIndex) for sd in graph.signatureDefs or []}) or [0]
    total = 0
    for si in subgraphs:
        if not 0 <= si < len(graph.subgraphs or []):
            continue
        sg = graph.subgraphs[si]
        tensors = sg.tensors or []
        weights = {i for i, x in enumerate(tensors) if 0 < x.buffer < len(sizes) and sizes[x.buffer]}
        used = set(indices(sg.inputs)) | set(indices(sg.outputs))
        for op in sg.operators or []:
            ins, outs = indices(op.inputs), indices(op.outputs)
            used |= {i for i in ins + outs if i >= 0}
            if 0 <= op.opcodeIndex < len(codes) and codes[op.opcodeIndex] in unpacking and ins and ins[0] in weights:
                weights |= set(outs)  # a copy of a weight per interpreter: counted as a copy, not a buffer
        io = set(indices(sg.inputs)) | set(indices(sg.outputs))
        for ti in sorted(used - weights):
            try:
                d = interp._get_tensor_details(ti, si)  # no public API gives another subgraph's tensors
            except (ValueError, RuntimeError, IndexError):
                continue
            nbytes = int(np.prod([max(int(x), 0) for x in d["shape"]], dtype=np.int64)) * np.dtype(d["dtype"]).itemsize
            total += nbytes * (2 if io_copies and ti in io else 1)
    return total
