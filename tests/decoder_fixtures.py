"""Small decoder exports built with onnx helpers: optimum-style decoder_with_past / merged (If on use_cache_branch),
onnxruntime-genai GroupQueryAttention with RotaryEmbedding (llama-like), a t5-like encoder / decoder /
decoder_with_past trio with cross-attention past, and a BERT with com.microsoft EmbedLayerNormalization.

Attention in plain ops: Q/K/V projections reshaped to [batch, heads, seq, head_size], K/V concatenated after the
past, softmax(Q K^T + (mask - 1) * 1e4) V, so the mask's length must equal past + new tokens (ORT checks the
broadcast). Every model's past inputs can carry symbolic head dims (``heads_dim`` / ``size_dim``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

VOCAB = 64


def _vi(name, elem, shape):
    return h.make_tensor_value_info(name, elem, shape)


def _save(nodes, name, inputs, outputs, inits, path, ms=False):
    graph = h.make_graph(nodes, name, inputs, outputs, [numpy_helper.from_array(a, n) for n, a in inits.items()])
    opsets = [h.make_opsetid("", 17)] + ([h.make_opsetid("com.microsoft", 1)] if ms else [])
    model = h.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.save(model, str(path))
    return Path(path)


def _weights(rng, hidden, heads, size, prefix=""):
    w = {
        f"{prefix}Wq": rng.standard_normal((hidden, heads * size)),
        f"{prefix}Wk": rng.standard_normal((hidden, heads * size)),
        f"{prefix}Wv": rng.standard_normal((hidden, heads * size)),
    }
    return {k: (v / np.sqrt(hidden)).astype(np.float32) for k, v in w.items()}


def _heads(x, out, heads, size, tag):
    """[batch, seq, heads*size] -> [batch, heads, seq, size]."""
    return [
        h.make_node("Reshape", [x, "split_heads"], [f"{tag}_r"]),
        h.make_node("Transpose", [f"{tag}_r"], [out], perm=[0, 2, 1, 3]),
    ]


def _attend(q4, k4, v4, mask, out, tag):
    """softmax(q k^T / sqrt(d) + (mask - 1) * 1e4) v, merged back to [batch, seq, heads*size]."""
    return [
        h.make_node("Transpose", [k4], [f"{tag}_kt"], perm=[0, 1, 3, 2]),
        h.make_node("MatMul", [q4, f"{tag}_kt"], [f"{tag}_s"]),
        h.make_node("Mul", [f"{tag}_s", "scale"], [f"{tag}_ss"]),
        h.make_node("Cast", [mask], [f"{tag}_mf"], to=T.FLOAT),
        h.make_node("Unsqueeze", [f"{tag}_mf", "axes12"], [f"{tag}_m4"]),
        h.make_node("Sub", [f"{tag}_m4", "onef"], [f"{tag}_m1"]),
        h.make_node("Mul", [f"{tag}_m1", "big"], [f"{tag}_bias"]),
        h.make_node("Add", [f"{tag}_ss", f"{tag}_bias"], [f"{tag}_sb"]),
        h.make_node("Softmax", [f"{tag}_sb"], [f"{tag}_p"], axis=-1),
        h.make_node("MatMul", [f"{tag}_p", v4], [f"{tag}_o"]),
        h.make_node("Transpose", [f"{tag}_o"], [f"{tag}_ot"], perm=[0, 2, 1, 3]),
        h.make_node("Reshape", [f"{tag}_ot", "merge_heads"], [out]),
    ]


def _consts(heads, size):
    return {
        "split_heads": np.array([0, 0, heads, size], np.int64),
        "merge_heads": np.array([0, 0, heads * size], np.int64),
        "axes12": np.array([1, 2], np.int64),
        "onef": np.array(1, np.float32),
        "big": np.array(1e4, np.float32),
        "scale": np.array(1 / np.sqrt(size), np.float32),
    }


def _kv_shape(heads_dim, size_dim, seq):
    return ["batch_size", heads_dim, seq, size_dim]


def decoder_with_past(path, heads=2, size=8, heads_dim=None, size_dim=None, merged=False, seed=0):
    """optimum's decoder_with_past_model.onnx (or, ``merged``, decoder_model_merged.onnx: ``If`` on
    use_cache_branch, the cache branch concatenating the past and adding a small inline bias to the keys)."""
    rng = np.random.default_rng(seed)
    hidden = 16
    inits = {
        "E": rng.standard_normal((VOCAB, hidden)).astype(np.float32),
        **_weights(rng, hidden, heads, size),
        "Wo": (rng.standard_normal((heads * size, VOCAB)) / 4).astype(np.float32),
        **_consts(heads, size),
    }
    nodes = [
        h.make_node("Gather", ["E", "input_ids"], ["x"]),
        h.make_node("MatMul", ["x", "Wq"], ["q"]),
        h.make_node("MatMul", ["x", "Wk"], ["k"]),
        h.make_node("MatMul", ["x", "Wv"], ["v"]),
        *_heads("q", "q4", heads, size, "q"),
        *_heads("k", "k4", heads, size, "k"),
        *_heads("v", "v4", heads, size, "v"),
    ]
    if merged:
        inits["cache_bias"] = np.zeros(size, np.float32)  # 32 bytes: stays inline in the converted model
        cache = h.make_graph(
            [
                h.make_node("Concat", ["past_key_values.0.key", "k4"], ["kc"], axis=2),
                h.make_node("Add", ["kc", "cache_bias"], ["kb"]),
                h.make_node("Concat", ["past_key_values.0.value", "v4"], ["vb"], axis=2),
            ],
            "with_past",
            [],
            [_vi("kb", T.FLOAT, None), _vi("vb", T.FLOAT, None)],
        )
        fresh = h.make_graph(
            [h.make_node("Identity", ["k4"], ["kn"]), h.make_node("Identity", ["v4"], ["vn"])],
            "without_past",
            [],
            [_vi("kn", T.FLOAT, None), _vi("vn", T.FLOAT, None)],
        )
        nodes.append(
            h.make_node(
                "If", ["use_cache_branch"], ["present.0.key", "present.0.value"], then_branch=cache, else_branch=fresh
            )
        )
    else:
        nodes += [
            h.make_node("Concat", ["past_key_values.0.key", "k4"], ["present.0.key"], axis=2),
            h.make_node("Concat", ["past_key_values.0.value", "v4"], ["present.0.value"], axis=2),
        ]
    nodes += [
        *_attend("q4", "present.0.key", "present.0.value", "attention_mask", "o", "a"),
        h.make_node("MatMul", ["o", "Wo"], ["logits"]),
    ]
    total = "past_sequence_length + sequence_length"
    kv_in = _kv_shape(heads_dim or heads, size_dim or size, "past_sequence_length")
    inputs = [
        _vi("input_ids", T.INT64, ["batch_size", "sequence_length"]),
        _vi("attention_mask", T.INT64, ["batch_size", total]),
        _vi("past_key_values.0.key", T.FLOAT, kv_in),
        _vi("past_key_values.0.value", T.FLOAT, kv_in),
    ] + ([_vi("use_cache_branch", T.BOOL, [1])] if merged else [])
    kv_out = _kv_shape(heads_dim or heads, size_dim or size, total)
    outputs = [
        _vi("logits", T.FLOAT, ["batch_size", "sequence_length", VOCAB]),
        _vi("present.0.key", T.FLOAT, kv_out),
        _vi("present.0.value", T.FLOAT, kv_out),
    ]
    return _save(nodes, "decoder", inputs, outputs, inits, path)


def llama_like(path, heads=4, kv_heads=2, size=8, genai_config=True, lengths_as_inputs=False, seed=0):
    """onnxruntime-genai's llama export in miniature: RotaryEmbedding (com.microsoft) on Q and K from position_ids,
    GroupQueryAttention with seqlens_k / total_sequence_length made in-graph from attention_mask (or, with
    ``lengths_as_inputs``, graph inputs checked against the mask in-graph), past_key_values with symbolic head
    dims, SimplifiedLayerNormalization, genai_config.json beside it."""
    rng = np.random.default_rng(seed)
    hidden, max_len = 32, 64
    pos = np.arange(max_len)[:, None] / (10000 ** (np.arange(0, size, 2) / size))[None, :]
    inits = {
        "E": rng.standard_normal((VOCAB, hidden)).astype(np.float32),
        "gamma": np.ones(hidden, np.float32),
        "Wq": (rng.standard_normal((hidden, heads * size)) / 6).astype(np.float32),
        "Wk": (rng.standard_normal((hidden, kv_heads * size)) / 6).astype(np.float32),
        "Wv": (rng.standard_normal((hidden, kv_heads * size)) / 6).astype(np.float32),
        "Wo": (rng.standard_normal((heads * size, VOCAB)) / 6).astype(np.float32),
        "cos_cache": np.cos(pos).astype(np.float32),
        "sin_cache": np.sin(pos).astype(np.float32),
        "one": np.array([1], np.int64),
    }
    nodes = [
        h.make_node("Gather", ["E", "input_ids"], ["x0"]),
        h.make_node("SimplifiedLayerNormalization", ["x0", "gamma"], ["x"], axis=-1, epsilon=1e-5),
        h.make_node("MatMul", ["x", "Wq"], ["q0"]),
        h.make_node("MatMul", ["x", "Wk"], ["k0"]),
        h.make_node("MatMul", ["x", "Wv"], ["v"]),
        h.make_node("RotaryEmbedding", ["q0", "position_ids", "cos_cache", "sin_cache"], ["q"], domain="com.microsoft"),
        h.make_node("RotaryEmbedding", ["k0", "position_ids", "cos_cache", "sin_cache"], ["k"], domain="com.microsoft"),
        h.make_node("ReduceSum", ["attention_mask", "one"], ["s"], keepdims=0),
        h.make_node("Sub", ["s", "one"], ["s1"]),
        h.make_node("Cast", ["s1"], ["seqlens_k_mask"], to=T.INT32),
        h.make_node("Shape", ["attention_mask"], ["ms"]),
        h.make_node("Gather", ["ms", "one"], ["tl"], axis=0),
        h.make_node("Cast", ["tl"], ["total_mask"], to=T.INT32),
    ]
    if lengths_as_inputs:  # Reshape to [seqlens_k - seqlens_k_mask + 1]: fails unless the inputs agree with the mask
        inits["one32"] = np.array([1], np.int32)
        inits["total_shape"] = np.array([1], np.int64)
        for given, made in (("seqlens_k", "seqlens_k_mask"), ("total_sequence_length", "total_mask")):
            nodes += [
                h.make_node("Sub", [given, made], [f"{given}_d"]),
                h.make_node("Add", [f"{given}_d", "one32"], [f"{given}_d1"]),
                h.make_node("Cast", [f"{given}_d1"], [f"{given}_d64"], to=T.INT64),
                h.make_node("Reshape", [f"{given}_d64", "total_shape"], [f"{given}_v"]),
                h.make_node("Reshape", ["one", f"{given}_v"], [f"{given}_ok"]),  # a 1-element tensor to [d + 1]
            ]
    else:
        nodes += [
            h.make_node("Identity", ["seqlens_k_mask"], ["seqlens_k"]),
            h.make_node("Identity", ["total_mask"], ["total_sequence_length"]),
        ]
    nodes += [
        h.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "past_key_values.0.key", "past_key_values.0.value", "seqlens_k", "total_sequence_length"],
            ["o", "present.0.key", "present.0.value"],
            domain="com.microsoft",
            num_heads=heads,
            kv_num_heads=kv_heads,
        ),
        h.make_node("MatMul", ["o", "Wo"], ["logits"]),
    ]
    kv_in = ["batch_size", "num_key_value_heads", "past_sequence_length", "head_size"]
    kv_out = ["batch_size", "num_key_value_heads", "total_sequence_length", "head_size"]
    inputs = [
        _vi("input_ids", T.INT64, ["batch_size", "sequence_length"]),
        _vi("attention_mask", T.INT64, ["batch_size", "total_sequence_length"]),
        _vi("position_ids", T.INT64, ["batch_size", "sequence_length"]),
        _vi("past_key_values.0.key", T.FLOAT, kv_in),
        _vi("past_key_values.0.value", T.FLOAT, kv_in),
    ]
    outputs = [
        _vi("logits", T.FLOAT, ["batch_size", "sequence_length", VOCAB]),
        _vi("present.0.key", T.FLOAT, kv_out),
        _vi("present.0.value", T.FLOAT, kv_out),
    ]
    if lengths_as_inputs:
        inputs += [_vi("seqlens_k", T.INT32, ["batch_size"]), _vi("total_sequence_length", T.INT32, [])]
        outputs += [_vi(f"{n}_ok", T.INT64, [1]) for n in ("seqlens_k", "total_sequence_length")]
    out = _save(nodes, "llama", inputs, outputs, inits, path, ms=True)
    if genai_config:
        decoder = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_size": size}
        config = {"model": {"vocab_size": VOCAB, "decoder": {**decoder, "hidden_size": hidden, "num_hidden_layers": 1}}}
        (out.parent / "genai_config.json").write_text(json.dumps(config))
    return out


def t5_like(directory, heads=2, size=8, seed=0):
    """optimum's t5 export in miniature: encoder_model.onnx, decoder_model.onnx (self- and cross-attention,
    present.0.decoder.* and present.0.encoder.*) and decoder_with_past_model.onnx (cross-attention K/V from
    past_key_values.0.encoder.*, only the decoder presents out); past head dims symbolic, t5's config.json beside
    (num_heads, d_kv, d_model)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hidden = heads * size
    enc = {
        "E": rng.standard_normal((VOCAB, hidden)).astype(np.float32),
        "We": (rng.standard_normal((hidden, hidden)) / 4).astype(np.float32),
        "ax2": np.array([2], np.int64),
    }
    _save(
        [
            h.make_node("Gather", ["E", "input_ids"], ["x"]),
            h.make_node("MatMul", ["x", "We"], ["hs"]),
            h.make_node("Cast", ["attention_mask"], ["mf"], to=T.FLOAT),
            h.make_node("Unsqueeze", ["mf", "ax2"], ["m3"]),
            h.make_node("Mul", ["hs", "m3"], ["last_hidden_state"]),
        ],
        "encoder",
        [
            _vi("input_ids", T.INT64, ["batch_size", "encoder_sequence_length"]),
            _vi("attention_mask", T.INT64, ["batch_size", "encoder_sequence_length"]),
        ],
        [_vi("last_hidden_state", T.FLOAT, ["batch_size", "encoder_sequence_length", hidden])],
        enc,
        d / "encoder_model.onnx",
    )
    inits = {
        "E": enc["E"],
        **_weights(rng, hidden, heads, size),
        **_weights(rng, hidden, heads, size, prefix="c"),
        "Wo": (rng.standard_normal((hidden, VOCAB)) / 4).astype(np.float32),
        **_consts(heads, size),
        "ones_dec": np.array([1], np.int64),
    }
    head = [
        h.make_node("Gather", ["E", "input_ids"], ["x"]),
        h.make_node("MatMul", ["x", "Wq"], ["q"]),
        h.make_node("MatMul", ["x", "Wk"], ["k"]),
        h.make_node("MatMul", ["x", "Wv"], ["v"]),
        *_heads("q", "q4", heads, size, "q"),
        *_heads("k", "k4", heads, size, "k"),
        *_heads("v", "v4", heads, size, "v"),
        # the decoder attends to all its own tokens: a mask of ones as long as its keys
        h.make_node("Shape", ["sk"], ["sk_shape"], start=2, end=3),
        h.make_node("Expand", ["ones_dec", "sk_shape"], ["self_mask1"]),
        h.make_node("Unsqueeze", ["self_mask1", "zero_ax"], ["self_mask"]),
        *_attend("q4", "sk", "sv", "self_mask", "so", "self"),
        h.make_node("MatMul", ["so", "cWq"], ["cq"]),
        *_heads("cq", "cq4", heads, size, "cq"),
        *_attend("cq4", "ck", "cv", "encoder_attention_mask", "co", "cross"),
        h.make_node("Add", ["so", "co"], ["o"]),
        h.make_node("MatMul", ["o", "Wo"], ["logits"]),
    ]
    inits["zero_ax"] = np.array([0], np.int64)
    kv_dec = ["batch_size", "num_heads", "past_decoder_sequence_length", "d_kv"]
    kv_enc = ["batch_size", "num_heads", "encoder_sequence_length_out", "d_kv"]
    ids = _vi("input_ids", T.INT64, ["batch_size", "decoder_sequence_length"])
    emask = _vi("encoder_attention_mask", T.INT64, ["batch_size", "encoder_sequence_length"])
    logits = _vi("logits", T.FLOAT, ["batch_size", "decoder_sequence_length", VOCAB])
    present = ["batch_size", "num_heads", "past_decoder_sequence_length + 1", "d_kv"]
    # decoder_model.onnx: no past; cross K/V from encoder_hidden_states, all four presents out
    _save(
        [
            h.make_node("Identity", ["k4"], ["sk"]),
            h.make_node("Identity", ["v4"], ["sv"]),
            h.make_node("MatMul", ["encoder_hidden_states", "cWk"], ["ck0"]),
            h.make_node("MatMul", ["encoder_hidden_states", "cWv"], ["cv0"]),
            *_heads("ck0", "ck", heads, size, "ck"),
            *_heads("cv0", "cv", heads, size, "cv"),
            *head,
            h.make_node("Identity", ["sk"], ["present.0.decoder.key"]),
            h.make_node("Identity", ["sv"], ["present.0.decoder.value"]),
            h.make_node("Identity", ["ck"], ["present.0.encoder.key"]),
            h.make_node("Identity", ["cv"], ["present.0.encoder.value"]),
        ],
        "decoder",
        [ids, emask, _vi("encoder_hidden_states", T.FLOAT, ["batch_size", "encoder_sequence_length", "d_model"])],
        [logits]
        + [_vi(f"present.0.{w}.{kv}", T.FLOAT, None) for w in ("decoder", "encoder") for kv in ("key", "value")],
        inits,
        d / "decoder_model.onnx",
    )
    _save(
        [
            h.make_node("Concat", ["past_key_values.0.decoder.key", "k4"], ["sk"], axis=2),
            h.make_node("Concat", ["past_key_values.0.decoder.value", "v4"], ["sv"], axis=2),
            h.make_node("Identity", ["past_key_values.0.encoder.key"], ["ck"]),
            h.make_node("Identity", ["past_key_values.0.encoder.value"], ["cv"]),
            *head,
            h.make_node("Identity", ["sk"], ["present.0.decoder.key"]),
            h.make_node("Identity", ["sv"], ["present.0.decoder.value"]),
        ],
        "decoder_with_past",
        [
            ids,
            emask,
            _vi("past_key_values.0.decoder.key", T.FLOAT, kv_dec),
            _vi("past_key_values.0.decoder.value", T.FLOAT, kv_dec),
            _vi("past_key_values.0.encoder.key", T.FLOAT, kv_enc),
            _vi("past_key_values.0.encoder.value", T.FLOAT, kv_enc),
        ],
        [logits, _vi("present.0.decoder.key", T.FLOAT, present), _vi("present.0.decoder.value", T.FLOAT, present)],
        {k: v for k, v in inits.items() if k not in ("cWk", "cWv")},
        d / "decoder_with_past_model.onnx",
    )
    (d / "config.json").write_text(
        json.dumps({"model_type": "t5", "num_heads": heads, "d_kv": size, "d_model": hidden})
    )
    return [d / "encoder_model.onnx", d / "decoder_model.onnx", d / "decoder_with_past_model.onnx"]


