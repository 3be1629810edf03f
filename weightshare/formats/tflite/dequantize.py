"""``--unpack dequantize``: DEQUANTIZE of a constant integer tensor (weight-only int8/int4) becomes an fp32 constant.

LiteRT runs such a DEQUANTIZE once per interpreter into a private fp32 buffer (the builtin kernel into a
persistent arena tensor; the XNNPACK delegate into its own "static unpacked" buffer), so every interpreter
and every CompiledModel pays 4 bytes per weight privately. Storing the fp32 values in the file lets every
instance map one copy; the trade is a file four (int8) or eight (int4) times larger.

The values are LiteRT's, bit for bit (tflite/kernels/dequantize.cc, kernels/internal/optimized/optimized_ops.h
``Dequantize``, reference/dequantize.h ``PerChannelDequantize``; the XNNPACK delegate's quantization_util.cc calls
the same two functions), checked against the kernel itself in tests/test_tflite_dequantize.py:

- per tensor (one scale): in blocks of 8 elements ``float(q) * float(scale) + float(-zero_point * scale)``
  (two float roundings: the wheel's x86_64 build runs the NEON code through SSE, without FMA), and the last
  ``count % 8`` elements as ``float(double(scale) * (q - zero_point))``;
- per channel (several scales along ``quantized_dimension``, one zero point each): ``float(scale[c]) *
  float(q - zero_point[c])``, the correctly rounded product.

Folded: INT8 only (see ``FOLDED``). Kept, with a note: other integer types, blockwise quantization (LiteRT's
DEQUANTIZE kernel has no blockwise case), sparse inputs, inputs with other consumers. An Arm build with FMA
rounds the per-tensor blocks once (``fma``): with a non-zero zero point its values can differ in the last
bit from the x86_64 ones this module reproduces (a note says so); with zero point 0 they are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from ..._tensors import CHUNK_SIZE, PayloadSource
from ...errors import InvalidModel
from .graph import DEQUANTIZE, FLOAT32, TYPE_NAMES, builtin_code, element_count, indices, tensor_name
from .sparse import DensifyFold

TT = schema.TensorType
_BITS = {TT.INT8: (8, True), TT.UINT8: (8, False), TT.INT16: (16, True), TT.INT4: (4, True)}


@dataclass
class DequantizedSource:
    """The fp32 values of a quantized payload, chunk by chunk (memory: one chunk, never the tensor)."""

    inner: PayloadSource
    count: int  # elements
    bits: int
    signed: bool
    scales: np.ndarray  # float64 (exact copies of the float32 scales)
    zero_points: np.ndarray  # int64, one per scale
    inner_size: int  # elements between two steps of the quantized dimension

    stable_chunks = False

    @property
    def nbytes(self) -> int:
        return 4 * self.count

    def _values(self, raw: bytes, first: int, n: int) -> np.ndarray:
        if self.bits == 4:
            b = np.frombuffer(raw, np.int8)
            q = np.empty(2 * len(b), np.int32)
            q[0::2] = (b.astype(np.int16) << 12).astype(np.int16) >> 12  # low nibble, sign extended
            q[1::2] = b >> 4
            q = q[:n]
        else:
            kind = ("i" if self.signed else "u") + str(self.bits // 8)
            q = np.frombuffer(raw, np.dtype(kind).newbyteorder("<")).astype(np.int32)
        if len(self.scales) == 1:
            return self._per_tensor(q, first, n)
        channel = (np.arange(first, first + n, dtype=np.int64) // self.inner_size) % len(self.scales)
        q -= self.zero_points.astype(np.int32)[channel]  # exact in int32, and in float32 (|q - zp| < 2**24)
        # float * float: the correctly rounded product, as the kernel's float(scale[c]) * (q - zp[c])
        out: np.ndarray = self.scales.astype(np.float32)[channel] * q.astype(np.float32)
        return out

    def _per_tensor(self, q: np.ndarray, first: int, n: int) -> np.ndarray:
        """optimized_ops::Dequantize: blocks of 8 in float (q * scale + (-zero_point * scale), two roundings, as
        the x86_64 wheel's NEON-to-SSE build runs it); the last ``count % 8`` elements in double, rounded once."""
        scale, zp = self.scales[0], int(self.zero_points[0])
        out: np.ndarray = (np.float32(scale) * q.astype(np.float32)) + np.float32(-zp * scale)
        tail = self.count - self.count % 8 - first  # position in this chunk where the scalar loop starts
        if tail < n:
            start = max(tail, 0)
            out[start:] = (scale * (q[start:] - zp)).astype(np.float32)
        return out.astype(np.float32, copy=False)

    def chunks(self, chunk_size: int = CHUNK_SIZE) -> Iterator[memoryview]:
        per_chunk = max(2, (chunk_size // 4) & ~1)  # an even count: an int4 chunk never splits a byte
        in_bytes = per_chunk * self.bits // 8
        pending = bytearray()
        first = 0
        for piece in self.inner.chunks(in_bytes):
            pending += piece
            while len(pending) >= in_bytes and first + per_chunk <= self.count:
                yield self._values(bytes(pending[:in_bytes]), first, per_chunk).data.cast("B")
                del pending[:in_bytes]
                first += per_chunk
        if first < self.count:
            n = self.count - first
            if len(pending) != (n * self.bits + 7) // 8:
                raise InvalidModel("quantized payload does not hold its tensor's elements")
            yield self._values(bytes(pending), first, n).data.cast("B")
        elif pending:
            raise InvalidModel("quantized payload is longer than its tensor")


def _quantization(src: schema.TensorT, count: int, where: str, path: str) -> tuple[np.ndarray, np.ndarray, int] | str:
    """(scales, zero points, inner size) as LiteRT's kernel uses them, or why the op is kept."""
    q = src.quantization
    if q is None or q.scale is None or len(q.scale) == 0:
        return "no quantization scale"
    if q.detailsType:
        return "blockwise or custom quantization (LiteRT's DEQUANTIZE kernel has no blockwise case)"
    scales = np.asarray(q.scale, np.float32).astype(np.float64)
    zps = np.asarray(q.zeroPoint if q.zeroPoint is not None and len(q.zeroPoint) else [0], np.int64)
    shape = indices(src.shape)
    if len(scales) == 1:
        return scales, zps[:1], 1
    if src.type == TT.INT16:
        return "INT16 per channel (LiteRT's kernel refuses it)"
    qd = int(q.quantizedDimension)
    if not 0 <= qd < len(shape) or shape[qd] != len(scales):
        raise InvalidModel(f"{where}: {len(scales)} scales along dimension {qd} of shape {shape}", path)
    if len(zps) not in (1, len(scales)):
        raise InvalidModel(f"{where}: {len(zps)} zero points for {len(scales)} scales", path)
    if len(zps) == 1:
        zps = np.full(len(scales), zps[0], np.int64)
    return scales, zps, int(np.prod(shape[qd + 1 :], dtype=np.int64))


# Folded by default: INT8 only. The XNNPACK delegate unpacks static INT8 DEQUANTIZE outputs itself (with the same
# functions) and packs them for its FULLY_CONNECTED/CONV kernels, so after folding every LiteRT path runs the same
# kernels on the same values. It does not unpack UINT8/INT16/INT4: the consumer then has dynamic weights and runs
# in the builtin kernel, and an fp32 constant would move it to XNNPACK's kernel (other rounding).
FOLDED = frozenset({TT.INT8})


def plan_dequantize(
    graph: schema.ModelT, sources: list[PayloadSource | None], path: str, types: frozenset[int] = FOLDED
) -> tuple[list[tuple[DensifyFold, PayloadSource]], list[str]]:
    """Every foldable DEQUANTIZE of a constant integer tensor of ``types``, with its fp32 payload; notes on the
    DEQUANTIZE ops of constant integer tensors that are kept, and why."""
    codes = [builtin_code(c) for c in graph.operatorCodes or []]
    folds: list[tuple[DensifyFold, PayloadSource]] = []
    notes: list[str] = []
    for si, sg in enumerate(graph.subgraphs):
        tensors, ops = sg.tensors or [], sg.operators or []
        readers: dict[int, list[int]] = {}
        for oi, op in enumerate(ops):
            for i in indices(op.inputs):
                readers.setdefault(i, []).append(oi)
        boundary = set(indices(sg.inputs)) | set(indices(sg.outputs))
        for oi, op in enumerate(ops):
            ins, outs = indices(op.inputs), indices(op.outputs)
            if codes[op.opcodeIndex] != DEQUANTIZE or len(ins) != 1 or len(outs) != 1 or min(ins + outs) < 0:
                continue
            src, dst = tensors[ins[0]], tensors[outs[0]]
            source = sources[src.buffer] if src.buffer else None
            if src.type not in _BITS or source is None:
                continue
            where = f"subgraph {si}: DEQUANTIZE operator {oi} of {tensor_name(src)!r}"
            count = element_count(src)
            why = ""
            if src.type not in types:
                why = (
                    f"{TYPE_NAMES.get(src.type, src.type)} weights: LiteRT's XNNPACK delegate does not unpack them, "
                    "so fp32 constants would run in other kernels (outputs would differ)"
                )
            elif dst.type != FLOAT32 or indices(dst.shape) != indices(src.shape) or count is None:
                why = f"output is {TYPE_NAMES.get(dst.type, dst.type)} {indices(dst.shape)}, not FLOAT32 of its shape"
            elif src.sparsity is not None:
                why = "input is sparse"
            elif ins[0] in boundary or src.isVariable or outs[0] in boundary or dst.isVariable:
                why = "input or output is also a subgraph input/output or a variable"
            elif any(codes[ops[c].opcodeIndex] != DEQUANTIZE for c in readers.get(ins[0], [])):
                why = "the quantized tensor has other consumers"
            if why:
                notes.append(f"{where}: {why}; op kept")
                continue
            assert count is not None
            bits, signed = _BITS[src.type]
            if source.nbytes != (count * bits + 7) // 8:
                raise InvalidModel(f"{where}: {source.nbytes} bytes for {count} {bits}-bit elements", path)
            quant = _quantization(src, count, where, path)
            if isinstance(quant, str):
                notes.append(f"{where}: {quant}; op kept")
                continue
            scales, zps, inner = quant
            if len(scales) == 1 and zps[0] != 0:
                notes.append(
                    f"{where}: zero point {int(zps[0])}: the fp32 values are those of LiteRT's x86_64 kernel; "
                    "an Arm build with FMA can round their last bit differently"
                )
            dq = DequantizedSource(source, count, bits, signed, scales, zps, max(inner, 1))
            folds.append((DensifyFold(si, oi, ins[0], outs[0], src.buffer), dq))
    return folds, notes


def dequantized_copies(graph: schema.ModelT, sizes: list[int]) -> dict[int, tuple[str, int]]:
    """buffer -> (what LiteRT materialises per instance, fp32 bytes) for DEQUANTIZE of integer constants: one
    fp32 tensor per DEQUANTIZE op, so a weight both signatures of an LM dequantize costs two (measured: a
    litert-torch prefill + decode LM with ai-edge-quantizer's weight-only int8 costs 2x its fp32 weights per
    interpreter)."""
    codes = [builtin_code(c) for c in graph.operatorCodes or []]
    copies: dict[int, tuple[str, int]] = {}
    for sg in graph.subgraphs:
        tensors = sg.tensors or []
        for op in sg.operators or []:
            ins, outs = indices(op.inputs), indices(op.outputs)
            if codes[op.opcodeIndex] != DEQUANTIZE or len(ins) != 1 or len(outs) != 1 or min(ins + outs) < 0:
                continue
            src = tensors[ins[0]] if ins[0] < len(tensors) else None
            if src is None or src.type not in _BITS or not src.buffer or not sizes[src.buffer]:
                continue
            name = TYPE_NAMES.get(src.type, str(src.type))
            before = copies.get(src.buffer, ("", 0))[1]
            copies[src.buffer] = (f"DEQUANTIZE {name}->fp32 per instance", before + 4 * (element_count(src) or 0))
    return copies
