"""TFLite fixture models, built in code with the schema object API and the flatbuffers builder.

``GraphBuilder`` adds tensors, constants and ops to one subgraph; ``build_model``
packs subgraphs, signatures and metadata into a .tflite file. The builder keeps
inline buffer data 16-byte aligned, as the TFLite converter does.
"""

from __future__ import annotations

from pathlib import Path

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as s

OP = s.BuiltinOperator
TT = s.TensorType
_NP_TYPES = {
    np.dtype("float32"): TT.FLOAT32,
    np.dtype("float16"): TT.FLOAT16,
    np.dtype("int8"): TT.INT8,
    np.dtype("int32"): TT.INT32,
    np.dtype("uint8"): TT.UINT8,
    np.dtype("int64"): TT.INT64,
    np.dtype("bool"): TT.BOOL,
    np.dtype("int16"): TT.INT16,
}
_OP_VERSIONS = {OP.DEQUANTIZE: 3}


class _AlignedBufferT(s.BufferT):
    def Pack(self, builder):
        if self.data is None:
            s.BufferStart(builder)
            return s.BufferEnd(builder)
        data = bytes(self.data)
        builder.StartVector(1, len(data), 16)
        builder.head = builder.head - len(data)
        builder.Bytes[builder.head : builder.head + len(data)] = data
        builder.vectorNumElems = len(data)
        vec = builder.EndVector()
        s.BufferStart(builder)
        s.BufferAddData(builder, vec)
        return s.BufferEnd(builder)


class ModelBuilder:
    """Owns the buffers and operator codes shared by all subgraphs."""

    def __init__(self):
        self.buffers: list[s.BufferT] = [_AlignedBufferT()]  # buffer 0 is the empty sentinel
        self.opcodes: list[int] = []
        self.subgraphs: list[GraphBuilder] = []
        self.signatures: list[s.SignatureDefT] = []
        self.metadata: list[s.MetadataT] = []

    def buffer(self, data: bytes) -> int:
        self.buffers.append(_AlignedBufferT(data=data))
        return len(self.buffers) - 1

    def opcode(self, code: int) -> int:
        if code not in self.opcodes:
            self.opcodes.append(code)
        return self.opcodes.index(code)

    def subgraph(self, name: str) -> GraphBuilder:
        g = GraphBuilder(self, name)
        self.subgraphs.append(g)
        return g

    def signature(
        self, key: str, graph: GraphBuilder, inputs: list[str] | None = None, outputs: list[str] | None = None
    ) -> None:
        """A SignatureDef over ``graph``'s inputs and outputs, named ``inputs``/``outputs`` (in the graph's order);
        by default the tensors' own names. Converters name them otherwise: see ``keras_style_model``."""
        sd = s.SignatureDefT(signatureKey=key, subgraphIndex=self.subgraphs.index(graph))
        in_names = inputs or [graph.tensors[i].name for i in graph.inputs]
        out_names = outputs or [graph.tensors[i].name for i in graph.outputs]
        sd.inputs = [s.TensorMapT(name=n, tensorIndex=i) for n, i in zip(in_names, graph.inputs, strict=True)]
        sd.outputs = [s.TensorMapT(name=n, tensorIndex=i) for n, i in zip(out_names, graph.outputs, strict=True)]
        self.signatures.append(sd)

    def add_metadata(self, name: str, data: bytes) -> None:
        self.metadata.append(s.MetadataT(name=name, buffer=self.buffer(data)))

    def to_bytes(self) -> bytes:
        m = s.ModelT(version=3, description="weightshare test fixture")
        m.operatorCodes = [
            s.OperatorCodeT(deprecatedBuiltinCode=min(c, 127), builtinCode=c, version=_OP_VERSIONS.get(c, 1))
            for c in self.opcodes
        ]
        m.subgraphs = [g.to_subgraph() for g in self.subgraphs]
        m.buffers = self.buffers
        m.signatureDefs = self.signatures or None
        m.metadata = self.metadata or None
        b = flatbuffers.Builder(1 << 20)
        b.Finish(m.Pack(b), file_identifier=b"TFL3")
        return bytes(b.Output())

    def save(self, path: Path) -> Path:
        Path(path).write_bytes(self.to_bytes())
        return Path(path)