def bert_embed_layernorm(path, seed=0):
    """What onnxruntime's transformer optimizer makes of BERT's embeddings: EmbedLayerNormalization (com.microsoft)
    over int32 input_ids / token_type_ids (2 segments) / attention_mask, then a projection."""
    rng = np.random.default_rng(seed)
    hidden, positions = 16, 32
    inits = {
        "word": rng.standard_normal((VOCAB, hidden)).astype(np.float32),
        "pos": rng.standard_normal((positions, hidden)).astype(np.float32),
        "seg": rng.standard_normal((2, hidden)).astype(np.float32),
        "gamma": np.ones(hidden, np.float32),
        "beta": np.zeros(hidden, np.float32),
        "W": rng.standard_normal((hidden, 8)).astype(np.float32),
    }
    nodes = [
        h.make_node(
            "EmbedLayerNormalization",
            ["input_ids", "token_type_ids", "word", "pos", "seg", "gamma", "beta", "attention_mask"],
            ["emb", "mask_index"],
            domain="com.microsoft",
            epsilon=1e-12,
        ),
        h.make_node("MatMul", ["emb", "W"], ["last_hidden_state"]),
    ]
    seq = ["batch_size", "sequence_length"]
    inputs = [_vi(n, T.INT32, seq) for n in ("input_ids", "token_type_ids", "attention_mask")]
    outputs = [
        _vi("last_hidden_state", T.FLOAT, [*seq, 8]),
        _vi("mask_index", T.INT32, ["batch_size"]),
    ]
    return _save(nodes, "bert", inputs, outputs, inits, path, ms=True)
