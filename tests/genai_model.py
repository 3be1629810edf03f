"""An onnxruntime-genai model folder, built in code: what genai's model builder writes for a llama-like decoder.

``genai_config.json`` plus ``model.onnx`` / ``model.onnx.data``: token embedding (Gather), then per layer
SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization, Q/K/V/O and gate/up/down projections as
MatMulNBits (int4, block 32, symmetric, accuracy level 4, the builder's ``-p int4 -e cpu`` defaults) or fp32 MatMul,
com.microsoft GroupQueryAttention with in-graph rotary embedding (``do_rotary``, cos/sin caches), the attention
mask turned into ``seqlens_k`` / ``total_sequence_length`` in the graph, and an int4 lm_head. Weights are seeded
random numbers (no checkpoint is downloaded), so generated tokens are arbitrary but deterministic. No tokenizer:
``og.Generator.append_tokens`` takes token ids. Used by the genai tests and ``scripts/bench_genai.py``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import onnx

MiB = 1 << 20
BLOCK = 32


def _sizes(mib: float) -> dict[str, int]:
    """Decoder dimensions whose weights take about ``mib`` MiB (int4): hidden 64 for test folders below 4 MiB;
    from 4 to 16 MiB what the model builder writes for a small Llama (hidden 512, fused QKV projection into
    GroupQueryAttention, 2-D scales: ``fused``), every MatMulNBits buffer below 1 MiB; hidden 2048 from 16 MiB on."""
    if mib < 4:
        return {"hidden": 64, "heads": 4, "kv_heads": 2, "inter": 128, "vocab": 256, "layers": 2}
    if mib < 16:
        # per layer: qkv 512x768, o 512x512, gate/up 512x1536, down 1536x512 at 0.625 bytes a weight; fp32 embedding
        layers = max(2, round((mib * MiB - 2048 * 512 * (4 + 0.625)) / (4_194_304 * 0.625)))
        return {"hidden": 512, "heads": 8, "kv_heads": 2, "inter": 1536, "vocab": 2048, "layers": layers, "fused": 1}
    hidden, inter, vocab = 2048, 5632, 4096
    # int4 + an fp32 scale per block of 32: 0.625 bytes a weight; fp32 embedding
    per_layer = (hidden * hidden * 2 + hidden * hidden // 2 + 3 * hidden * inter) * (0.5 + 4 / BLOCK)
    fixed = vocab * hidden * 4 + vocab * hidden * (0.5 + 4 / BLOCK)
    layers = max(1, math.ceil((mib * MiB - fixed) / per_layer))
    return {"hidden": hidden, "heads": 32, "kv_heads": 8, "inter": inter, "vocab": vocab, "layers": layers}


def _nbits(
    rng: np.random.Generator, k: int, n: int, name: str, scales_2d: bool = False
) -> tuple[list[onnx.TensorProto], dict[str, Any]]:
    """Random int4 weights of a [k, n] MatMulNBits (symmetric: no zero points); ``scales_2d``: [n, blocks] scales,
    as the model builder writes them."""
    import numpy as np
    from onnx import numpy_helper as nh

    blocks = k // BLOCK
    qw = rng.integers(0, 256, (n, blocks, BLOCK // 2), dtype=np.uint8)
    scales = (rng.random((n, blocks), dtype=np.float32) * 0.5 + 0.5) * np.float32(0.25 / math.sqrt(k))
    attrs = {"K": k, "N": n, "bits": 4, "block_size": BLOCK, "accuracy_level": 4}
    scales = scales if scales_2d else scales.reshape(-1)
    return [nh.from_array(qw, f"{name}.qweight"), nh.from_array(scales, f"{name}.scales")], attrs


def build_decoder(
    path: Path, mib: float = 2.0, seed: int = 0, int4: bool = True, window: int = 0
) -> tuple[onnx.ModelProto, dict[str, int]]:
    """``window``: sliding-window attention on every other layer from the first, as the model builder writes
    Gemma2 for ``-e cpu`` (``window_kv_cache``): GroupQueryAttention with ``local_window_size`` and
    ``sliding_window_cache=1``, its past / present a window-sized buffer named ``past_sliding_length`` /
    ``total_sliding_length`` (the builder's ``make_key_value_cache_shape``)."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    s = _sizes(mib)
    hidden, heads, kv, inter, vocab = s["hidden"], s["heads"], s["kv_heads"], s["inter"], s["vocab"]
    fused = bool(s.get("fused"))
    hd = hidden // heads
    max_len = 256
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def linear(x: str, name: str, k: int, n: int) -> str:
        if int4:
            ts, attrs = _nbits(rng, k, n, name, fused)
            inits.extend(ts)
            nodes.append(
                h.make_node(
                    "MatMulNBits", [x, ts[0].name, ts[1].name], [name], name=name, domain="com.microsoft", **attrs
                )
            )
        else:
            w = (rng.standard_normal((k, n), dtype=np.float32) * np.float32(0.5 / math.sqrt(k))).astype(np.float32)
            inits.append(nh.from_array(w, f"{name}.weight"))
            nodes.append(h.make_node("MatMul", [x, f"{name}.weight"], [name], name=name))
        return name

    def gamma(name: str) -> str:
        inits.append(nh.from_array((1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32), name))
        return name

    inits.append(nh.from_array(rng.standard_normal((vocab, hidden), dtype=np.float32), "embed_tokens.weight"))
    pos = np.arange(max_len, dtype=np.float32)[:, None]
    inv = 1.0 / (10000.0 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    inits += [
        nh.from_array(np.cos(pos * inv).astype(np.float32), "cos_cache"),
        nh.from_array(np.sin(pos * inv).astype(np.float32), "sin_cache"),
        nh.from_array(np.array([1], np.int64), "one"),
    ]
    nodes += [
        h.make_node("Gather", ["embed_tokens.weight", "input_ids"], ["embed"], name="embed_tokens"),
        # the builder's attention-mask subgraph: seqlens_k = sum(mask) - 1, total_sequence_length = mask.shape[1]
        h.make_node("ReduceSum", ["attention_mask", "one"], ["mask_sum"], keepdims=0, name="mask_reduce"),
        h.make_node("Sub", ["mask_sum", "one"], ["mask_sub"], name="mask_sub"),
        h.make_node("Cast", ["mask_sub"], ["seqlens_k"], to=T.INT32, name="seqlens_cast"),
        h.make_node("Shape", ["attention_mask"], ["mask_shape"], name="mask_shape"),
        h.make_node("Gather", ["mask_shape", "one"], ["total_len64"], axis=0, name="total_gather"),
        h.make_node("Squeeze", ["total_len64"], ["total_len64s"], name="total_squeeze"),
        h.make_node("Cast", ["total_len64s"], ["total_sequence_length"], to=T.INT32, name="total_cast"),
    ]
    ln_attrs: dict[str, Any] = {"domain": "com.microsoft", "epsilon": 1e-5}
    x, residual = "embed", ""
    for i in range(s["layers"]):
        p = f"layers.{i}"
        if i == 0:
            nodes.append(
                h.make_node(
                    "SimplifiedLayerNormalization", [x, gamma(f"{p}.input_layernorm.weight")], [f"{p}.ln1"],
                    name=f"{p}.input_layernorm", axis=-1, epsilon=1e-5,
                )
            )  # fmt: skip
            residual = x
        else:
            nodes.append(
                h.make_node(
                    "SkipSimplifiedLayerNormalization", [x, residual, gamma(f"{p}.input_layernorm.weight")],
                    [f"{p}.ln1", "", "", f"{p}.res1"], name=f"{p}.input_layernorm", **ln_attrs,
                )
            )  # fmt: skip
            residual = f"{p}.res1"
        if fused:  # one projection into GroupQueryAttention's packed QKV input, key and value left empty
            q, k, v = linear(f"{p}.ln1", f"{p}.attn.qkv_proj", hidden, (heads + 2 * kv) * hd), "", ""
        else:
            q = linear(f"{p}.ln1", f"{p}.attn.q_proj", hidden, heads * hd)
            k = linear(f"{p}.ln1", f"{p}.attn.k_proj", hidden, kv * hd)
            v = linear(f"{p}.ln1", f"{p}.attn.v_proj", hidden, kv * hd)
        gqa_in = [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", "seqlens_k",
                  "total_sequence_length", "cos_cache", "sin_cache"]  # fmt: skip
        local = {"local_window_size": window, "sliding_window_cache": 1} if window and i % 2 == 0 else {}
        nodes.append(
            h.make_node(
                "GroupQueryAttention", gqa_in, [f"{p}.attn", f"present.{i}.key", f"present.{i}.value"],
                name=f"{p}.attn.gqa", domain="com.microsoft", num_heads=heads, kv_num_heads=kv,
                do_rotary=1, rotary_interleaved=0, scale=float(hd**-0.5), **local,
            )
        )  # fmt: skip
        o = linear(f"{p}.attn", f"{p}.attn.o_proj", heads * hd, hidden)
        nodes.append(
            h.make_node(
                "SkipSimplifiedLayerNormalization", [o, residual, gamma(f"{p}.post_attention_layernorm.weight")],
                [f"{p}.ln2", "", "", f"{p}.res2"], name=f"{p}.post_attention_layernorm", **ln_attrs,
            )
        )  # fmt: skip
        residual = f"{p}.res2"
        gate = linear(f"{p}.ln2", f"{p}.mlp.gate_proj", hidden, inter)
        up = linear(f"{p}.ln2", f"{p}.mlp.up_proj", hidden, inter)
        nodes += [
            h.make_node("Sigmoid", [gate], [f"{p}.mlp.sig"], name=f"{p}.mlp.act.sigmoid"),
            h.make_node("Mul", [gate, f"{p}.mlp.sig"], [f"{p}.mlp.silu"], name=f"{p}.mlp.act.mul"),
            h.make_node("Mul", [f"{p}.mlp.silu", up], [f"{p}.mlp.prod"], name=f"{p}.mlp.mul"),
        ]
        x = linear(f"{p}.mlp.prod", f"{p}.mlp.down_proj", inter, hidden)
    nodes.append(
        h.make_node(
            "SkipSimplifiedLayerNormalization", [x, residual, gamma("norm.weight")], ["final_norm", "", "", ""],
            name="norm", **ln_attrs,
        )
    )  # fmt: skip
    linear("final_norm", "logits", hidden, vocab)
    past: list[str | int] = ["batch_size", kv, "past_sequence_length", hd]
    present: list[str | int] = ["batch_size", kv, "total_sequence_length", hd]
    inputs = [
        h.make_tensor_value_info("input_ids", T.INT64, ["batch_size", "sequence_length"]),
        h.make_tensor_value_info("attention_mask", T.INT64, ["batch_size", "total_sequence_length"]),
    ]
    outputs = [h.make_tensor_value_info("logits", T.FLOAT, ["batch_size", "sequence_length", vocab])]
    for i in range(s["layers"]):
        sliding = bool(window) and i % 2 == 0
        p_i = [d.replace("sequence", "sliding") if sliding and isinstance(d, str) else d for d in past]
        q_i = [d.replace("sequence", "sliding") if sliding and isinstance(d, str) else d for d in present]
        inputs += [h.make_tensor_value_info(f"past_key_values.{i}.{t}", T.FLOAT, p_i) for t in ("key", "value")]
        outputs += [h.make_tensor_value_info(f"present.{i}.{t}", T.FLOAT, q_i) for t in ("key", "value")]
    graph = h.make_graph(nodes, "main_graph", inputs, outputs, inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model, {**s, "head_size": hd, "context_length": max_len}


def genai_config(s: dict[str, int], filename: str = "model.onnx") -> dict[str, Any]:
    """genai_config.json as the model builder writes it for ``-e cpu`` (GroupQueryAttention: shared past/present
    buffer)."""
    return {
        "model": {
            "bos_token_id": 1,
            "context_length": s["context_length"],
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": s["head_size"],
                "hidden_size": s["hidden"],
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": s["heads"],
                "num_hidden_layers": s["layers"],
                "num_key_value_heads": s["kv_heads"],
            },
            "eos_token_id": 2,
            "pad_token_id": 0,
            "type": "llama",
            "vocab_size": s["vocab"],
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": s["context_length"],
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def genai_folder(
    directory: str | os.PathLike[str], mib: float = 2.0, seed: int = 0, int4: bool = True, window: int = 0
) -> Path:
    """Write a genai folder (``genai_config.json``, ``model.onnx``, ``model.onnx.data``) to ``directory``
    (``window``: sliding-window layers, see ``build_decoder``)."""
    import onnx

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model, sizes = build_decoder(d / "model.onnx", mib, seed, int4, window)
    (d / "model.onnx.data").unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(model, str(d / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
                    size_threshold=1024)  # fmt: skip
    (d / "genai_config.json").write_text(json.dumps(genai_config(sizes), indent=4) + "\n")
    return d


def generate(
    folder: str | os.PathLike[str] | Any, prompt: list[int], new_tokens: int = 8
) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens onnxruntime-genai generates from ``folder`` (a path or an ``og.Model``) after ``prompt``
    (token ids, no tokenizer), and the logits of every step."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(folder)) if isinstance(folder, (str, os.PathLike)) else folder
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(prompt, dtype=np.int32))
    logits = [np.array(gen.get_logits())]
    while not gen.is_done():
        gen.generate_next_token()
        if not gen.is_done():
            gen_logits = np.array(gen.get_logits())
            logits.append(gen_logits)
    return [int(t) for t in gen.get_sequence(0)], logits