class GraphBuilder:
    def __init__(self, model: ModelBuilder, name: str):
        self.model = model
        self.name = name
        self.tensors: list[s.TensorT] = []
        self.ops: list[s.OperatorT] = []
        self.inputs: list[int] = []
        self.outputs: list[int] = []

    def tensor(self, name: str, shape, dtype, buffer: int = 0, quant: tuple | None = None, signature=None) -> int:
        t = s.TensorT(shape=list(shape), type=_NP_TYPES[np.dtype(dtype)], buffer=buffer, name=name)
        if signature is not None:  # the converters' dynamic dims: -1 here, 1 in ``shape``
            t.shapeSignature = list(signature)
        if quant is not None:
            scale, zero = quant
            t.quantization = s.QuantizationParametersT(
                scale=np.atleast_1d(np.asarray(scale, np.float32)), zeroPoint=np.atleast_1d(np.asarray(zero, np.int64))
            )
        self.tensors.append(t)
        return len(self.tensors) - 1

    def const(self, name: str, array: np.ndarray, quant: tuple | None = None) -> int:
        array = np.ascontiguousarray(array)
        return self.tensor(name, array.shape, array.dtype, self.model.buffer(array.tobytes()), quant)

    def input(self, name: str, shape, dtype="float32", quant=None, signature=None) -> int:
        i = self.tensor(name, shape, dtype, quant=quant, signature=signature)
        self.inputs.append(i)
        return i

    def op(self, code: int, inputs: list[int], outputs: list[int], options_type: int = 0, options=None) -> None:
        self.ops.append(
            s.OperatorT(
                opcodeIndex=self.model.opcode(code),
                inputs=inputs,
                outputs=outputs,
                builtinOptionsType=options_type,
                builtinOptions=options,
            )
        )

    def dequantize(self, name: str, array16: np.ndarray) -> int:
        """A constant fp16 tensor feeding DEQUANTIZE; returns the fp32 output tensor."""
        src = self.const(name + "_fp16", array16.astype(np.float16))
        out = self.tensor(name, array16.shape, "float32")
        self.op(OP.DEQUANTIZE, [src], [out])
        return out

    def to_subgraph(self) -> s.SubGraphT:
        return s.SubGraphT(
            tensors=self.tensors, inputs=self.inputs, outputs=self.outputs, operators=self.ops, name=self.name
        )


def _conv_options():
    return s.BuiltinOptions.Conv2DOptions, s.Conv2DOptionsT(padding=s.Padding.SAME, strideW=1, strideH=1)


def _dw_options():
    return (
        s.BuiltinOptions.DepthwiseConv2DOptions,
        s.DepthwiseConv2DOptionsT(padding=s.Padding.SAME, strideW=1, strideH=1, depthMultiplier=1),
    )


