"""The model forms LLM and vision teams ship for ONNX Runtime's CPU provider, built in code.

Each builder takes the path to write, ``mib`` (the weight bytes of the written model, roughly: tests
use 1-4, benchmarks >= 100) and a seed, and writes its weights the way the tool that makes that form
does (external data beside the model, or embedded). ``FORMS`` names them; ``feeds`` makes seeded
inputs for any of them. Quantized forms come from onnxruntime.quantization's own tools run on an
fp32 MatMul model, so they are what a user gets, not an imitation. Used by the ``--prepack`` tests,
``scripts/bench_llm.py`` and the CI gate; heavy imports stay inside functions.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import onnx

MiB = 1 << 20
OPSET = 17


@dataclass(frozen=True)
class Form:
    build: Callable[[Path, float, int], Path]
    about: str


def _dims(mib: float, bytes_per_d2: float, dims: tuple[int, ...] = (128, 256, 512, 1024, 2048)) -> tuple[int, int]:
    """(dim, layers) with ``layers * bytes_per_d2 * dim**2`` ~ ``mib``: the largest dim that still
    gives at least 4 layers (fewer only for the smallest dim)."""
    target = mib * MiB
    dim = dims[0]
    for d in dims:
        if bytes_per_d2 * d * d * 4 <= target:
            dim = d
    return dim, max(1, math.ceil(target / (bytes_per_d2 * dim * dim)))


def _arr(rng: np.random.Generator, shape: tuple[int, ...], scale: float, dtype: Any = None) -> np.ndarray:
    import numpy as np

    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype or np.float32)


def _model(
    nodes: list[onnx.NodeProto],
    inits: list[onnx.TensorProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    ms_domain: bool = False,
) -> onnx.ModelProto:
    from onnx import helper as h

    opsets = [h.make_opsetid("", OPSET)] + ([h.make_opsetid("com.microsoft", 1)] if ms_domain else [])
    model = h.make_model(h.make_graph(nodes, "form", inputs, outputs, inits), opset_imports=opsets)
    model.ir_version = 8
    return model


def _save(model: onnx.ModelProto, path: Path, external: bool) -> Path:
    """Write ``model``: its weights to ``<stem>.data`` beside it (as exporters do past a few MiB) or embedded."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    if external:
        # onnx appends to an existing data file: a rebuilt form must not carry the last one's bytes.
        data = path.parent / f"{path.stem}.data"
        data.unlink(missing_ok=True)
        onnx.save_model(model, str(path), save_as_external_data=True, location=data.name, size_threshold=1024)
        _assert_data_is_its_own(path, data)
    else:
        onnx.save_model(model, str(path))
    return path


