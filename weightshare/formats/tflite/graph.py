"""Checks and rewrites on the TFLite graph (the schema's ``ModelT``, buffers excluded).

``validate`` checks every index the converter follows (buffer, tensor, operator
code, subgraph) before it is used. ``plan_fp16_folds`` finds the constant fp16
tensors that LiteRT would dequantize into a private fp32 copy per interpreter
(the DEQUANTIZE kernel's ``Eval`` for a constant input writes to an arena
tensor), and ``apply_folds`` makes each DEQUANTIZE output a constant instead:
its consumers, the subgraph outputs and the signature defs keep pointing at the
same tensor index, so nothing else needs rewiring.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

from ai_edge_litert import schema_py_generated as schema

from ...errors import InvalidModel, Unsupported
from .flatbuf import OFFSET_PLACEHOLDER

DEQUANTIZE = schema.BuiltinOperator.DEQUANTIZE
DENSIFY = schema.BuiltinOperator.DENSIFY
FLOAT32 = schema.TensorType.FLOAT32
FLOAT16 = schema.TensorType.FLOAT16

TYPE_NAMES = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
# numpy-style dtype keys for the safetensors header (--external); anything else is stored as U8.
NUMPY_DTYPES = {
    "FLOAT32": "float32",
    "FLOAT16": "float16",
    "INT32": "int32",
    "UINT8": "uint8",
    "INT64": "int64",
    "BOOL": "bool",
    "INT16": "int16",
    "INT8": "int8",
    "FLOAT64": "float64",
    "UINT64": "uint64",
    "UINT32": "uint32",
    "UINT16": "uint16",
    "BFLOAT16": "bfloat16",
}


def builtin_code(opcode: schema.OperatorCodeT) -> int:
    # Schema rule (GetBuiltinCode): codes >= 127 live only in builtin_code, older files only in the deprecated int8.
    code: int = max(opcode.builtinCode, opcode.deprecatedBuiltinCode)
    return code


def tensor_name(t: schema.TensorT) -> str:
    name = t.name.decode("utf-8", "replace") if isinstance(t.name, bytes) else t.name
    return name or "<unnamed>"


def element_count(t: schema.TensorT) -> int | None:
    """Elements of a tensor with a static shape, or None when a dimension is unknown."""
    n = 1
    for d in t.shape if t.shape is not None else ():
        if d < 0:
            return None
        n *= int(d)
    return n


def indices(values: Iterable[int] | None) -> list[int]:
    """A tensor-index vector as ints; an absent vector (None in the object API) is an empty one."""
    return [] if values is None else [int(v) for v in values]


def validate(graph: schema.ModelT, nbuffers: int, path: str) -> None:
    """Check every cross-reference the converter follows; raise ``InvalidModel`` naming the first bad one."""
    subgraphs = graph.subgraphs or []
    if not subgraphs:
        raise InvalidModel("model has no subgraphs", path)
    ncodes = len(graph.operatorCodes or [])
    for si, sg in enumerate(subgraphs):
        if sg is None:
            raise InvalidModel(f"subgraph {si} is missing", path)
        tensors = sg.tensors or []
        n = len(tensors)
        for ti, t in enumerate(tensors):
            if t is None:
                raise InvalidModel(f"subgraph {si}: tensor {ti} is missing", path)
            if t.buffer >= nbuffers:
                raise InvalidModel(
                    f"subgraph {si}: tensor {ti} ({tensor_name(t)}) uses buffer {t.buffer}, but the "
                    f"model has {nbuffers} buffers",
                    path,
                )
        for idx in chain(indices(sg.inputs), indices(sg.outputs)):
            if not 0 <= idx < n:
                raise InvalidModel(f"subgraph {si}: input/output tensor index {idx} out of range ({n} tensors)", path)
        for oi, op in enumerate(sg.operators or []):
            if op is None:
                raise InvalidModel(f"subgraph {si}: operator {oi} is missing", path)
            if op.opcodeIndex >= ncodes:
                raise InvalidModel(
                    f"subgraph {si}: operator {oi} uses operator code {op.opcodeIndex}, but the model has {ncodes}",
                    path,
                )
            for idx in chain(indices(op.inputs), indices(op.outputs), indices(op.intermediates)):
                if not -1 <= idx < n:
                    raise InvalidModel(
                        f"subgraph {si}: operator {oi} uses tensor {idx}, out of range ({n} tensors)", path
                    )
            if op.largeCustomOptionsOffset > OFFSET_PLACEHOLDER:
                raise Unsupported(
                    f"subgraph {si}: operator {oi} keeps its custom options outside the flatbuffer "
                    "(models over 2 GB); not supported yet",
                    path,
                )
    for m in graph.metadata or []:
        if m is not None and m.buffer >= nbuffers:
            raise InvalidModel(f"metadata uses buffer {m.buffer}, but the model has {nbuffers} buffers", path)
    for sd in graph.signatureDefs or []:
        if sd is None:
            continue
        if sd.subgraphIndex >= len(subgraphs):
            raise InvalidModel(f"signature uses subgraph {sd.subgraphIndex}, but the model has {len(subgraphs)}", path)
        n = len(subgraphs[sd.subgraphIndex].tensors or [])
        for tm in chain(sd.inputs or [], sd.outputs or []):
            if tm is not None and tm.tensorIndex >= n:
                raise InvalidModel(f"signature tensor index {tm.tensorIndex} out of range ({n} tensors)", path)


@dataclass
class Fp16Fold:
    """DEQUANTIZE(fp16 constant) -> fp32 constant: ``dequantized`` gets the fp32 payload, the op goes away."""

    subgraph: int
    operator: int
    fp16_tensor: int
    dequantized: int
    fp16_buffer: int


def _consumers(sg: schema.SubGraphT) -> dict[int, list[int]]:
    used: dict[int, list[int]] = {}
    for oi, op in enumerate(sg.operators or []):
        for idx in indices(op.inputs):
            if idx >= 0:
                used.setdefault(idx, []).append(oi)
    return used


def plan_fp16_folds(graph: schema.ModelT, sizes: list[int], path: str) -> tuple[list[Fp16Fold], list[str]]:
    """Find DEQUANTIZE ops of constant fp16 tensors whose every consumer is a DEQUANTIZE.

    ``sizes`` gives each buffer's payload size (0: no data, so not a constant).
    Returns the folds and notes on the DEQUANTIZE ops left in place (and why).
    A fold candidate that contradicts itself (payload size not matching the
    shape, output not FLOAT32) is an invalid model, not a skip.
    """
    codes = [builtin_code(c) for c in graph.operatorCodes or []]
    folds, notes = [], []
    for si, sg in enumerate(graph.subgraphs):
        tensors, ops = sg.tensors or [], sg.operators or []
        consumers = _consumers(sg)
        boundary = set(indices(sg.inputs)) | set(indices(sg.outputs))
        for oi, op in enumerate(ops):
            if codes[op.opcodeIndex] != DEQUANTIZE:
                continue
            ins, outs = indices(op.inputs), indices(op.outputs)
            if len(ins) != 1 or len(outs) != 1 or ins[0] < 0 or outs[0] < 0:
                raise InvalidModel(f"subgraph {si}: DEQUANTIZE operator {oi} needs one input and one output", path)
            src, dst = tensors[ins[0]], tensors[outs[0]]
            where = f"subgraph {si}: DEQUANTIZE operator {oi} of {tensor_name(src)!r}"
            if src.type != FLOAT16:
                continue  # int8/int16 dequantization: kept (sharing it needs --unpack int8, not done for TFLite)
            payload = sizes[src.buffer] if src.buffer else 0
            if not payload:
                notes.append(f"{where}: input is not a constant, op kept")
                continue
            if dst.type != FLOAT32:
                raise InvalidModel(
                    f"{where}: output type is {TYPE_NAMES.get(dst.type, dst.type)}, expected FLOAT32", path
                )
            count = element_count(src)
            if src.sparsity is not None:
                notes.append(f"{where}: input is sparse, op kept (see --unpack sparse)")
                continue
            if count is None or payload != 2 * count:
                raise InvalidModel(
                    f"{where}: fp16 payload has {payload} bytes, but its shape "
                    f"{indices(src.shape)} needs {2 * (count or 0)}",
                    path,
                )
            if indices(dst.shape) != indices(src.shape):
                # LiteRT prepares consumers with the output's declared shape (a [] output is read as a scalar
                # broadcast), so a constant with the input's shape would change results: keep the op.
                notes.append(f"{where}: output shape {indices(dst.shape)} differs from the input's, op kept")
                continue
            if ins[0] in boundary or src.isVariable:
                notes.append(f"{where}: input is also a subgraph input/output, op kept")
                continue
            if any(codes[ops[c].opcodeIndex] != DEQUANTIZE for c in consumers.get(ins[0], [])):
                notes.append(f"{where}: the fp16 tensor has other consumers, op kept")
                continue
            if (dst.buffer and sizes[dst.buffer]) or outs[0] in set(indices(sg.inputs)) or dst.isVariable:
                raise InvalidModel(
                    f"{where}: output tensor {tensor_name(dst)!r} is a constant, input or variable", path
                )
            folds.append(Fp16Fold(si, oi, ins[0], outs[0], src.buffer))
    return folds, notes


def apply_folds(graph: schema.ModelT, folds: list[Fp16Fold], first_new_buffer: int) -> list[int]:
    """Point each dequantized tensor at a new buffer, detach the fp16 tensors, drop the ops.

    Returns the new buffer index of each fold (``first_new_buffer`` on, in order).
    """
    new_buffers = []
    removed: dict[int, set[int]] = {}
    for k, fold in enumerate(folds):
        sg = graph.subgraphs[fold.subgraph]
        sg.tensors[fold.dequantized].buffer = first_new_buffer + k
        sg.tensors[fold.fp16_tensor].buffer = 0  # no consumer is left; an unused tensor gets no arena memory
        removed.setdefault(fold.subgraph, set()).add(fold.operator)
        new_buffers.append(first_new_buffer + k)
    for si, ops in removed.items():
        sg = graph.subgraphs[si]
        sg.operators = [op for oi, op in enumerate(sg.operators) if oi not in ops]
    return new_buffers


def referenced_buffers(graph: schema.ModelT) -> set[int]:
    used = {m.buffer for m in graph.metadata or [] if m is not None}
    for sg in graph.subgraphs:
        used.update(t.buffer for t in sg.tensors or [])
    return used