def float_graph(mb: ModelBuilder, rng: np.random.Generator, fc_out: int = 1024) -> GraphBuilder:
    """CONV_2D(fp16 filter) -> DEPTHWISE_CONV_2D -> RESHAPE -> FULLY_CONNECTED(fp16) -> ADD(twin constants)."""
    g = mb.subgraph("float")
    x = g.input("x", [1, 8, 8, 3])
    w = g.dequantize("conv_w", rng.standard_normal((16, 3, 3, 3)).astype(np.float16))  # 864 B fp16 -> 1728 B
    b = g.const("conv_b", rng.standard_normal(16).astype(np.float32))
    c = g.tensor("conv", [1, 8, 8, 16], "float32")
    g.op(OP.CONV_2D, [x, w, b], [c], *_conv_options())
    dw_w = g.const("dw_w", rng.standard_normal((1, 3, 3, 16)).astype(np.float32))
    dw_b = g.const("dw_b", np.zeros(16, np.float32))
    d = g.tensor("dw", [1, 8, 8, 16], "float32")
    g.op(OP.DEPTHWISE_CONV_2D, [c, dw_w, dw_b], [d], *_dw_options())
    shape = g.const("shape", np.array([1, 1024], np.int32))
    r = g.tensor("flat", [1, 1024], "float32")
    g.op(OP.RESHAPE, [d, shape], [r], s.BuiltinOptions.ReshapeOptions, s.ReshapeOptionsT(newShape=[1, 1024]))
    fc_w = g.dequantize("fc_w", (rng.standard_normal((fc_out, 1024)) * 0.05).astype(np.float16))
    fc_b = g.const("fc_b", rng.standard_normal(fc_out).astype(np.float32))
    f = g.tensor("fc", [1, fc_out], "float32")
    g.op(OP.FULLY_CONNECTED, [r, fc_w, fc_b], [f], s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    twin = rng.standard_normal(fc_out).astype(np.float32)
    a1 = g.const("offset_a", twin)
    a2 = g.const("offset_b", twin.copy())  # same bytes: stored once
    s1 = g.tensor("sum1", [1, fc_out], "float32")
    y = g.tensor("y", [1, fc_out], "float32")
    g.op(OP.ADD, [f, a1], [s1], s.BuiltinOptions.AddOptions, s.AddOptionsT())
    g.op(OP.ADD, [s1, a2], [y], s.BuiltinOptions.AddOptions, s.AddOptionsT())
    g.outputs = [y]
    return g


def int8_graph(mb: ModelBuilder, rng: np.random.Generator) -> GraphBuilder:
    """Fully quantized int8 FULLY_CONNECTED with per-tensor scales and an int32 bias."""
    g = mb.subgraph("int8")
    x = g.input("q_x", [1, 64], "int8", quant=(0.05, -3))
    w = g.const("q_w", rng.integers(-127, 128, (64, 64), dtype=np.int8), quant=(0.02, 0))
    b = g.const("q_b", rng.integers(-500, 500, 64, dtype=np.int32), quant=(0.05 * 0.02, 0))
    y = g.tensor("q_y", [1, 64], "int8", quant=(0.3, 2))
    g.op(OP.FULLY_CONNECTED, [x, w, b], [y], s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    g.outputs = [y]
    return g


def sample_model(path: Path, seed: int = 0, fc_out: int = 1024) -> Path:
    """Two subgraphs with a signature each, fp16+DEQUANTIZE, int8 tensors, twin constants and metadata."""
    rng = np.random.default_rng(seed)
    mb = ModelBuilder()
    fg = float_graph(mb, rng, fc_out)
    qg = int8_graph(mb, rng)
    mb.signature("serving_default", fg)
    mb.signature("quantized", qg)
    mb.add_metadata("min_runtime_version", b"1.5.0".ljust(16, b"\0"))
    mb.add_metadata("weightshare_test_blob", bytes(range(256)) * 8)  # 2 KiB: metadata stays inline anyway
    return mb.save(path)


def sample_inputs(seed: int = 1) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        "serving_default": {"x": rng.standard_normal((1, 8, 8, 3)).astype(np.float32)},
        "quantized": {"q_x": rng.integers(-128, 128, (1, 64), dtype=np.int8)},
    }


def run_compiled_model(cm, inputs: dict | None = None) -> dict:
    """Every signature of a LiteRT ``CompiledModel`` on ``inputs`` (default: the fixture's): {signature: {output:
    array}}."""
    out = {}
    for key, feeds in (inputs or sample_inputs()).items():
        idx = cm.get_signature_index(key)
        sig = cm.get_signature_list()[key]
        ins, outs = cm.create_input_buffers(idx), cm.create_output_buffers(idx)
        for name, buf in zip(sig["inputs"], ins):
            buf.write(feeds[name])
        cm.run_by_index(idx, ins, outs)
        details = cm.get_output_tensor_details(key)
        out[key] = {
            name: buf.read(int(np.prod(details[name]["shape"])), details[name]["dtype"])
            for name, buf in zip(sig["outputs"], outs)
        }
    return out


def _int_vector(values, kind: str):
    if kind == "u8":
        return s.SparseIndexVector.Uint8Vector, s.Uint8VectorT(values=list(values))
    if kind == "u16":
        return s.SparseIndexVector.Uint16Vector, s.Uint16VectorT(values=list(values))
    return s.SparseIndexVector.Int32Vector, s.Int32VectorT(values=list(values))


def sparse_encode(dense: np.ndarray, block: int = 1, index_kind: str = "i32"):
    """(values, SparsityParametersT) of a 2-D matrix: rows dense, columns CSR, optional 1 x ``block`` blocks."""
    rows, cols = dense.shape
    nblocks = cols // block
    blocks = dense.reshape(rows, nblocks, block)
    segments, indices, values = [0], [], []
    for r in range(rows):
        for b in range(nblocks):
            if np.any(blocks[r, b] != 0):
                indices.append(b)
                values.append(blocks[r, b])
        segments.append(len(indices))
    seg_type, seg = _int_vector(segments, "i32")
    idx_type, idx = _int_vector(indices, index_kind)
    levels = [
        s.DimensionMetadataT(format=s.DimensionType.DENSE, denseSize=rows),
        s.DimensionMetadataT(
            format=s.DimensionType.SPARSE_CSR,
            arraySegmentsType=seg_type,
            arraySegments=seg,
            arrayIndicesType=idx_type,
            arrayIndices=idx,
        ),
    ]
    sparsity = s.SparsityParametersT(traversalOrder=[0, 1], dimMetadata=levels)
    if block > 1:
        levels.append(s.DimensionMetadataT(format=s.DimensionType.DENSE, denseSize=block))
        sparsity.traversalOrder, sparsity.blockMap = [0, 1, 2], [1]
    return np.concatenate(values).astype(dense.dtype) if values else dense[:0, 0], sparsity


def sparse_model(
    path: Path,
    dtype=np.float32,
    block: int = 1,
    seed: int = 5,
    index_kind: str = "i32",
    rows: int = 64,
    cols: int = 128,
) -> Path:
    """DENSIFY(constant sparse weights [rows, cols]) [-> DEQUANTIZE for fp16] -> FULLY_CONNECTED."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[rng.random((rows, cols // 4)).repeat(4, axis=1) < 0.7] = 0  # 70% of 1x4 blocks are zero
    w = w.astype(dtype)
    values, sparsity = sparse_encode(w, block, index_kind)
    mb = ModelBuilder()
    g = mb.subgraph("sparse")
    x = g.input("x", [1, cols])
    sp = g.const("w_sparse", values)
    g.tensors[sp].shape = [rows, cols]
    g.tensors[sp].sparsity = sparsity
    dense = g.tensor("w_dense", [rows, cols], dtype)
    g.op(OP.DENSIFY, [sp], [dense])
    if np.dtype(dtype) == np.float16:
        w32 = g.tensor("w", [rows, cols], "float32")
        g.op(OP.DEQUANTIZE, [dense], [w32])
        dense = w32
    y = g.tensor("y", [1, rows], "float32")
    g.op(OP.FULLY_CONNECTED, [x, dense, -1], [y], s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    g.outputs = [y]
    mb.signature("sparse", g)
    return mb.save(path)


def lm_model(path: Path, vocab: int = 1000, width: int = 64, seq: int = 8, signature: bool = True) -> Path:
    """An LM-like graph: int32 token ids -> EMBEDDING_LOOKUP (a vocab x width table) -> FULLY_CONNECTED, plus a
    GATHER of a second table by the same ids. Random ints outside [0, vocab) make LiteRT's kernels fail."""
    rng = np.random.default_rng(11)
    mb = ModelBuilder()
    g = mb.subgraph("lm")
    ids = g.input("token_ids", [seq], "int32")
    table = g.const("embedding", (rng.standard_normal((vocab, width)) * 0.1).astype(np.float32))
    emb = g.tensor("embedded", [seq, width], "float32")
    g.op(OP.EMBEDDING_LOOKUP, [ids, table], [emb])
    w = g.const("proj_w", (rng.standard_normal((width, width)) * 0.1).astype(np.float32))
    b = g.const("proj_b", np.zeros(width, np.float32))
    logits = g.tensor("logits", [seq, width], "float32")
    g.op(OP.FULLY_CONNECTED, [emb, w, b], [logits], s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    pos = g.const("positions", (rng.standard_normal((vocab, 4)) * 0.1).astype(np.float32))
    picked = g.tensor("picked", [seq, 4], "float32")
    g.op(OP.GATHER, [pos, ids], [picked], s.BuiltinOptions.GatherOptions, s.GatherOptionsT(axis=0))
    g.outputs = [logits, picked]
    if signature:
        mb.signature("serving_default", g)
    return mb.save(path)


_FC = (s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
_FC_KEEP = (s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT(keepNumDims=True))


def keras_style_model(path: Path, seed: int = 0, width: int = 256) -> Path:
    """What the TF Lite converter writes for a Keras ``Sequential([Input((64,), name="x"), Dense(width, relu),
    Dense(10)])`` (scripts/build_tflite_exporters.py prints the real one): the signature ``serving_default`` names its
    input ``x`` and its output ``dense_1`` (the Keras names) while the tensors are ``serving_default_x:0`` and
    ``StatefulPartitionedCall:0``; the batch dim is dynamic (shape_signature -1)."""
    rng = np.random.default_rng(seed)
    mb = ModelBuilder()
    g = mb.subgraph("main")
    x = g.input("serving_default_x:0", [1, 64], signature=[-1, 64])
    w1 = g.const("sequential/dense/MatMul", (rng.standard_normal((width, 64)) * 0.1).astype(np.float32))
    b1 = g.const("sequential/dense/BiasAdd/ReadVariableOp", (rng.standard_normal(width) * 0.1).astype(np.float32))
    h_name = "sequential/dense/MatMul;sequential/dense/Relu;sequential/dense/BiasAdd"
    h = g.tensor(h_name, [1, width], "float32", signature=[-1, width])
    relu = s.FullyConnectedOptionsT(fusedActivationFunction=s.ActivationFunctionType.RELU)
    g.op(OP.FULLY_CONNECTED, [x, w1, b1], [h], s.BuiltinOptions.FullyConnectedOptions, relu)
    w2 = g.const("sequential/dense_1/MatMul", (rng.standard_normal((10, width)) * 0.1).astype(np.float32))
    b2 = g.const("sequential/dense_1/BiasAdd/ReadVariableOp", (rng.standard_normal(10) * 0.1).astype(np.float32))
    y = g.tensor("StatefulPartitionedCall:0", [1, 10], "float32", signature=[-1, 10])
    g.op(OP.FULLY_CONNECTED, [h, w2, b2], [y], *_FC)
    g.outputs = [y]
    mb.signature("serving_default", g, inputs=["x"], outputs=["dense_1"])
    return mb.save(path)


LM_SIGNATURES = ("prefill", "decode")


def two_signature_lm(
    path: Path,
    vocab: int = 2048,
    width: int = 128,
    cache: int = 32,
    prefill: int = 8,
    seed: int = 0,
    decode_mask_seed: int | None = None,
    scalar: bool = False,
) -> Path:
    """A toy LM as litert-torch 0.10 writes one (``litert_torch.signature("prefill", m, sample_kwargs=...)
    .signature("decode", m, ...)``; scripts/build_tflite_exporters.py prints the real one's ops): one subgraph per
    signature over ONE copy of the weights (their tensors point at the same buffers). Inputs ``tokens`` [1, T]
    int32 (RESHAPE -> EMBEDDING_LOOKUP of a vocab x width table), ``input_pos`` [T] int32 (torch's wrap of negative
    indices, SELECT(LESS(p, 0), ADD(p, cache), p), then RESHAPE -> GATHER_ND of a position table) and the KV cache
    ``kv_cache_k_0``/``kv_cache_v_0`` [1, cache, width]; outputs ``logits`` [1, T, vocab] and the updated cache
    under the inputs' names. The tensors are named ``prefill_tokens``, ``decode_input_pos``,
    ``decode_kv_cache_k_0_output``, ... (not the signature's names). T is ``prefill`` or 1. litert-torch writes the
    cache update as STABLEHLO_SCATTER (with a subgraph per scatter); here it is DYNAMIC_UPDATE_SLICE at
    ``input_pos[0]`` (its generative layers' other update), which this builder can write without subgraphs.

    The decode signature alone reads one constant, its attention mask (``decode_mask_seed`` changes its values:
    a weight only decode reads). ``scalar``: each signature also holds a 0-d intermediate tensor, as every
    litert-torch LM does (LiteRT's Python API returns a numpy scalar, not an array, for one)."""
    rng = np.random.default_rng(seed)
    mb = ModelBuilder()
    shared = {
        "embedding": (rng.standard_normal((vocab, width)) * 0.1).astype(np.float32),
        "pos_embedding": (rng.standard_normal((cache, width)) * 0.1).astype(np.float32),
        "q_proj": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
        "k_proj": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
        "v_proj": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
        "lm_head": (rng.standard_normal((vocab, width)) / np.sqrt(width)).astype(np.float32),
    }
    buffers = {name: mb.buffer(a.tobytes()) for name, a in shared.items()}
    mask_rng = np.random.default_rng(seed + 1 if decode_mask_seed is None else decode_mask_seed)
    decode_mask = (mask_rng.standard_normal(cache) * 0.5).astype(np.float32)
    for key in LM_SIGNATURES:
        t = prefill if key == "prefill" else 1
        g = mb.subgraph(key)

        def w(name: str, g=g) -> int:
            return g.tensor(f"model/{name}/weight", shared[name].shape, "float32", buffers[name])

        tokens = g.input(f"{key}_tokens", [1, t], "int32")
        pos = g.input(f"{key}_input_pos", [t], "int32")
        kv_k = g.input(f"{key}_kv_cache_k_0", [1, cache, width])
        kv_v = g.input(f"{key}_kv_cache_v_0", [1, cache, width])
        flat = g.tensor("model/embedding;1", [t], "int32")
        g.op(OP.RESHAPE, [tokens, g.const("model/embedding;", np.array([t], np.int32))], [flat])
        looked = g.tensor("model/embedding;2", [t, width], "float32")
        g.op(OP.EMBEDDING_LOOKUP, [flat, w("embedding")], [looked])
        emb = g.tensor("model/embedding;3", [1, t, width], "float32")
        g.op(OP.RESHAPE, [looked, g.const("model/embedding;4", np.array([1, t, width], np.int32))], [emb])
        negative = g.tensor("model;5", [t], "bool")
        g.op(OP.LESS, [pos, g.const("model;3", np.array(0, np.int32))], [negative])
        wrapped = g.tensor("model;6", [t], "int32")
        g.op(
            OP.ADD,
            [pos, g.const("model;4", np.array(cache, np.int32))],
            [wrapped],
            s.BuiltinOptions.AddOptions,
            s.AddOptionsT(),
        )
        index = g.tensor("model;7", [t], "int32")
        g.op(OP.SELECT, [negative, wrapped, pos], [index])
        index2 = g.tensor("model;8", [t, 1], "int32")
        g.op(OP.RESHAPE, [index, g.const("model;2", np.array([t, 1], np.int32))], [index2])
        pe = g.tensor("model;9", [t, width], "float32")
        g.op(OP.GATHER_ND, [w("pos_embedding"), index2], [pe])
        h = g.tensor("model;10", [1, t, width], "float32")
        g.op(OP.ADD, [emb, pe], [h], s.BuiltinOptions.AddOptions, s.AddOptionsT())
        q, k, v = (g.tensor(f"model/{n}", [1, t, width], "float32") for n in ("q", "k", "v"))
        for name, out in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            g.op(OP.FULLY_CONNECTED, [h, w(name), -1], [out], *_FC_KEEP)
        # start index of the cache update: [0, input_pos[0], 0]
        first = g.tensor("model/pos0", [1], "int32")
        g.op(
            OP.SLICE,
            [pos, g.const("slice_begin", np.array([0], np.int32)), g.const("slice_size", np.array([1], np.int32))],
            [first],
        )
        if scalar:  # litert-torch's 0-d intermediates (a position as a scalar, reshaped back to [1])
            step = g.tensor("model/pos0_scalar", [], "int32")
            g.op(OP.RESHAPE, [first, g.const("model/scalar_shape", np.zeros(0, np.int32))], [step])
            first = g.tensor("model/pos0_1", [1], "int32")
            g.op(OP.RESHAPE, [step, g.const("model/one_shape", np.array([1], np.int32))], [first])
        zero = g.const("zero", np.array([0], np.int32))
        start = g.tensor("model/start", [3], "int32")
        g.op(
            OP.CONCATENATION,
            [zero, first, zero],
            [start],
            s.BuiltinOptions.ConcatenationOptions,
            s.ConcatenationOptionsT(axis=0),
        )
        new_k = g.tensor(f"{key}_kv_cache_k_0_output", [1, cache, width], "float32")
        new_v = g.tensor(f"{key}_kv_cache_v_0_output", [1, cache, width], "float32")
        g.op(OP.DYNAMIC_UPDATE_SLICE, [kv_k, k, start], [new_k])
        g.op(OP.DYNAMIC_UPDATE_SLICE, [kv_v, v, start], [new_v])
        scores = g.tensor("model/scores", [1, t, cache], "float32")
        bmm_t = s.BatchMatMulOptionsT(adjX=False, adjY=True)
        g.op(OP.BATCH_MATMUL, [q, new_k], [scores], s.BuiltinOptions.BatchMatMulOptions, bmm_t)
        if key == "decode":
            masked = g.tensor("model/masked_scores", [1, t, cache], "float32")
            g.op(
                OP.ADD,
                [scores, g.const("decode/mask", decode_mask)],
                [masked],
                s.BuiltinOptions.AddOptions,
                s.AddOptionsT(),
            )
            scores = masked
        probs = g.tensor("model/probs", [1, t, cache], "float32")
        g.op(OP.SOFTMAX, [scores], [probs], s.BuiltinOptions.SoftmaxOptions, s.SoftmaxOptionsT(beta=1.0))
        att = g.tensor("model/attention", [1, t, width], "float32")
        g.op(OP.BATCH_MATMUL, [probs, new_v], [att], s.BuiltinOptions.BatchMatMulOptions, s.BatchMatMulOptionsT())
        logits = g.tensor(f"{key}_logits_output", [1, t, vocab], "float32")
        g.op(OP.FULLY_CONNECTED, [att, w("lm_head"), -1], [logits], *_FC_KEEP)
        g.outputs = [logits, new_k, new_v]
        mb.signature(
            key,
            g,
            inputs=["tokens", "input_pos", "kv_cache_k_0", "kv_cache_v_0"],
            outputs=["logits", "kv_cache_k_0", "kv_cache_v_0"],
        )
    return mb.save(path)


def conv_vision(path: Path, size: int = 160, layers: int = 4, seed: int = 0) -> Path:
    """A conv vision model with large activations and small weights: ``layers`` CONV_2D 3x3 of 32 channels on a
    [1, size, size, 3] input (0.1 MiB of weights, 3 MiB per activation at 160): its interpreter's arena is
    activation memory, not weight copies (scripts/bench_check.py --stability)."""
    rng = np.random.default_rng(seed)
    mb = ModelBuilder()
    g = mb.subgraph("main")
    x, cin = g.input("x", [1, size, size, 3]), 3
    for i in range(layers):
        w = g.const(f"w{i}", (rng.standard_normal((32, 3, 3, cin)) * 0.1).astype(np.float32))
        b = g.const(f"b{i}", np.zeros(32, np.float32))
        y = g.tensor(f"c{i}", [1, size, size, 32], "float32")
        g.op(OP.CONV_2D, [x, w, b], [y], *_conv_options())
        x, cin = y, 32
    g.outputs = [x]
    mb.signature("serving_default", g)
    return mb.save(path)


def mediapipe_member(path: Path, width: int = 256, layers: int = 2, seed: int = 0) -> Path:
    """A model laid out as the members of MediaPipe's ``.task`` bundles are (face_blendshapes, face_detector, ...):
    no SignatureDef (LiteRT's CompiledModel then has one ``<placeholder signature>``), tensors named by the
    TF graph, and 0-d tensors among the activations. Landmarks ``input_points`` [1, 146, 2] -> centred by their
    mean (MEAN over every axis: a 0-d tensor) -> RESHAPE [1, 292] -> ``layers`` x FULLY_CONNECTED(width, relu)
    -> FULLY_CONNECTED(52) -> ``output`` [1, 52] (the 52 blendshape scores). ``width`` sets the size: 256 is
    about 0.4 MiB of weights, 2048 with 2 layers about 19 MiB."""
    rng = np.random.default_rng(seed)
    mb = ModelBuilder()
    g = mb.subgraph("main")
    x = g.input("input_points", [1, 146, 2])
    mean = g.tensor("model/mean", [], "float32")
    axes = g.const("model/mean/reduction_indices", np.array([0, 1, 2], np.int32))
    g.op(OP.MEAN, [x, axes], [mean], s.BuiltinOptions.ReducerOptions, s.ReducerOptionsT(keepDims=False))
    centred = g.tensor("model/sub", [1, 146, 2], "float32")
    g.op(OP.SUB, [x, mean], [centred], s.BuiltinOptions.SubOptions, s.SubOptionsT())
    h = g.tensor("model/reshape", [1, 292], "float32")
    g.op(OP.RESHAPE, [centred, g.const("model/reshape/shape", np.array([1, 292], np.int32))], [h])
    cin = 292
    relu = s.FullyConnectedOptionsT(fusedActivationFunction=s.ActivationFunctionType.RELU)
    for i in range(layers):
        w = g.const(f"model/dense_{i}/MatMul", (rng.standard_normal((width, cin)) / np.sqrt(cin)).astype(np.float32))
        b = g.const(f"model/dense_{i}/BiasAdd", np.zeros(width, np.float32))
        y = g.tensor(f"model/dense_{i}/Relu", [1, width], "float32")
        g.op(OP.FULLY_CONNECTED, [h, w, b], [y], s.BuiltinOptions.FullyConnectedOptions, relu)
        h, cin = y, width
    w = g.const("model/output/MatMul", (rng.standard_normal((52, cin)) / np.sqrt(cin)).astype(np.float32))
    out = g.tensor("output", [1, 52], "float32")
    g.op(OP.FULLY_CONNECTED, [h, w, -1], [out], *_FC)
    g.outputs = [out]
    return mb.save(path)