def _assert_data_is_its_own(path: Path, data: Path) -> None:
    """The data file holds this build's tensors only, from its first byte to its last: onnx appends to a file
    already there, so a leftover of an earlier build (a bench rebuilding a form in place) would sit in front."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    model = onnx.load(str(path), load_external_data=False)
    spans = [
        (info.offset or 0, (info.offset or 0) + (info.length or 0))
        for t in _get_all_tensors(model)
        if uses_external_data(t)
        for info in [ExternalDataInfo(t)]
    ]
    held = (min(s for s, _ in spans), max(e for _, e in spans)) if spans else (0, 0)
    if held != (0, data.stat().st_size):
        raise AssertionError(f"{data} holds {data.stat().st_size} bytes, its model references bytes {held}")


def _io(name: str, elem: int, shape: list[Any] | None) -> onnx.ValueInfoProto:
    from onnx import helper as h

    return h.make_tensor_value_info(name, elem, shape)


# --- fp32 MLP: the source of the quantized forms ---------------------------------------------------------


def _mlp_nodes(dim: int, layers: int, seed: int, x: str = "x") -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """``layers`` x (MatMul [d, 4d] + Add, Relu, MatMul [4d, d] + Add, residual Add) on ``x`` [batch, seq, d]."""
    import numpy as np
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    cur = x
    for i in range(layers):
        p = f"layer{i}"
        for n, shape, scale in (
            ("up.w", (dim, 4 * dim), dim**-0.5),
            ("up.b", (4 * dim,), 0.01),
            ("down.w", (4 * dim, dim), 0.5 * (4 * dim) ** -0.5),
            ("down.b", (dim,), 0.01),
        ):
            inits.append(nh.from_array(_arr(rng, shape, scale), f"{p}.{n}"))
        nodes += [
            h.make_node("MatMul", [cur, f"{p}.up.w"], [f"{p}.up.mm"]),
            h.make_node("Add", [f"{p}.up.mm", f"{p}.up.b"], [f"{p}.up"]),
            h.make_node("Relu", [f"{p}.up"], [f"{p}.act"]),
            h.make_node("MatMul", [f"{p}.act", f"{p}.down.w"], [f"{p}.down.mm"]),
            h.make_node("Add", [f"{p}.down.mm", f"{p}.down.b"], [f"{p}.down"]),
            h.make_node("Add", [cur, f"{p}.down"], [f"{p}.out"]),
        ]
        cur = f"{p}.out"
    nodes.append(h.make_node("Identity", [cur], ["y"]))
    return nodes, inits


def vit_like(path: Path, tokens: int = 1024, dim: int = 256, layers: int = 3) -> Path:
    """A ViT-like encoder as exporters leave it: fixed [1, tokens, dim] patch embeddings, per layer an MLP
    (``_mlp_nodes``: MatMul dim->4dim + Add, Relu, MatMul 4dim->dim + Add, residual Add), weights in external data:
    6 MiB of weights at the defaults, 4 MiB per hidden activation (check's and bench_share_arena's model)."""
    import onnx
    from onnx import TensorProto as T

    nodes, inits = _mlp_nodes(dim, layers, seed=0)
    model = _model(nodes, inits, [_io("x", T.FLOAT, [1, tokens, dim])], [_io("y", T.FLOAT, [1, tokens, dim])])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path), save_as_external_data=True, location=f"{path.stem}.data", size_threshold=1024)
    (path.parent / f"{path.stem}.data").chmod(0o644)  # onnx writes it 0600: not a finding these models are about
    return path


def _mlp(dim: int, layers: int, seed: int) -> onnx.ModelProto:
    from onnx import TensorProto as T

    nodes, inits = _mlp_nodes(dim, layers, seed)
    return _model(nodes, inits, [_io("x", T.FLOAT, ["batch", "seq", dim])], [_io("y", T.FLOAT, ["batch", "seq", dim])])


def fp32_mlp(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
    """fp32 MatMul+Add MLP with residuals (MLAS SGEMM pre-packing), external data."""
    dim, layers = _dims(mib, 32)
    return _save(_mlp(dim, layers, seed), Path(path), external=True)


def fp16_cast_mlp(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
    """The fp32 MLP with every weight stored fp16 behind a ``Cast(to=FLOAT)`` (what keep-fp32-compute fp16
    exports and ORT's transformers optimizer leave for ops kept in fp32), external data: ORT constant-folds
    each Cast into a private fp32 copy per session."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    dim, layers = _dims(mib, 16)
    nodes, inits = _mlp_nodes(dim, layers, seed)
    casts, halves = [], []
    for t in inits:
        halves.append(nh.from_array(nh.to_array(t).astype(np.float16), f"{t.name}.fp16"))
        casts.append(h.make_node("Cast", [f"{t.name}.fp16"], [t.name], to=T.FLOAT))
    io = [_io("x", T.FLOAT, ["batch", "seq", dim])], [_io("y", T.FLOAT, ["batch", "seq", dim])]
    return _save(_model(casts + nodes, halves, *io), Path(path), external=True)


# --- MatMulNBits ------------------------------------------------------------------------------------------


def _nbits(
    bits: int, block_size: int, symmetric: bool, accuracy_level: int | None
) -> Callable[[Path, float, int], Path]:
    def build(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
        """MatMulNBitsQuantizer (RTN) on the fp32 MLP, as ``-p int4``/``int8`` builders ship it."""
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            MatMulNBitsQuantizer,
        )

        # Weight bytes per d^2: 8 d^2 weights at bits/8 bytes, plus an fp32 scale per block.
        dim, layers = _dims(mib, 8 * (bits / 8 + 4 / block_size))
        config = DefaultWeightOnlyQuantConfig(
            block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level, bits=bits
        )
        quant = MatMulNBitsQuantizer(_mlp(dim, layers, seed), algo_config=config)
        quant.process()
        return _save(quant.model.model, Path(path), external=True)

    return build


def matmulnbits_gidx_bias(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
    """MatMulNBits written directly with its optional inputs: zero points, g_idx (act-order GPTQ) and bias."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    block = 32
    dim, layers = _dims(mib, 2 * (0.5 + 4.5 / block))
    rng = np.random.default_rng(seed)
    nodes, inits, cur = [], [], "x"
    blocks = dim // block
    for i in range(layers):
        p = f"layer{i}"
        n, k = dim, dim
        inits += [
            nh.from_array(rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8), f"{p}.qw"),
            nh.from_array(_arr(rng, (n * blocks,), 0.02 / math.sqrt(dim)) + np.float32(0.01), f"{p}.scales"),
            nh.from_array(rng.integers(0, 256, (n * ((blocks + 1) // 2),), dtype=np.uint8), f"{p}.zp"),
            nh.from_array(rng.permutation(np.arange(k, dtype=np.int32) // block).astype(np.int32), f"{p}.g_idx"),
            nh.from_array(_arr(rng, (n,), 0.01), f"{p}.bias"),
        ]
        ins = [cur, f"{p}.qw", f"{p}.scales", f"{p}.zp", f"{p}.g_idx", f"{p}.bias"]
        nodes.append(
            h.make_node("MatMulNBits", ins, [f"{p}.mm"], domain="com.microsoft", K=k, N=n, bits=4, block_size=block)
        )
        nodes.append(h.make_node("Tanh", [f"{p}.mm"], [f"{p}.out"]))
        cur = f"{p}.out"
    nodes.append(h.make_node("Identity", [cur], ["y"]))
    io = [_io("x", T.FLOAT, ["batch", "seq", dim])], [_io("y", T.FLOAT, ["batch", "seq", dim])]
    return _save(_model(nodes, inits, *io, ms_domain=True), Path(path), external=True)


# --- int8 from ORT's quantization tools -------------------------------------------------------------------


def _fp32_source(tmp: str, mib: float, seed: int) -> str:
    """The fp32 MLP of ~4 x ``mib`` (int8 is a quarter of it) at ``tmp``/fp32.onnx, external data."""
    dim, layers = _dims(4 * mib, 32)
    return str(_save(_mlp(dim, layers, seed), Path(tmp) / "fp32.onnx", external=True))


def qdq_int8(path: Path, mib: float = 2.0, seed: int = 0, per_channel: bool = False) -> Path:
    """quantize_static in QDQ format (uint8 activations, int8 weights) with a small calibration set."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self, model: str) -> None:
            self.batches = iter([feeds(model, batch=1, seq=4, seed=s) for s in range(4)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    with tempfile.TemporaryDirectory() as tmp:
        src = _fp32_source(tmp, mib, seed)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{path}.data").unlink(missing_ok=True)  # the tool appends to an existing one
        quantize_static(
            src,
            str(path),
            Reader(src),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=per_channel,
            use_external_data_format=True,
        )
    return Path(path)


def qdq_per_channel(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
    """quantize_static QDQ with per-channel weight scales."""
    return qdq_int8(path, mib, seed, per_channel=True)


def dynamic_int8(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
    """quantize_dynamic: DynamicQuantizeLinear + MatMulInteger (ORT fuses to DynamicQuantizeMatMul), embedded."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        src = _fp32_source(tmp, mib, seed)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        quantize_dynamic(src, str(path), weight_type=QuantType.QInt8)
    return Path(path)


# --- transformer forms ------------------------------------------------------------------------------------


def fp16_transformer(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
    """An unfused fp16 BERT-like encoder (as onnxconverter-common leaves one), weights embedded:
    LayerNormalization, Q/K/V MatMuls, heads by Reshape/Transpose, MatMul(Q, Transpose(K)) / sqrt(d) (which
    ORT fuses to FusedMatMul once the graph is fp32), Softmax, output projection, fp16 MLP."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    f16 = np.float16
    dim, layers = _dims(mib, 2 * 12)
    heads, hd = max(1, dim // 64), min(64, dim)
    rng = np.random.default_rng(seed)
    inits = [
        nh.from_array(np.array([0, 0, heads, hd], np.int64), "heads_shape"),
        nh.from_array(np.array([0, 0, dim], np.int64), "merge_shape"),
        nh.from_array(np.array(hd**0.5, f16), "scale"),
    ]
    nodes: list[onnx.NodeProto] = []

    def mm(x: str, name: str, k: int, n: int) -> str:
        inits.append(nh.from_array(_arr(rng, (k, n), 0.5 * k**-0.5, f16), f"{name}.w"))
        inits.append(nh.from_array(_arr(rng, (n,), 0.01, f16), f"{name}.b"))
        nodes.append(h.make_node("MatMul", [x, f"{name}.w"], [f"{name}.mm"]))
        nodes.append(h.make_node("Add", [f"{name}.mm", f"{name}.b"], [name]))
        return name

    def ln(x: str, name: str) -> str:
        inits.append(nh.from_array(np.ones(dim, f16), f"{name}.g"))
        inits.append(nh.from_array(np.zeros(dim, f16), f"{name}.beta"))
        nodes.append(h.make_node("LayerNormalization", [x, f"{name}.g", f"{name}.beta"], [name], axis=-1))
        return name

    def op(kind: str, ins: list[str], out: str, **attrs: Any) -> str:
        nodes.append(h.make_node(kind, ins, [out], **attrs))
        return out

    cur = "x"
    for i in range(layers):
        p = f"layer{i}"
        a = ln(cur, f"{p}.ln1")
        q, k, v = (
            op(
                "Transpose",
                [op("Reshape", [mm(a, f"{p}.{t}", dim, dim), "heads_shape"], f"{p}.{t}.r")],
                f"{p}.{t}.t",
                perm=perm,
            )
            for t, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 1, 3]), ("v", [0, 2, 1, 3]))
        )
        k = op("Transpose", [k], f"{p}.k.tt", perm=[0, 1, 3, 2])  # as PyTorch exports k.transpose(-1, -2)
        scores = op("Div", [op("MatMul", [q, k], f"{p}.qk"), "scale"], f"{p}.scores")
        ctx = op("MatMul", [op("Softmax", [scores], f"{p}.probs", axis=-1), v], f"{p}.ctx")
        merged = op("Reshape", [op("Transpose", [ctx], f"{p}.ctx.t", perm=[0, 2, 1, 3]), "merge_shape"], f"{p}.ctx.m")
        cur = op("Add", [cur, mm(merged, f"{p}.o", dim, dim)], f"{p}.attn")
        up = op("Relu", [mm(ln(cur, f"{p}.ln2"), f"{p}.up", dim, 4 * dim)], f"{p}.act")
        cur = op("Add", [cur, mm(up, f"{p}.down", 4 * dim, dim)], f"{p}.out")
    nodes.append(h.make_node("Identity", [cur], ["y"]))
    io = [_io("x", T.FLOAT16, ["batch", "seq", dim])], [_io("y", T.FLOAT16, ["batch", "seq", dim])]
    return _save(_model(nodes, inits, *io), Path(path), external=False)


def fp16_fused_transformer(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
    """A fused fp16 BERT-like encoder (what ORT's transformers optimizer writes, then the fp16 conversion with
    fp32 inputs/outputs), weights embedded: com.microsoft Attention (packed QKV + bias), output MatMul,
    SkipLayerNormalization (bias in), MatMul + FastGelu (bias in), MatMul, SkipLayerNormalization."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    f16 = np.float16
    dim, layers = _dims(mib, 2 * 12)
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes = [h.make_node("Cast", ["x"], ["x16"], to=T.FLOAT16)]

    def w(name: str, shape: tuple[int, ...], scale: float) -> str:
        inits.append(nh.from_array(_arr(rng, shape, scale, f16), name))
        return name

    ms = {"domain": "com.microsoft"}
    cur = "x16"
    for i in range(layers):
        p = f"layer{i}"
        nodes += [
            h.make_node(
                "Attention",
                [cur, w(f"{p}.qkv.w", (dim, 3 * dim), dim**-0.5), w(f"{p}.qkv.b", (3 * dim,), 0.01)],
                [f"{p}.attn"],
                num_heads=max(1, dim // 64),
                **ms,
            ),
            h.make_node("MatMul", [f"{p}.attn", w(f"{p}.o.w", (dim, dim), 0.5 * dim**-0.5)], [f"{p}.o"]),
            h.make_node(
                "SkipLayerNormalization",
                [
                    f"{p}.o",
                    cur,
                    w(f"{p}.ln1.g", (dim,), 0.1),
                    w(f"{p}.ln1.b", (dim,), 0.01),
                    w(f"{p}.o.b", (dim,), 0.01),
                ],
                [f"{p}.ln1"],
                epsilon=1e-5,
                **ms,
            ),  # fmt: skip
            h.make_node("MatMul", [f"{p}.ln1", w(f"{p}.up.w", (dim, 4 * dim), dim**-0.5)], [f"{p}.up"]),
            h.make_node("FastGelu", [f"{p}.up", w(f"{p}.up.b", (4 * dim,), 0.01)], [f"{p}.act"], **ms),
            h.make_node("MatMul", [f"{p}.act", w(f"{p}.down.w", (4 * dim, dim), 0.5 * (4 * dim) ** -0.5)], [f"{p}.dn"]),
            h.make_node(
                "SkipLayerNormalization",
                [
                    f"{p}.dn",
                    f"{p}.ln1",
                    w(f"{p}.ln2.g", (dim,), 0.1),
                    w(f"{p}.ln2.b", (dim,), 0.01),
                    w(f"{p}.dn.b", (dim,), 0.01),
                ],
                [f"{p}.out"],
                epsilon=1e-5,
                **ms,
            ),  # fmt: skip
        ]
        cur = f"{p}.out"
    nodes.append(h.make_node("Cast", [cur], ["y"], to=T.FLOAT))
    io = [_io("x", T.FLOAT, ["batch", "seq", dim])], [_io("y", T.FLOAT, ["batch", "seq", dim])]
    return _save(_model(nodes, inits, *io, ms_domain=True), Path(path), external=False)


def _llama(fp16: bool) -> Callable[..., Path]:
    def build(path: Path, mib: float = 2.0, seed: int = 0, shared_norm: bool = False, causal: bool = False) -> Path:
        """A llama-like decoder as exporters leave it, unfused: RMSNorm from Pow/ReduceMean/Sqrt/Div, Q/K/V
        MatMuls, rotary embedding from cos/sin caches gathered by ``position_ids``, an additive mask from
        ``attention_mask``, Softmax attention, output projection, SiLU-gated MLP, residual Adds; the mask and
        the rotary tensors are computed once from the graph inputs and read by every layer. ``shared_norm``: every
        RMSNorm reads one all-ones weight, as torch dynamo's export of an untrained model writes it (its optimizer
        makes equal initializers one). ``causal``: the mask is also causal, built from ``Range`` over the sequence
        length read from ``attention_mask``'s shape (``LessOrEqual``, ``Where``), as torch exports write it."""
        import numpy as np
        from onnx import TensorProto as T
        from onnx import helper as h
        from onnx import numpy_helper as nh

        ft = np.float16 if fp16 else np.float32
        elem = T.FLOAT16 if fp16 else T.FLOAT
        dim, layers = _dims(mib, (2 if fp16 else 4) * 10)
        heads = max(1, dim // 64)
        hd, ff, max_pos = dim // heads, 2 * dim, 64
        rng = np.random.default_rng(seed)
        pos = np.arange(max_pos)[:, None] / (10000 ** (np.arange(0, hd, 2) / hd))[None, :]
        inits = [
            nh.from_array(np.cos(pos).astype(ft), "cos_cache"),
            nh.from_array(np.sin(pos).astype(ft), "sin_cache"),
            nh.from_array(np.array([0, 0, heads, hd], np.int64), "heads_shape"),
            nh.from_array(np.array([0, 0, dim], np.int64), "merge_shape"),
            nh.from_array(np.array(hd**0.5, ft), "scale"),
            nh.from_array(np.array(1e-5, ft), "eps"),
            nh.from_array(np.array(2.0, ft), "two"),
            nh.from_array(np.array(1.0, ft), "one"),
            nh.from_array(np.array(-10000.0, ft), "neg"),
            nh.from_array(np.array([hd // 2, hd // 2], np.int64), "halves"),
        ]
        nodes: list[onnx.NodeProto] = []

        def op(kind: str, ins: list[str], out: str, **attrs: Any) -> str:
            nodes.append(h.make_node(kind, ins, [out], **attrs))
            return out

        def mm(x: str, name: str, k: int, n: int) -> str:
            inits.append(nh.from_array(_arr(rng, (k, n), 0.5 * k**-0.5, ft), f"{name}.w"))
            return op("MatMul", [x, f"{name}.w"], name)

        def rms(x: str, name: str) -> str:
            g = "norm.g" if shared_norm else f"{name}.g"
            if g not in {t.name for t in inits}:
                value = np.ones(dim) if shared_norm else 1 + _arr(rng, (dim,), 0.05)
                inits.append(nh.from_array(value.astype(ft), g))
            var = op("ReduceMean", [op("Pow", [x, "two"], f"{name}.sq")], f"{name}.var", axes=[-1], keepdims=1)
            den = op("Sqrt", [op("Add", [var, "eps"], f"{name}.ve")], f"{name}.den")
            return op("Mul", [op("Div", [x, den], f"{name}.n"), g], name)

        # from the graph inputs, once: the additive mask [b, 1, 1, s] and cos/sin [b, 1, s, hd]
        m = op("Cast", ["attention_mask"], "mask.f", to=elem)
        bias = op("Mul", [op("Sub", ["one", m], "mask.inv"), "neg"], "mask.neg")
        bias = op("Unsqueeze", [bias, "axes12"], "mask.bias")
        inits.append(nh.from_array(np.array([1, 2], np.int64), "axes12"))
        if causal:  # [b, 1, 1, s] + [s, s]: position j attends to positions up to j
            inits += [nh.from_array(np.array(v, np.int64), n) for v, n in ((0, "i0"), (1, "i1"), ([0], "axes0"))]
            length = op("Squeeze", [op("Shape", ["attention_mask"], "mask.len", start=1, end=2), "axes0"], "len")
            steps = op("Range", ["i0", length, "i1"], "steps")
            rows, cols = op("Unsqueeze", [steps, "axes1"], "rows"), op("Unsqueeze", [steps, "axes0"], "cols")
            allowed = op("LessOrEqual", [cols, rows], "allowed")
            zero = nh.from_array(np.array(0.0, ft), "zero")
            inits.append(zero)
            bias = op("Add", [bias, op("Where", [allowed, "zero", "neg"], "causal")], "mask.full")
        inits.append(nh.from_array(np.array([1], np.int64), "axes1"))
        rot = {}
        for t in ("cos", "sin"):
            half = op("Gather", [f"{t}_cache", "position_ids"], f"{t}.half")
            rot[t] = op("Unsqueeze", [op("Concat", [half, half], f"{t}.full", axis=-1), "axes1"], t)

        def rotary(x: str, name: str) -> str:
            a, b = f"{name}.a", f"{name}.b"
            nodes.append(h.make_node("Split", [x, "halves"], [a, b], axis=-1))
            rotated = op("Concat", [op("Neg", [b], f"{name}.nb"), a], f"{name}.rot", axis=-1)
            return op(
                "Add",
                [op("Mul", [x, rot["cos"]], f"{name}.xc"), op("Mul", [rotated, rot["sin"]], f"{name}.rs")],
                f"{name}.pe",
            )

        cur = "x"
        for i in range(layers):
            p = f"layer{i}"
            a = rms(cur, f"{p}.norm1")
            heads_of = {
                t: op(
                    "Transpose",
                    [op("Reshape", [mm(a, f"{p}.{t}", dim, dim), "heads_shape"], f"{p}.{t}.r")],
                    f"{p}.{t}.t",
                    perm=[0, 2, 1, 3],
                )
                for t in ("q", "k", "v")
            }
            q, k = rotary(heads_of["q"], f"{p}.q"), rotary(heads_of["k"], f"{p}.k")
            k = op("Transpose", [k], f"{p}.k.tt", perm=[0, 1, 3, 2])
            scores = op("Add", [op("Div", [op("MatMul", [q, k], f"{p}.qk"), "scale"], f"{p}.sd"), bias], f"{p}.sm")
            ctx = op("MatMul", [op("Softmax", [scores], f"{p}.probs", axis=-1), heads_of["v"]], f"{p}.ctx")
            merged = op(
                "Reshape", [op("Transpose", [ctx], f"{p}.ctx.t", perm=[0, 2, 1, 3]), "merge_shape"], f"{p}.ctx.m"
            )
            cur = op("Add", [cur, mm(merged, f"{p}.o", dim, dim)], f"{p}.attn")
            b2 = rms(cur, f"{p}.norm2")
            gate = mm(b2, f"{p}.gate", dim, ff)
            silu = op("Mul", [gate, op("Sigmoid", [gate], f"{p}.sig")], f"{p}.silu")
            act = op("Mul", [silu, mm(b2, f"{p}.up", dim, ff)], f"{p}.act")
            cur = op("Add", [cur, mm(act, f"{p}.down", ff, dim)], f"{p}.out")
        op("Identity", [rms(cur, "final_norm")], "y")
        io = (
            [
                _io("x", elem, ["batch", "seq", dim]),
                _io("attention_mask", T.INT64, ["batch", "seq"]),
                _io("position_ids", T.INT64, ["batch", "seq"]),
            ],
            [_io("y", elem, ["batch", "seq", dim])],
        )
        return _save(_model(nodes, inits, *io), Path(path), external=True)

    return build


def vit_fp16(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
    """An fp16 ViT as ORT's transformers optimizer leaves a torch-dynamo export (``/work/forms``-style ``vit-fp16``):
    fp32 pixels cast to fp16, a patch Conv, a class token expanded to the batch read from the pixels' shape,
    position embeddings, one LayerNormalization, then per layer Q/K/V MatMul + Add, scaled attention with an
    additive mask built from the pixels' shape (Where of an Expand: every layer reads it), output MatMul,
    SkipLayerNormalization, MatMul + BiasGelu, MatMul, SkipLayerNormalization; every norm reads one shared weight
    and bias (the exporter's optimizer makes equal initializers one). Not a ``FORMS`` entry: the corpus tests run
    every form, this one is for the flat ``--prepack`` test and bench. External data."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    f16 = np.float16
    dim, layers = _dims(mib, 2 * 12)
    heads = max(1, dim // 64)
    hd, patch, side = dim // heads, 8, 32
    n = (side // patch) ** 2 + 1
    rng = np.random.default_rng(seed)
    inits = [
        nh.from_array(_arr(rng, (dim, 3, patch, patch), 0.05, f16), "patch.w"),
        nh.from_array(_arr(rng, (1, 1, dim), 0.5, f16), "cls"),
        nh.from_array(_arr(rng, (1, n, dim), 0.5, f16), "pos"),
        nh.from_array(np.ones(dim, f16), "norm.g"),
        nh.from_array(np.zeros(dim, f16), "norm.b"),
        nh.from_array(np.array(hd**-0.25, f16), "scale"),
        nh.from_array(np.array([0, dim, -1], np.int64), "flat_shape"),
        nh.from_array(np.array([0, 0, heads, hd], np.int64), "heads_shape"),
        nh.from_array(np.array([0, 0, dim], np.int64), "merge_shape"),
        nh.from_array(np.array([1], np.int64), "one"),
        nh.from_array(np.array([n], np.int64), "tokens"),
        nh.from_array(np.ones((1, 1, 1, 1), bool), "ge"),
        nh.from_array(np.array(0.0, f16), "zero"),
        nh.from_array(np.array(-10000.0, f16), "neg"),
    ]
    nodes: list[onnx.NodeProto] = []

    def op(kind: str, ins: list[str], out: str | list[str], **attrs: Any) -> str:
        outs = [out] if isinstance(out, str) else out
        nodes.append(h.make_node(kind, ins, outs, **attrs))
        return outs[0]

    def op_ms(kind: str, ins: list[str], outs: list[str], **attrs: Any) -> str:
        nodes.append(h.make_node(kind, ins, outs, domain="com.microsoft", **attrs))
        return outs[0]

    def linear(x: str, name: str, k: int, m: int, bias: bool = True) -> str:
        inits.append(nh.from_array(_arr(rng, (k, m), k**-0.5, f16), f"{name}.w"))
        y = op("MatMul", [x, f"{name}.w"], f"{name}.mm")
        if not bias:
            return y
        inits.append(nh.from_array(_arr(rng, (m,), 0.02, f16), f"{name}.b"))
        return op("Add", [y, f"{name}.b"], name)

    px = op("Cast", ["pixel_values"], "px", to=T.FLOAT16)
    batch = op("Shape", [px], "batch", start=0, end=1)
    grid = op("Conv", [px, "patch.w"], "grid", kernel_shape=[patch, patch], strides=[patch, patch])
    flat = op("Transpose", [op("Reshape", [grid, "flat_shape"], "flat")], "patches", perm=[0, 2, 1])
    cls = op("Expand", ["cls", op("Concat", [batch, "one", "one"], "cls_shape", axis=0)], "cls_b")
    x = op("Add", [op("Concat", [cls, flat], "tokens_in", axis=1), "pos"], "embedded")
    mask_shape = op("Concat", [batch, "one", "tokens", "tokens"], "mask_shape", axis=0)
    mask = op("Where", [op("Expand", ["ge", mask_shape], "mask_on"), "zero", "neg"], "mask")
    hidden = op("LayerNormalization", [x, "norm.g", "norm.b"], "ln0", axis=-1, epsilon=1e-5)
    residual = x
    for i in range(layers):
        p = f"layer{i}"
        q, k, v = (op("Reshape", [linear(hidden, f"{p}.{t}", dim, dim), "heads_shape"], f"{p}.{t}.r") for t in "qkv")
        q = op("Mul", [op("Transpose", [q], f"{p}.q.t", perm=[0, 2, 1, 3]), "scale"], f"{p}.q.s")
        k = op("Mul", [op("Transpose", [k], f"{p}.k.t", perm=[0, 2, 3, 1]), "scale"], f"{p}.k.s")
        v = op("Transpose", [v], f"{p}.v.t", perm=[0, 2, 1, 3])
        scores = op("Add", [op("MatMul", [q, k], f"{p}.qk"), mask], f"{p}.scores")
        ctx = op("MatMul", [op("Softmax", [scores], f"{p}.probs", axis=-1), v], f"{p}.ctx")
        ctx = op("Reshape", [op("Transpose", [ctx], f"{p}.ctx.t", perm=[0, 2, 1, 3]), "merge_shape"], f"{p}.ctx.m")
        inits.append(nh.from_array(_arr(rng, (dim,), 0.02, f16), f"{p}.o.b"))
        o = linear(ctx, f"{p}.o", dim, dim, bias=False)
        ins = [o, residual, "norm.g", "norm.b", f"{p}.o.b"]
        hidden = op_ms("SkipLayerNormalization", ins, [f"{p}.ln1", "", "", f"{p}.res1"], epsilon=1e-5)
        residual = f"{p}.res1"
        inits.append(nh.from_array(_arr(rng, (4 * dim,), 0.02, f16), f"{p}.fc1.b"))
        mid = op_ms("BiasGelu", [linear(hidden, f"{p}.fc1", dim, 4 * dim, bias=False), f"{p}.fc1.b"], [f"{p}.gelu"])
        inits.append(nh.from_array(_arr(rng, (dim,), 0.02, f16), f"{p}.fc2.b"))
        out = linear(mid, f"{p}.fc2", 4 * dim, dim, bias=False)
        ins = [out, residual, "norm.g", "norm.b", f"{p}.fc2.b"]
        hidden = op_ms("SkipLayerNormalization", ins, [f"{p}.ln2", "", "", f"{p}.res2"], epsilon=1e-5)
        residual = f"{p}.res2"
    nodes.append(h.make_node("Cast", [hidden], ["y"], to=T.FLOAT))
    io = [_io("pixel_values", T.FLOAT, ["batch", 3, side, side])], [_io("y", T.FLOAT, ["batch", n, dim])]
    model = _model(nodes, inits, *io, ms_domain=True)
    # the exporter writes the types of what its optimizer fused (ONNX's shape inference does not know those ops)
    for name in (o for n in nodes if n.domain == "com.microsoft" for o in n.output if o):
        wide = name.endswith(".gelu")
        model.graph.value_info.append(_io(name, T.FLOAT16, ["batch", n, 4 * dim if wide else dim]))
    return _save(model, Path(path), external=True)


def causal_llama_fp16(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
    """``llama_fp16`` with a causal mask (``_llama``'s ``causal``). Not a ``FORMS`` entry: for the flat
    ``--prepack`` test and bench."""
    return _llama(True)(path, mib, seed, causal=True)


def ms_attention(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
    """com.microsoft Attention (packed QKV weight [d, 3d] + bias, as ORT's transformers optimizer
    writes it), output projection and residual per layer; fp32, external data."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    dim, layers = _dims(mib, 4 * 4)
    rng = np.random.default_rng(seed)
    nodes, inits, cur = [], [], "x"
    for i in range(layers):
        p = f"layer{i}"
        inits += [
            nh.from_array(_arr(rng, (dim, 3 * dim), dim**-0.5), f"{p}.qkv.w"),
            nh.from_array(_arr(rng, (3 * dim,), 0.01), f"{p}.qkv.b"),
            nh.from_array(_arr(rng, (dim, dim), 0.5 * dim**-0.5), f"{p}.o.w"),
        ]
        nodes += [
            h.make_node(
                "Attention",
                [cur, f"{p}.qkv.w", f"{p}.qkv.b"],
                [f"{p}.attn"],
                domain="com.microsoft",
                num_heads=max(1, dim // 64),
            ),
            h.make_node("MatMul", [f"{p}.attn", f"{p}.o.w"], [f"{p}.o"]),
            h.make_node("Add", [cur, f"{p}.o"], [f"{p}.out"]),
        ]
        cur = f"{p}.out"
    nodes.append(h.make_node("Identity", [cur], ["y"]))
    io = [_io("x", T.FLOAT, ["batch", "seq", dim])], [_io("y", T.FLOAT, ["batch", "seq", dim])]
    return _save(_model(nodes, inits, *io, ms_domain=True), Path(path), external=True)


def merged_decoder(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
    """optimum's decoder_model_merged layout: ``If`` on the bool input ``use_cache_branch``, both
    branches' MatMuls using the main graph's (outer-scope) initializers; external data. The branches
    differ (the cache branch adds ``past`` to the input) so each is told apart by its output."""
    from onnx import TensorProto as T
    from onnx import helper as h

    dim, layers = _dims(mib, 32)

    def branch(name: str, x: str) -> tuple[onnx.GraphProto, list[onnx.TensorProto]]:
        nodes, inits = _mlp_nodes(dim, layers, seed, x=x)
        nodes[-1] = h.make_node("Identity", [nodes[-1].input[0]], [f"{name}.y"])
        return h.make_graph(nodes, name, [], [_io(f"{name}.y", T.FLOAT, None)]), inits

    with_past, inits = branch("with_past", "x_past")
    without, _ = branch("without_past", "x")
    nodes = [
        h.make_node("Add", ["x", "past"], ["x_past"]),
        h.make_node("If", ["use_cache_branch"], ["y"], then_branch=with_past, else_branch=without),
    ]
    inputs = [
        _io("x", T.FLOAT, ["batch", "seq", dim]),
        _io("past", T.FLOAT, ["batch", "seq", dim]),
        _io("use_cache_branch", T.BOOL, [1]),
    ]
    return _save(_model(nodes, inits, inputs, [_io("y", T.FLOAT, None)]), Path(path), external=True)


def decoder_family(directory: str | os.PathLike[str], mib: float = 2.0, seed: int = 0) -> list[Path]:
    """optimum's decoder export: decoder_model.onnx (no past), decoder_with_past_model.onnx and
    decoder_model_merged.onnx (``merged_decoder``), the same weights in each (three data files)."""
    from onnx import TensorProto as T
    from onnx import helper as h

    d = Path(directory)
    dim, layers = _dims(mib, 32)
    first = _mlp(dim, layers, seed)
    nodes, inits = _mlp_nodes(dim, layers, seed, x="x_past")
    past_inputs = [_io("x", T.FLOAT, ["batch", "seq", dim]), _io("past", T.FLOAT, ["batch", "seq", dim])]
    with_past = _model(
        [h.make_node("Add", ["x", "past"], ["x_past"]), *nodes],
        inits,
        past_inputs,
        [_io("y", T.FLOAT, ["batch", "seq", dim])],
    )
    return [
        _save(first, d / "decoder_model.onnx", external=True),
        _save(with_past, d / "decoder_with_past_model.onnx", external=True),
        merged_decoder(d / "decoder_model_merged.onnx", mib, seed),
    ]


def whisper_encoder(
    path: Path,
    dim: int = 64,
    layers: int = 2,
    mel_bins: int = 8,
    positions: int = 16,
    seed: int = 0,
    input_name: str = "input_features",
    dynamic: bool = True,
) -> Path:
    """Whisper's encoder as optimum exports it (``encoder_model.onnx``): ``input_features`` [batch_size,
    feature_size, encoder_sequence_length], a Conv1d stem (k3, then k3 stride 2), the position embeddings
    [positions, dim] added (so the frames must be exactly 2 * positions, what ``config.json``'s
    ``max_source_positions`` says), MLP blocks, ``last_hidden_state`` [batch_size, encoder_sequence_length / 2,
    dim]; weights embedded. ``dynamic=False``: static [1, mel_bins, 2 * positions] (a bench's fixed input)."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(seed)
    inits = [
        nh.from_array(_arr(rng, (dim, mel_bins, 3), (3 * mel_bins) ** -0.5), "conv1.weight"),
        nh.from_array(_arr(rng, (dim, dim, 3), (3 * dim) ** -0.5), "conv2.weight"),
        nh.from_array(_arr(rng, (positions, dim), 0.1), "embed_positions.weight"),
    ]
    nodes = [
        h.make_node("Conv", [input_name, "conv1.weight"], ["c1"], pads=[1, 1]),
        h.make_node("Relu", ["c1"], ["g1"]),
        h.make_node("Conv", ["g1", "conv2.weight"], ["c2"], pads=[1, 1], strides=[2]),
        h.make_node("Relu", ["c2"], ["g2"]),
        h.make_node("Transpose", ["g2"], ["t"], perm=[0, 2, 1]),
        h.make_node("Add", ["t", "embed_positions.weight"], ["x"]),
    ]
    mlp, mlp_inits = _mlp_nodes(dim, layers, seed, x="x")
    mlp[-1] = h.make_node("Identity", [mlp[-1].input[0]], ["last_hidden_state"])
    shape: list[Any] = (
        ["batch_size", "feature_size", "encoder_sequence_length"] if dynamic else [1, mel_bins, 2 * positions]
    )
    out = ["batch_size", "encoder_sequence_length / 2", dim] if dynamic else [1, positions, dim]
    model = _model(
        nodes + mlp, inits + mlp_inits, [_io(input_name, T.FLOAT, shape)], [_io("last_hidden_state", T.FLOAT, out)]
    )
    return _save(model, Path(path), external=False)


def whisper_merged_decoder(
    path: Path, dim: int = 64, heads: int = 2, vocab: int = 512, seed: int = 0, external: bool = False
) -> Path:
    """optimum's ``decoder_model_merged.onnx`` for Whisper (one layer): inputs ``input_ids``,
    ``encoder_hidden_states``, ``past_key_values.0.{decoder,encoder}.{key,value}``, ``use_cache_branch``; outputs
    ``logits``, ``present.0.{decoder,encoder}.{key,value}``. An ``If`` on use_cache_branch: the prefill branch
    projects the encoder's states into the cross-attention K/V and outputs them; the cache branch concatenates the
    self-attention past, reads cross K/V from ``past_key_values.0.encoder.*`` and outputs optimum's dummy constant
    ([1, 1, 1, 1] zeros) as ``present.0.encoder.*`` (its with-past model has no such output; the merge pads
    it). Token embedding [vocab, dim] and LM head [dim, vocab]: ``vocab`` sizes the weights."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(seed)
    size = dim // heads
    weights = {
        "embed_tokens.weight": _arr(rng, (vocab, dim), 1.0),
        "proj_out.weight": _arr(rng, (dim, vocab), dim**-0.5),
        **{f"self.{w}": _arr(rng, (dim, dim), dim**-0.5) for w in ("q", "k", "v")},
        **{f"cross.{w}": _arr(rng, (dim, dim), dim**-0.5) for w in ("q", "k", "v")},
        "split_heads": np.array([0, 0, heads, size], np.int64),
        "merge_heads": np.array([0, 0, dim], np.int64),
        "scale": np.array(size**-0.5, np.float32),
    }
    inits = [nh.from_array(a, n) for n, a in weights.items()]

    def heads_of(x: str, out: str) -> list[onnx.NodeProto]:
        return [
            h.make_node("Reshape", [x, "split_heads"], [f"{out}.r"]),
            h.make_node("Transpose", [f"{out}.r"], [out], perm=[0, 2, 1, 3]),
        ]

    def attend(q4: str, k4: str, v4: str, out: str) -> list[onnx.NodeProto]:
        return [
            h.make_node("Transpose", [k4], [f"{out}.kt"], perm=[0, 1, 3, 2]),
            h.make_node("MatMul", [q4, f"{out}.kt"], [f"{out}.s"]),
            h.make_node("Mul", [f"{out}.s", "scale"], [f"{out}.ss"]),
            h.make_node("Softmax", [f"{out}.ss"], [f"{out}.p"], axis=-1),
            h.make_node("MatMul", [f"{out}.p", v4], [f"{out}.o"]),
            h.make_node("Transpose", [f"{out}.o"], [f"{out}.ot"], perm=[0, 2, 1, 3]),
            h.make_node("Reshape", [f"{out}.ot", "merge_heads"], [out]),
        ]

    def branch(cache: bool) -> onnx.GraphProto:
        tag = "c" if cache else "n"
        nodes = [
            *heads_of("k", f"{tag}.k_new"),
            *heads_of("v", f"{tag}.v_new"),
        ]
        if cache:
            nodes += [
                h.make_node("Concat", ["past_key_values.0.decoder.key", "c.k_new"], ["c.dk"], axis=2),
                h.make_node("Concat", ["past_key_values.0.decoder.value", "c.v_new"], ["c.dv"], axis=2),
                h.make_node("Identity", ["past_key_values.0.encoder.key"], ["c.ek"]),
                h.make_node("Identity", ["past_key_values.0.encoder.value"], ["c.ev"]),
                h.make_node("Constant", [], ["c.dummy_k"], value=nh.from_array(np.zeros((1, 1, 1, 1), np.float32))),
                h.make_node("Constant", [], ["c.dummy_v"], value=nh.from_array(np.zeros((1, 1, 1, 1), np.float32))),
            ]
            present_enc = ["c.dummy_k", "c.dummy_v"]
        else:
            nodes += [
                h.make_node("Identity", ["n.k_new"], ["n.dk"]),
                h.make_node("Identity", ["n.v_new"], ["n.dv"]),
                h.make_node("MatMul", ["encoder_hidden_states", "cross.k"], ["n.ek2"]),
                h.make_node("MatMul", ["encoder_hidden_states", "cross.v"], ["n.ev2"]),
                *heads_of("n.ek2", "n.ek"),
                *heads_of("n.ev2", "n.ev"),
            ]
            present_enc = ["n.ek", "n.ev"]
        nodes += [
            *attend("q4", f"{tag}.dk", f"{tag}.dv", f"{tag}.sa"),
            h.make_node("Add", ["x", f"{tag}.sa"], [f"{tag}.x1"]),
            h.make_node("MatMul", [f"{tag}.x1", "cross.q"], [f"{tag}.cq"]),
            *heads_of(f"{tag}.cq", f"{tag}.cq4"),
            *attend(f"{tag}.cq4", f"{tag}.ek", f"{tag}.ev", f"{tag}.ca"),
            h.make_node("Add", [f"{tag}.x1", f"{tag}.ca"], [f"{tag}.x2"]),
            h.make_node("MatMul", [f"{tag}.x2", "proj_out.weight"], [f"{tag}.logits"]),
        ]
        outs = [f"{tag}.logits", f"{tag}.dk", f"{tag}.dv", *present_enc]
        return h.make_graph(nodes, "with_past" if cache else "no_past", [], [_io(o, T.FLOAT, None) for o in outs])

    presents = ["present.0.decoder.key", "present.0.decoder.value", "present.0.encoder.key", "present.0.encoder.value"]
    nodes = [
        h.make_node("Gather", ["embed_tokens.weight", "input_ids"], ["x"]),
        h.make_node("MatMul", ["x", "self.q"], ["q"]),
        h.make_node("MatMul", ["x", "self.k"], ["k"]),
        h.make_node("MatMul", ["x", "self.v"], ["v"]),
        *heads_of("q", "q4"),
        h.make_node(
            "If", ["use_cache_branch"], ["logits", *presents], then_branch=branch(True), else_branch=branch(False)
        ),
    ]
    self_kv = ["batch_size", heads, "past_decoder_sequence_length", size]
    cross_kv = ["batch_size", heads, "encoder_sequence_length_out", size]
    inputs = [
        _io("input_ids", T.INT64, ["batch_size", "decoder_sequence_length"]),
        _io("encoder_hidden_states", T.FLOAT, ["batch_size", "encoder_sequence_length / 2", dim]),
        _io("past_key_values.0.decoder.key", T.FLOAT, self_kv),
        _io("past_key_values.0.decoder.value", T.FLOAT, self_kv),
        _io("past_key_values.0.encoder.key", T.FLOAT, cross_kv),
        _io("past_key_values.0.encoder.value", T.FLOAT, cross_kv),
        _io("use_cache_branch", T.BOOL, [1]),
    ]
    out_self = ["batch_size", heads, "past_decoder_sequence_length + 1", size]
    outputs = [
        _io("logits", T.FLOAT, ["batch_size", "decoder_sequence_length", vocab]),
        _io("present.0.decoder.key", T.FLOAT, out_self),
        _io("present.0.decoder.value", T.FLOAT, out_self),
        _io("present.0.encoder.key", T.FLOAT, ["batch_size", heads, "encoder_sequence_length_out", size]),
        _io("present.0.encoder.value", T.FLOAT, ["batch_size", heads, "encoder_sequence_length_out", size]),
    ]
    return _save(_model(nodes, inits, inputs, outputs), Path(path), external=external)


def whisper_family(
    directory: str | os.PathLike[str], dim: int = 64, vocab: int = 512, mel_bins: int = 8, positions: int = 16
) -> list[Path]:
    """optimum's ``automatic-speech-recognition-with-past`` Whisper export in miniature: ``encoder_model.onnx``,
    ``decoder_model_merged.onnx`` and the ``config.json`` beside them (num_mel_bins, max_source_positions, d_model,
    heads, vocab_size), weights embedded as optimum writes small models."""
    import json

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "whisper",
        "d_model": dim,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "num_mel_bins": mel_bins,
        "max_source_positions": positions,
        "vocab_size": vocab,
    }
    (d / "config.json").write_text(json.dumps(config))
    return [
        whisper_encoder(d / "encoder_model.onnx", dim, mel_bins=mel_bins, positions=positions),
        whisper_merged_decoder(d / "decoder_model_merged.onnx", dim, vocab=vocab),
    ]


def vit_export(
    path: Path, image: int = 32, patch: int = 8, dim: int = 64, layers: int = 2, config: bool = True, seed: int = 0
) -> Path:
    """A ViT as optimum's ``feature-extraction`` export writes it: ``pixel_values`` [batch_size, num_channels,
    height, width] (every dim symbolic), a patch Conv (stride ``patch``), position embeddings for exactly
    (image / patch)^2 patches (so only the configured size runs), MLP blocks, ``last_hidden_state``; weights
    embedded; ``config.json`` beside it (image_size, num_channels, patch_size) unless ``config`` is False."""
    import json

    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(seed)
    patches = (image // patch) ** 2
    inits = [
        nh.from_array(_arr(rng, (dim, 3, patch, patch), (3 * patch * patch) ** -0.5), "patch.weight"),
        nh.from_array(_arr(rng, (patches, dim), 0.1), "position_embeddings"),
        nh.from_array(np.array([0, dim, -1], np.int64), "flat"),
    ]
    nodes = [
        h.make_node("Conv", ["pixel_values", "patch.weight"], ["p"], strides=[patch, patch]),
        h.make_node("Reshape", ["p", "flat"], ["pf"]),
        h.make_node("Transpose", ["pf"], ["pt"], perm=[0, 2, 1]),
        h.make_node("Add", ["pt", "position_embeddings"], ["x"]),
    ]
    mlp, mlp_inits = _mlp_nodes(dim, layers, seed, x="x")
    mlp[-1] = h.make_node("Identity", [mlp[-1].input[0]], ["last_hidden_state"])
    pixels = _io("pixel_values", T.FLOAT, ["batch_size", "num_channels", "height", "width"])
    out = _io("last_hidden_state", T.FLOAT, ["batch_size", "sequence_length", dim])
    path = _save(_model(nodes + mlp, inits + mlp_inits, [pixels], [out]), Path(path), external=False)
    if config:
        settings = {
            "model_type": "vit",
            "image_size": image,
            "num_channels": 3,
            "patch_size": patch,
            "hidden_size": dim,
        }
        (path.parent / "config.json").write_text(json.dumps(settings))
    return path


def conv_net(path: Path, mib: float = 2.0, seed: int = 0) -> Path:
    """A small ResNet/Inception-like CNN (Conv+BN+Relu, Clip, branches; NCHWc at ORT_ENABLE_ALL), external data."""
    from prepack_samples import cnn_onnx

    # 3x3 Conv weights dominate: two per residual block, c^2 * 9 * 4 bytes each.
    channels = 32
    for c in (32, 64, 128, 256, 512):
        if 9 * 4 * c * c * 2 * 3 <= mib * MiB:
            channels = c
    blocks = max(3, round(mib * MiB / (9 * 4 * channels * channels * 2)))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return cnn_onnx(Path(path), channels=channels, blocks=blocks, spatial=8)


# --- index paths as exporters write them (verify's generated inputs must stay inside every table) ---------------


def ort_optimizer_bert(path: Path, vocab: int = 30, hidden: int = 16, positions: int = 32, fp16: bool = False) -> Path:
    """BERT's embeddings as onnxruntime's transformer optimizer fuses them (``fusion_embedlayer.py``): int64 graph
    inputs, each cast to int32 by a ``Cast`` named ``<input>_casted`` before ``EmbedLayerNormalization``
    (com.microsoft: word / position / 2-row segment tables); ``fp16`` (``float16=True``): fp16 tables and output.
    No logits: nothing but the tables says how large the ids may be."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    dtype, elem = (np.float16, T.FLOAT16) if fp16 else (np.float32, T.FLOAT)
    inits = [
        nh.from_array(_arr(rng, (vocab, hidden), 1.0, dtype), "word_embeddings"),
        nh.from_array(_arr(rng, (positions, hidden), 1.0, dtype), "position_embeddings"),
        nh.from_array(_arr(rng, (2, hidden), 1.0, dtype), "token_type_embeddings"),
        nh.from_array(np.ones(hidden, dtype), "ln.gamma"),
        nh.from_array(np.zeros(hidden, dtype), "ln.beta"),
        nh.from_array(_arr(rng, (hidden, 8), hidden**-0.5, dtype), "W"),
    ]
    names = ("input_ids", "token_type_ids", "attention_mask")
    nodes = [h.make_node("Cast", [n], [f"{n}_int32"], name=f"{n}_casted", to=T.INT32) for n in names]
    nodes += [
        h.make_node(
            "EmbedLayerNormalization",
            ["input_ids_int32", "token_type_ids_int32", "word_embeddings", "position_embeddings",
             "token_type_embeddings", "ln.gamma", "ln.beta", "attention_mask_int32"],
            ["embed_output", "mask_index"], name="EmbedLayerNormalization_0", domain="com.microsoft", epsilon=1e-12,
        ),
        h.make_node("MatMul", ["embed_output", "W"], ["last_hidden_state"]),
    ]  # fmt: skip
    seq = ["batch_size", "sequence_length"]
    inputs = [_io(n, T.INT64, seq) for n in names]
    outputs = [_io("last_hidden_state", elem, [*seq, 8]), _io("mask_index", T.INT32, ["batch_size"])]
    return _save(_model(nodes, inits, inputs, outputs, ms_domain=True), path, external=False)


def indirect_tables(path: Path, vocab: int = 40, hidden: int = 32) -> Path:
    """Tables reached indirectly, as exporters write them: token ids cast to int32 into a ``Gather`` of a
    ``DequantizeLinear`` table (a QDQ embedding); type ids through ``Unsqueeze``/``Squeeze``/``Reshape`` into a
    2-row table; bucket ids plus a constant offset (OPT adds 2 to its positions) into ``GatherBlockQuantized``
    (com.microsoft, genai's int4 embeddings: 4-bit pairs in uint8, block 16) of 8 rows; every id ``Concat``ed into
    a ``GatherElements`` of a 40-wide table. No logits, no config: only the tables bound the ids."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(0)
    rows = 8
    block = 16
    inits = [
        nh.from_array(rng.integers(-127, 128, (vocab, hidden), dtype=np.int8), "word_q"),
        nh.from_array(np.float32(0.02), "word_scale"),
        nh.from_array(np.int8(0), "word_zero"),
        nh.from_array(_arr(rng, (2, hidden), 1.0), "type_table"),
        nh.from_array(rng.integers(0, 256, (rows, hidden // 2), dtype=np.uint8), "bucket_q"),
        nh.from_array((rng.random((rows, hidden // block), dtype=np.float32) + 0.5) * 0.1, "bucket_scales"),
        nh.from_array(np.array([3], np.int64), "bucket_offset"),
        nh.from_array(np.array([-1], np.int64), "flat"),
        nh.from_array(_arr(rng, (1, vocab), 1.0), "wide"),
    ]
    nodes = [
        h.make_node("Cast", ["input_ids"], ["ids32"], to=T.INT32),
        h.make_node("DequantizeLinear", ["word_q", "word_scale", "word_zero"], ["word_table"]),
        h.make_node("Gather", ["word_table", "ids32"], ["e_word"], axis=0),
        h.make_node("Unsqueeze", ["token_type_ids", "zero_axis"], ["tt_u"]),
        h.make_node("Squeeze", ["tt_u", "zero_axis"], ["tt_s"]),
        h.make_node("Shape", ["token_type_ids"], ["tt_shape"]),
        h.make_node("Reshape", ["tt_s", "flat"], ["tt_flat"]),
        h.make_node("Gather", ["type_table", "tt_flat"], ["e_type_flat"], axis=0),
        h.make_node("Concat", ["tt_shape", "hidden_dim"], ["e_shape"], axis=0),
        h.make_node("Reshape", ["e_type_flat", "e_shape"], ["e_type"]),
        h.make_node("Add", ["bucket_ids", "bucket_offset"], ["buckets"]),
        h.make_node(
            "GatherBlockQuantized", ["bucket_q", "buckets", "bucket_scales"], ["e_bucket"], domain="com.microsoft",
            gather_axis=0, quantize_axis=1, block_size=block, bits=4,
        ),
        h.make_node("Add", ["e_word", "e_type"], ["e_sum"]),
        h.make_node("Add", ["e_sum", "e_bucket"], ["embeddings"]),
        h.make_node("Concat", ["input_ids", "bucket_ids"], ["all_ids"], axis=1),
        h.make_node("Reshape", ["all_ids", "one_row"], ["all_row"]),
        h.make_node("GatherElements", ["wide", "all_row"], ["picked"], axis=1),
    ]  # fmt: skip
    inits += [
        nh.from_array(np.array([0], np.int64), "zero_axis"),
        nh.from_array(np.array([hidden], np.int64), "hidden_dim"),
        nh.from_array(np.array([1, -1], np.int64), "one_row"),
    ]
    seq = ["batch_size", "sequence_length"]
    inputs = [_io(n, T.INT64, seq) for n in ("input_ids", "token_type_ids", "bucket_ids")]
    outputs = [_io("embeddings", T.FLOAT, [*seq, hidden]), _io("picked", T.FLOAT, [1, None])]
    model = _model(nodes, inits, inputs, outputs, ms_domain=True)
    model.opset_import[0].version = 21  # DequantizeLinear with int8 zero points and scalar scales
    return _save(model, path, external=False)


def voice_activity(path: Path, seed: int = 0) -> Path:
    """A Silero-VAD-like model: ``input`` [batch, samples] audio, ``sr`` an int64 scalar sample rate, ``state``
    [2, batch, 128]; an ``If`` on ``sr == 16000`` picks a branch, each an STFT done as ``Pad`` (reflect, 64 samples
    each side) + a strided ``Conv`` over a basis, then two Conv + Relu encoder layers with biases and a state
    update. Random inputs run neither branch: a short audio axis cannot be reflect-padded, so a check or verify
    needs ``--input`` / ``--dim``. Weights embedded (about 1.3 MiB), as the exporter writes them."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(seed)

    def branch(tag: str, bins: int, window: int) -> onnx.GraphProto:
        inits = [
            nh.from_array(np.array([0, 0, window // 4, 0, 0, window // 4], np.int64), f"{tag}.pads"),
            nh.from_array(_arr(rng, (bins, 1, window), 0.05), f"{tag}.stft_basis"),
            nh.from_array(_arr(rng, (128, bins, 3), 0.05), f"{tag}.enc0.weight"),
            nh.from_array(_arr(rng, (128,), 0.01), f"{tag}.enc0.bias"),
            nh.from_array(_arr(rng, (128, 128, 3), 0.05), f"{tag}.enc1.weight"),
            nh.from_array(_arr(rng, (128,), 0.01), f"{tag}.enc1.bias"),
            nh.from_array(_arr(rng, (128, 1), 0.05), f"{tag}.out.weight"),
            nh.from_array(np.array([1], np.int64), f"{tag}.axis1"),
        ]
        nodes = [
            h.make_node("Unsqueeze", ["input", f"{tag}.axis1"], [f"{tag}.x"]),
            h.make_node("Pad", [f"{tag}.x", f"{tag}.pads"], [f"{tag}.padded"], mode="reflect"),
            h.make_node("Conv", [f"{tag}.padded", f"{tag}.stft_basis"], [f"{tag}.spec"], strides=[window // 2]),
            h.make_node("Abs", [f"{tag}.spec"], [f"{tag}.mag"]),
            h.make_node("Conv", [f"{tag}.mag", f"{tag}.enc0.weight", f"{tag}.enc0.bias"], [f"{tag}.c0"], pads=[1, 1]),
            h.make_node("Relu", [f"{tag}.c0"], [f"{tag}.r0"]),
            h.make_node("Conv", [f"{tag}.r0", f"{tag}.enc1.weight", f"{tag}.enc1.bias"], [f"{tag}.c1"], pads=[1, 1]),
            h.make_node("Relu", [f"{tag}.c1"], [f"{tag}.r1"]),
            h.make_node("ReduceMean", [f"{tag}.r1"], [f"{tag}.pooled"], axes=[2], keepdims=0),
            h.make_node("MatMul", [f"{tag}.pooled", f"{tag}.out.weight"], [f"{tag}.logit"]),
            h.make_node("Sigmoid", [f"{tag}.logit"], [f"{tag}.output"]),
            h.make_node("Unsqueeze", [f"{tag}.pooled", f"{tag}.axis0"], [f"{tag}.p3"]),
            h.make_node("Add", ["state", f"{tag}.p3"], [f"{tag}.state"]),
        ]
        inits.append(nh.from_array(np.array([0], np.int64), f"{tag}.axis0"))
        outs = [_io(f"{tag}.output", T.FLOAT, None), _io(f"{tag}.state", T.FLOAT, None)]
        return h.make_graph(nodes, tag, [], outs, inits)

    nodes = [
        h.make_node("Equal", ["sr", "sr16k"], ["is16k"]),
        h.make_node(
            "If",
            ["is16k"],
            ["output", "stateN"],
            then_branch=branch("b16k", 130, 256),
            else_branch=branch("b8k", 66, 128),
        ),
    ]
    inits = [nh.from_array(np.array(16000, np.int64), "sr16k")]
    inputs = [
        _io("input", T.FLOAT, ["batch", "samples"]),
        _io("sr", T.INT64, []),
        _io("state", T.FLOAT, [2, "batch", 128]),
    ]
    outputs = [_io("output", T.FLOAT, ["batch", 1]), _io("stateN", T.FLOAT, [2, "batch", 128])]
    return _save(_model(nodes, inits, inputs, outputs), path, external=False)


def tied_head(path: Path, vocab: int = 4096, hidden: int = 256, seed: int = 0, reshaped: bool = False) -> Path:
    """onnxruntime-genai's model builder for a float model with tied embeddings (Gemma2 fp32): one
    ``lm_head.MatMul.weight`` [hidden, vocab] read by the lm_head MatMul and, through ``/model/embed_tokens/
    Transpose`` (perm 1, 0), by the embedding Gather (``make_embedding_lookup``'s "Tied float" path). ONNX Runtime
    constant-folds that Transpose into a [vocab, hidden] heap tensor in every session. Shape constants as the
    exporters name them (``onnx::Reshape_288``, ``/model/constants/INT64/[-1]``); ``reshaped``: a projection
    weight stored [1, hidden, hidden] and read through a constant ``Reshape`` (another shape-only op of a
    weight). External data beside the model, as the builder writes it."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(seed)
    inits = [
        nh.from_array(_arr(rng, (hidden, vocab), hidden**-0.5), "lm_head.MatMul.weight"),
        nh.from_array(np.array([-1, hidden], np.int64), "onnx::Reshape_288"),
        nh.from_array(np.array([-1], np.int64), "/model/constants/INT64/[-1]"),
        nh.from_array(_arr(rng, (hidden,), 0.1), "proj.bias"),
    ]
    nodes = [
        h.make_node("Transpose", ["lm_head.MatMul.weight"], ["/model/embed_tokens/Transpose/output_0"],
                    name="/model/embed_tokens/Transpose", perm=[1, 0]),
        h.make_node("Gather", ["/model/embed_tokens/Transpose/output_0", "input_ids"],
                    ["/model/embed_tokens/Gather/output_0"], name="/model/embed_tokens/Gather"),
        h.make_node("Reshape", ["/model/embed_tokens/Gather/output_0", "onnx::Reshape_288"], ["x2d"]),
    ]  # fmt: skip
    if reshaped:
        inits += [
            nh.from_array(_arr(rng, (1, hidden, hidden), hidden**-0.5), "proj.weight3d"),
            nh.from_array(np.array([hidden, hidden], np.int64), "proj.shape"),
        ]
        nodes.append(h.make_node("Reshape", ["proj.weight3d", "proj.shape"], ["proj.weight"]))
    else:
        inits.append(nh.from_array(_arr(rng, (hidden, hidden), hidden**-0.5), "proj.weight"))
    nodes += [
        h.make_node("MatMul", ["x2d", "proj.weight"], ["proj"]),
        h.make_node("Add", ["proj", "proj.bias"], ["proj_b"]),
        h.make_node("Relu", ["proj_b"], ["act"]),
        h.make_node("MatMul", ["act", "lm_head.MatMul.weight"], ["logits2d"], name="/lm_head/MatMul"),
        h.make_node("Unsqueeze", ["logits2d", "/model/constants/INT64/[-1]"], ["logits"]),
    ]
    inputs = [_io("input_ids", T.INT64, ["batch_size", "sequence_length"])]
    outputs = [_io("logits", T.FLOAT, ["tokens", vocab, 1])]
    model = _model(nodes, inits, inputs, outputs)
    model.graph.value_info.append(_io("/model/embed_tokens/Transpose/output_0", T.FLOAT, [vocab, hidden]))
    return _save(model, path, external=True)


FORMS: dict[str, Form] = {
    "fp32": Form(fp32_mlp, "fp32 MatMul+Add MLP"),
    "fp16": Form(fp16_transformer, "unfused fp16 BERT-like encoder, embedded"),
    "fp16_cast": Form(fp16_cast_mlp, "fp32 MLP with fp16 weights behind Cast(to=FLOAT)"),
    "matmulnbits4": Form(_nbits(4, 32, False, None), "MatMulNBits int4, block 32, zero points"),
    "matmulnbits4_sym_b128_acc4": Form(_nbits(4, 128, True, 4), "MatMulNBits int4, block 128, symmetric, accuracy 4"),
    "matmulnbits8": Form(_nbits(8, 32, False, None), "MatMulNBits int8, block 32, zero points"),
    "matmulnbits8_sym_b64_acc4": Form(_nbits(8, 64, True, 4), "MatMulNBits int8, block 64, symmetric, accuracy 4"),
    "matmulnbits4_gidx_bias": Form(matmulnbits_gidx_bias, "MatMulNBits int4 with zero points, g_idx and bias"),
    "qdq": Form(qdq_int8, "quantize_static QDQ int8"),
    "qdq_per_channel": Form(qdq_per_channel, "quantize_static QDQ, per-channel weights"),
    "dynamic": Form(dynamic_int8, "quantize_dynamic int8 (DynamicQuantizeMatMul at ORT_ENABLE_ALL), embedded"),
    "attention": Form(ms_attention, "com.microsoft Attention, packed QKV + bias"),
    "merged_decoder": Form(merged_decoder, "If(use_cache_branch) with outer-scope weights"),
    "conv": Form(conv_net, "ResNet/Inception-like CNN"),
    "llama": Form(_llama(False), "llama-like fp32 decoder: RMSNorm, rotary, mask from the inputs, SiLU MLP"),
    "llama_fp16": Form(_llama(True), "llama-like fp16 decoder (as llama, fp16 weights and activations)"),
}


def build(name: str, path: str | os.PathLike[str], mib: float = 2.0, seed: int = 0) -> Path:
    """Write form ``name`` (a key of ``FORMS``) to ``path``."""
    return FORMS[name].build(Path(path), mib, seed)


def feeds(
    model_path: str | os.PathLike[str],
    batch: int = 1,
    seq: int = 8,
    seed: int = 1,
    use_cache_branch: bool = True,
) -> dict[str, np.ndarray]:
    """Seeded inputs for any form: float/fp16 tensors with ``batch``/``seq`` for their named dims,
    the bool ``use_cache_branch`` as given (so a test can run both branches of a merged decoder)."""
    import numpy as np
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    rng = np.random.default_rng(seed)
    named = {"batch": batch, "seq": seq, "N": batch}
    out: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        shape = [named.get(d.dim_param, 1) if d.dim_param else d.dim_value for d in tt.shape.dim]
        if tt.elem_type == onnx.TensorProto.BOOL:
            out[vi.name] = np.full(shape, use_cache_branch, dtype=bool)
        elif vi.name == "position_ids":
            out[vi.name] = np.broadcast_to(np.arange(shape[-1], dtype=np.int64), shape).copy()
        elif vi.name == "attention_mask":  # the last position of each row but the first masked out
            out[vi.name] = np.ones(shape, np.int64)
            out[vi.name][1:, -1] = 0
        else:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
            out[vi.name] = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    return out
