"""Inputs for ONNX decoders, read from the model, and ``verify --decode-steps N``.

What a decoder needs is read from the model itself, then from the configs exporters write beside it:

- head counts and head size from the attention ops' attributes (``GroupQueryAttention`` num_heads / kv_num_heads,
  ``MultiHeadAttention`` / ``Attention`` num_heads) and the width of the projection feeding their query (a weight's
  shape), else ``genai_config.json`` (model.decoder.num_attention_heads, num_key_value_heads, head_size,
  hidden_size) or optimum's / transformers' ``config.json`` (num_attention_heads / n_head / num_heads,
  num_key_value_heads, head_dim / d_kv, hidden_size / n_embd / d_model);
- the hidden size of an input such as ``encoder_hidden_states`` from the weight of the MatMul that consumes it;
- the exclusive bound of every integer input that reaches an index (``indices.py``: through casts, reshapes and
  offsets): token ids below the embedding's rows (Gather, GatherBlockQuantized, EmbedLayerNormalization, a
  DequantizeLinear's rows; else the logits' width), segment ids below the segment embedding's rows, position ids
  below the rotary cache's.

A decode loop runs a prefill step (self-attention past length 0, ``use_cache_branch`` false) and then feeds every
``present*`` output back as the matching ``past*`` input, one token at a time, the next token being the argmax of
the logits; attention masks, position ids, ``seqlens_k`` and ``total_sequence_length`` grow with it. Both models
get the same inputs at every step (made from the original's outputs), so each step's outputs are compared alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._runtimes.ort import ORT_TYPES

if TYPE_CHECKING:
    import onnx

_ATTENTION = {"GroupQueryAttention", "MultiHeadAttention", "Attention", "DecoderMaskedMultiHeadAttention"}
# ops whose output has the last dim of their first input (what a projection's width passes through)
_SAME_WIDTH = {"Add", "Mul", "RotaryEmbedding", "Cast", "Identity", "Relu", "Gelu", "FastGelu", "Sub", "Div"}
_CONFIG_KEYS = {  # fact -> keys in genai_config.json's model.decoder, then in config.json
    "heads": (("num_attention_heads",), ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")),
    "kv_heads": (("num_key_value_heads",), ("num_key_value_heads", "n_head_kv")),
    "head_size": (("head_size",), ("head_dim", "d_kv", "kv_channels")),
    "hidden": (("hidden_size",), ("hidden_size", "n_embd", "d_model")),
}


@dataclass
class ModelFacts:
    """What the graph (and the configs beside it) say about a decoder's inputs; None where nothing says."""

    heads: int | None = None
    kv_heads: int | None = None
    head_size: int | None = None
    hidden: int | None = None
    vocab: int | None = None
    bounds: dict[str, int | None] = field(default_factory=dict)  # index input -> exclusive bound
    hidden_of: dict[str, int] = field(default_factory=dict)  # input -> last dim, from the weight consuming it
    sources: list[str] = field(default_factory=list)
    # from config.json only (what optimum / transformers write beside a vision or audio export)
    image: tuple[int, int] | None = None  # image_size: (height, width)
    channels: int | None = None  # num_channels
    mel_bins: int | None = None  # num_mel_bins (Whisper's input_features [batch, mel bins, frames])
    frames: int | None = None  # 2 * max_source_positions (Whisper's encoder takes exactly that many frames)
    capped: list[str] = field(default_factory=list)  # config sizes ignored for being above their cap
    # GroupQueryAttention's local_window_size (sliding-window attention): a window-sized KV cache
    # (``sliding_window_cache``, genai's Gemma2) refuses a past shorter than the window
    window: int = 0


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    out = [graph]
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("g"):
                out += _graphs(a.g)
            for g in a.graphs:
                out += _graphs(g)
    return out


def _attr(node: onnx.NodeProto, name: str) -> int | None:
    return next((int(a.i) for a in node.attribute if a.name == name), None)


def _config(path: Path) -> dict[str, Any]:
    """A small JSON config beside the model, or {} (absent, unreadable, oversized or not an object)."""
    try:
        if not path.is_file() or path.stat().st_size > 4 << 20:
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


# What a config file may claim, at most, for a size the graph does not state (docs/reliability.md): a config.json
# beside the model is as untrusted as the model, and these sizes become the shapes of generated inputs (a
# hidden_size of 5e7 made verify allocate 1.7 GB). The largest real models stay well below: hidden 18,432
# (the largest public dense decoders), 128 heads, head size 256, a vocabulary of 262,144.
# An image side of 8,192 (real vision encoders: 224-1,024), 64 channels, 1,024 mel bins (80-128), 2 * 16,384 audio
# frames (Whisper: 2 * 1,500): one generated image of 3 x 8,192 x 8,192 fp32 is 768 MiB, within verify's budget.
CONFIG_CAPS = {
    "heads": 1024,
    "kv_heads": 1024,
    "head_size": 4096,
    "hidden": 1 << 16,
    "vocab": 1 << 22,
    "image": 8192,
    "channels": 64,
    "mel_bins": 1024,
    "source_positions": 1 << 14,
}


def config_size(fact: str, value: object) -> int | None:
    """A size a config file claims for ``fact`` (a key of ``CONFIG_CAPS``), or None when it is no positive integer
    or above its cap (then nothing is taken from the config for it)."""
    size = _positive(value)
    return size if size is not None and size <= CONFIG_CAPS.get(fact, 1 << 16) else None


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read_facts(path: Path) -> ModelFacts:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    for g in _graphs(model.graph):  # inference needs weights' shapes, not their bytes (small constants stay)
        for t in g.initializer:
            if len(t.raw_data) > 4096:
                t.ClearField("raw_data")
    try:
        if model.ByteSize() > 1 << 30:
            raise ValueError("too large to infer")
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    except Exception:  # noqa: BLE001 -- inference is a hint: without it, weights' shapes are traced
        inferred = model.graph
    graphs = _graphs(inferred)
    shapes: dict[str, list[int | None]] = {}
    producer: dict[str, onnx.NodeProto] = {}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for g in graphs:
        for t in g.initializer:
            shapes[t.name] = list(t.dims)
        for vi in list(g.input) + list(g.value_info) + list(g.output):
            if vi.name not in shapes and vi.type.HasField("tensor_type"):
                shapes[vi.name] = [
                    d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim
                ]
        for node in g.node:
            for o in node.output:
                producer[o] = node
            for i, name in enumerate(node.input):
                consumers.setdefault(name, []).append((node, i))
    initializers = {t.name for g in graphs for t in g.initializer}
    inputs = {i.name for i in model.graph.input} - initializers
    facts = ModelFacts()

    def width(name: str, depth: int = 0) -> int | None:
        """The last dim of ``name``: inferred, else the width of the projection that made it."""
        shape = shapes.get(name)
        if shape and shape[-1]:
            return shape[-1]
        node = producer.get(name)
        if node is None or depth > 8:
            return None
        if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 and node.input[1] in initializers:
            w = shapes[node.input[1]]
            return (w[0] if node.op_type == "Gemm" and _attr(node, "transB") else w[-1]) if w else None
        if node.op_type == "MatMulNBits":
            return _attr(node, "N")
        if node.op_type in _SAME_WIDTH or node.op_type.endswith("LayerNormalization"):
            return width(node.input[0], depth + 1) if node.input else None
        return None

    for g in graphs:
        for node in g.node:
            if node.domain not in ("", "ai.onnx", "com.microsoft") or node.op_type not in _ATTENTION:
                continue
            if node.op_type == "GroupQueryAttention":
                facts.window = max(facts.window, _attr(node, "local_window_size") or 0)
            heads = _attr(node, "num_heads")
            if not heads:
                continue
            kv = _attr(node, "kv_num_heads") if node.op_type == "GroupQueryAttention" else heads
            facts.heads = facts.heads or heads
            facts.kv_heads = facts.kv_heads or kv
            size = None
            if node.op_type == "Attention" and len(node.input) > 1 and shapes.get(node.input[1]):
                w = shapes[node.input[1]]
                size = w[-1] // 3 // heads if w and w[-1] else None  # packed QKV weight [hidden, 3 * hidden]
            elif node.input:
                q = width(node.input[0])
                packed = len(node.input) < 2 or not node.input[1]  # query holds Q, K and V
                parts = heads + 2 * (kv or heads) if packed else heads
                size = q // parts if q and q % parts == 0 else None
            facts.head_size = facts.head_size or size
            if size:
                facts.sources.append(f"{node.op_type} {node.name or node.output[0]!r} attributes")
    for name in inputs:
        for node, i in consumers.get(name, []):
            if node.op_type == "MatMul" and i == 0 and node.input[1] in initializers:
                w = shapes[node.input[1]]
                if w and len(w) == 2 and w[0]:
                    facts.hidden_of[name] = w[0]
    from .indices import index_bounds

    # every integer input that reaches an index, directly or through casts, reshapes, offsets (indices.py)
    facts.bounds = index_bounds(inferred)
    for name, bound in facts.bounds.items():
        if "input_ids" in name.lower() and bound:
            facts.vocab = bound
    if facts.vocab is None:
        for out in model.graph.output:
            shape = shapes.get(out.name)
            if "logits" in out.name.lower() and shape and shape[-1]:
                facts.vocab = shape[-1]
    _facts_from_configs(facts, path.parent)
    if facts.kv_heads is None:
        facts.kv_heads = facts.heads
    if facts.head_size is None and facts.heads and facts.hidden and facts.hidden % facts.heads == 0:
        facts.head_size = facts.hidden // facts.heads
    return facts


def _facts_from_configs(facts: ModelFacts, directory: Path) -> None:
    genai = _config(directory / "genai_config.json")
    model: dict[str, Any] = genai["model"] if isinstance(genai.get("model"), dict) else {}
    decoder: dict[str, Any] = model["decoder"] if isinstance(model.get("decoder"), dict) else {}
    config = _config(directory / "config.json")
    for fact, (genai_keys, config_keys) in _CONFIG_KEYS.items():
        if getattr(facts, fact) is not None:
            continue
        for source, data, keys in (("genai_config.json", decoder, genai_keys), ("config.json", config, config_keys)):
            value = next((config_size(fact, data.get(k)) for k in keys if config_size(fact, data.get(k))), None)
            for k in keys:
                if value is None and _positive(data.get(k)):
                    facts.capped.append(f"{source} {k}={data[k]} ignored (above the cap of {CONFIG_CAPS[fact]})")
            if value is not None:
                setattr(facts, fact, value)
                facts.sources.append(f"{source} ({fact})")
                break
    if facts.vocab is None:
        facts.vocab = config_size("vocab", model.get("vocab_size")) or config_size("vocab", config.get("vocab_size"))
    _media_from_config(facts, config)


def _claimed(facts: ModelFacts, fact: str, key: str, value: object) -> int | None:
    """``value`` of ``config.json``'s ``key`` when within ``fact``'s cap; a positive claim above it is recorded in
    ``facts.capped`` (verify and check say so) and ignored."""
    size = config_size(fact, value)
    if size is None and _positive(value):
        facts.capped.append(f"config.json {key}={value} ignored (above the cap of {CONFIG_CAPS[fact]})")
    return size


def _media_from_config(facts: ModelFacts, config: dict[str, Any]) -> None:
    """Image and audio input sizes from ``config.json`` (a ViT's ``image_size``, a Whisper's ``num_mel_bins`` and
    ``max_source_positions``; a CLIP/SigLIP config's ``vision_config``), each within its cap."""
    vision = config.get("vision_config")
    for data in (config, vision if isinstance(vision, dict) else {}):
        side = data.get("image_size")
        if facts.image is None:
            if isinstance(side, list) and len(side) == 2:
                h, w = (_claimed(facts, "image", "image_size", v) for v in side)
                facts.image = (h, w) if h and w else None
            elif side is not None:
                n = _claimed(facts, "image", "image_size", side)
                facts.image = (n, n) if n else None
        if facts.channels is None and "num_channels" in data:
            facts.channels = _claimed(facts, "channels", "num_channels", data["num_channels"])
    if "num_mel_bins" in config:
        facts.mel_bins = _claimed(facts, "mel_bins", "num_mel_bins", config["num_mel_bins"])
    if "max_source_positions" in config:
        n = _claimed(facts, "source_positions", "max_source_positions", config["max_source_positions"])
        facts.frames = 2 * n if n else None  # the encoder's stride-2 conv halves the frames into its positions
    for name, value in (("image", facts.image), ("mel_bins", facts.mel_bins), ("frames", facts.frames)):
        if value:
            facts.sources.append(f"config.json ({name})")


def past_key(name: str, prefixes: tuple[str, ...]) -> str | None:
    """``past_key_values.0.key`` / ``present.0.key`` -> ``0.key``: what ties a present output to its past input."""
    low = name.lower()
    for p in prefixes:
        if low.startswith(p):
            return low[len(p) :].lstrip("._") or None
    return None


def pairs(input_names: list[str], output_names: list[str]) -> dict[str, str]:
    """past input -> the present output that feeds it on the next step."""
    presents = {past_key(o, ("present_key_values", "present")): o for o in output_names}
    presents.pop(None, None)
    out = {}
    for name in input_names:
        key = past_key(name, ("past_key_values", "past"))
        if key is not None and key in presents:
            out[name] = presents[key]
    return out


def _past_axes(shape: list[Any]) -> tuple[int, int, int] | None:
    """(heads, sequence, head size) axes of a KV-cache input: [batch, heads, seq, size] or gpt2's [2, batch, ...]."""
    return {4: (1, 2, 3), 5: (2, 3, 4)}.get(len(shape))


def _is_past(name: str) -> bool:
    return past_key(name, ("past_key_values", "past")) is not None


def is_cross(name: str) -> bool:
    return any(w in name.lower() for w in ("encoder", "cross"))


_NAME = re.compile(r"[A-Za-z_]\w*\Z")


def derived_dims(
    inputs: list[Any], facts: ModelFacts, dims: dict[str, int], given: dict[str, Any] | None = None
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """``dims`` plus what the model says of the symbolic dims the user did not give (head counts, head size,
    hidden sizes), and the dims that matter but nothing determines, each with where it is (inputs ``given``
    real values need none)."""
    out = dict(dims)
    missing: list[tuple[str, str]] = []

    def put(d: object, value: int | None, where: str) -> None:
        if not isinstance(d, str) or not _NAME.match(d) or d in dims:
            return
        if value:
            out.setdefault(d, value)
        elif d not in out and all(m != d for m, _ in missing):
            missing.append((d, where))

    for inp in inputs:
        if inp.name in (given or {}):
            continue
        shape = list(inp.shape)
        axes = _past_axes(shape) if _is_past(inp.name) else None
        if axes:
            heads = facts.heads if is_cross(inp.name) else facts.kv_heads
            put(shape[axes[0]], heads, f"the head count, axis {axes[0]} of {inp.name!r}")
            put(shape[axes[2]], facts.head_size, f"the head size, axis {axes[2]} of {inp.name!r}")
        elif shape and inp.name in facts.hidden_of:
            put(shape[-1], facts.hidden_of[inp.name], "")
        elif shape and any(w in inp.name.lower() for w in ("hidden_states", "inputs_embeds")):
            put(shape[-1], facts.hidden, f"the hidden size, last axis of {inp.name!r}")
        elif len(shape) == 4 and any(w in inp.name.lower() for w in ("pixel_values", "image")):
            # NCHW, as transformers' vision models take them: sizes from config.json (a ViT's position
            # embeddings fit one image size only)
            put(shape[1], facts.channels, _unstated(facts, inp.name, 1, "num_channels"))
            put(shape[2], facts.image[0] if facts.image else None, _unstated(facts, inp.name, 2, "image_size"))
            put(shape[3], facts.image[1] if facts.image else None, _unstated(facts, inp.name, 3, "image_size"))
        elif len(shape) == 3 and "input_features" in inp.name.lower():  # [batch, mel bins, frames]
            put(shape[1], facts.mel_bins, _unstated(facts, inp.name, 1, "num_mel_bins"))
            put(shape[2], facts.frames, _unstated(facts, inp.name, 2, "max_source_positions"))
    return out, missing


def _unstated(facts: ModelFacts, name: str, axis: int, key: str) -> str:
    """Why axis ``axis`` of input ``name`` has no size from config.json's ``key``: absent, or above its cap."""
    capped = next((line for line in facts.capped if f" {key}=" in line), None)
    return f"axis {axis} of {name!r}: " + (capped or f"config.json beside the model gives no {key}")


def check_dim_names(inputs: list[Any], dims: dict[str, int], model_name: str) -> None:
    """A ``--dim`` name no input has is a usage error (a typo would otherwise be ignored silently and the dim left
    at 1): a dim's whole name counts, whatever its characters (paddle's ``DynamicDimension.0``, ``batch-size``),
    and so do the names inside expression dims (``past_sequence_length + sequence_length``)."""
    from ...errors import UsageError

    named = {d for i in inputs for d in i.shape if isinstance(d, str)}
    symbolic = named | {n for d in named for n in re.findall(r"[A-Za-z_]\w*", d)}
    unknown = sorted(set(dims) - symbolic - {"*"})
    if unknown:
        raise UsageError(
            f"--dim {unknown[0]}: no input of {model_name} has a dimension of that name "
            f"(symbolic dims: {', '.join(sorted(symbolic)) or 'none'}; '*' sets every dynamic one)"
        )


def session_feeds(
    path: Path, session: Any, dims: dict[str, int], given: dict[str, Any], seed: int = 0, check_names: bool = True
) -> tuple[dict[str, Any], list[str]]:
    """One run's inputs for ``session`` of the model at ``path``, made as verify makes its first run's (sizes from
    the model and the configs beside it, a merged decoder's prefill branch, a decoder's ``encoder_hidden_states``
    from the encoder beside it), and what was taken or ignored (config sizes above their cap). Raises UsageError
    naming what cannot be made (``--dim`` / ``--input``)."""
    inputs = session.get_inputs()
    if check_names:
        check_dim_names(inputs, dims, path.name)
    facts = read_facts(path)
    notes = list(facts.capped)
    if check_names:  # not for the encoder run here itself
        states, note = encoder_states(path, inputs, given, dims)
        given = {**given, **states}
        notes += [note] if note else []
    known, missing = derived_dims(inputs, facts, dims, given)
    merged = any("use_cache" in i.name.lower() and i.type == "tensor(bool)" for i in inputs)
    p = plan(inputs, [o.name for o in session.get_outputs()])
    window = window_pasts(p, facts, known, dims)
    notes += [window] if window else []
    run_dims = run_lengths(p, known, past_zero=merged)
    from ..._runtimes.ort import dim_value

    past = max((dim_value(d, run_dims) for d in p.past_dims), default=0)
    return make_feeds(inputs, facts, run_dims, given, seed, False, missing, past), notes


ENCODER_FILE = "encoder_model.onnx"  # what optimum names the encoder of an encoder-decoder export


def encoder_states(
    decoder: Path, inputs: list[Any], given: dict[str, Any], dims: dict[str, int]
) -> tuple[dict[str, Any], str]:
    """``{"encoder_hidden_states": ...}`` for a decoder exported beside its encoder (optimum's
    ``encoder_model.onnx``): the original encoder run on inputs made as for any model (sizes from ``config.json``:
    Whisper's mel bins and frames, an image size), its ``last_hidden_state`` (else first output) taken; and a note
    saying so, or why not. ({}, "") for any other model, or when the user gave the states."""
    name = "encoder_hidden_states"
    encoder = decoder.parent / ENCODER_FILE
    if name not in {i.name for i in inputs} or name in given or not encoder.is_file() or encoder == decoder:
        return {}, ""
    from ..._runtimes.ort import new_session

    key = _identity(encoder, dims)
    if key is not None and _ENCODED and _ENCODED[0][0] == key:
        return _ENCODED[0][1]
    try:
        session = new_session(str(encoder), share=False, log_level=4)
        feeds, _ = session_feeds(encoder, session, dims, {}, check_names=False)
        outs = [o.name for o in session.get_outputs()]
        values = dict(zip(outs, session.run(None, feeds)))
    except Exception as e:  # noqa: BLE001 -- without it, the states are random as for any input
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return {}, f"{name} random: {ENCODER_FILE} beside the model did not run ({why})"
    out = "last_hidden_state" if "last_hidden_state" in values else outs[0]
    found = {name: values[out]}, f"{name} from {ENCODER_FILE}'s {out} (the original encoder, run first)"
    _ENCODED[:] = [(key, found)] if key is not None else []
    return found


# The last encoder run's states, for the next decoder fed from the same encoder files at the same sizes (check
# measures a family's decoders one after another, each setting in turn: one encoder session and run each, 0.1
# CPU s for T5's). Keyed by the encoder's files (path and ``probe.path_identity``) and the sizes: a file
# replaced runs again.
_ENCODED: list[tuple[tuple[object, ...], tuple[dict[str, Any], str]]] = []


def _identity(encoder: Path, dims: dict[str, int]) -> tuple[object, ...] | None:
    from .ort.probe import external_locations, path_identity

    try:
        if encoder.stat().st_size > 64 << 20:  # its weights inside: not read again to key them, run each time
            return None
        files = [encoder] + [encoder.parent / f for f in sorted(set(external_locations(encoder.read_bytes())))]
        stats = [(str(f), *path_identity(f)) for f in files]
    except Exception:  # noqa: BLE001 -- unreadable: run, not reused
        return None
    return (*stats, tuple(sorted(dims.items())))


def _shape(inp: Any, dims: dict[str, int]) -> list[int]:
    from ..._runtimes.ort import dim_value

    return [dim_value(d, dims) for d in inp.shape]


def make_feeds(
    inputs: list[Any],
    facts: ModelFacts,
    dims: dict[str, int],
    given: dict[str, Any],
    seed: int,
    use_cache: bool,
    missing_dims: list[tuple[str, str]] | None = None,
    past_length: int | None = None,
) -> dict[str, Any]:
    """Seeded inputs from a session's input signature, except those ``given``: index inputs inside the tensor they
    index, integer masks ones, position ids counting up from ``past_length`` (else 0), ``seqlens_k`` /
    ``total_sequence_length`` from the mask's length, ``use_cache_branch`` as told. Everything that cannot be made
    (and every dim in ``missing_dims``) is named at once, in one error with a runnable example."""
    import numpy as np

    from ...errors import UsageError

    rng = np.random.default_rng(seed)
    feeds: dict[str, Any] = {}
    missing: list[tuple[str, str]] = []
    total = _total_length(inputs, dims)
    for inp in inputs:
        if inp.name in given:
            feeds[inp.name] = given[inp.name]
            continue
        shape = _shape(inp, dims)
        dtype = ORT_TYPES.get(inp.type)
        name = inp.name.lower()
        integer = dtype is not None and dtype.startswith(("int", "uint"))
        bound = facts.bounds.get(inp.name, facts.vocab if "input_ids" in name else None)
        if dtype is None:
            missing.append((inp.name, f"has type {inp.type}, which cannot be generated"))
        elif integer and "position" in name and shape:
            start = past_length or 0
            feeds[inp.name] = np.broadcast_to(np.arange(start, start + shape[-1]), shape).astype(dtype)
        elif inp.name in facts.bounds and bound is None:
            missing.append((inp.name, "indexes a tensor of unknown size, so random values would be out of range"))
        elif integer and bound is not None:
            feeds[inp.name] = rng.integers(0, max(bound, 1), shape).astype(dtype)
        elif dtype == "bool" and "use_cache" in name:
            feeds[inp.name] = np.full(shape, use_cache, bool)
        elif dtype == "bool":
            feeds[inp.name] = rng.integers(0, 2, shape).astype(bool)
        elif integer and "mask" in name:
            feeds[inp.name] = np.ones(shape, dtype)  # attend to everything: every position is valid
        elif integer and "seqlens_k" in name:
            feeds[inp.name] = np.full(shape, max(total - 1, 0), dtype)
        elif integer and "total_sequence_length" in name:
            feeds[inp.name] = np.full(shape, total, dtype)
        elif integer:
            feeds[inp.name] = rng.integers(0, 3, shape).astype(dtype)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
    dims_missing = missing_dims or []
    if missing or dims_missing:
        why = "; ".join([f"{n!r} {reason}" for n, reason in missing] + [f"dim {d!r} ({w})" for d, w in dims_missing])
        example = " ".join([f"--input {n}={n}.npy" for n, _ in missing] + [f"--dim {d}=N" for d, _ in dims_missing])
        head = "inputs that need real values" if missing else "dims that cannot be read from the model"
        raise UsageError(f"{head}: {why}; give them with {example}")
    return feeds


def _total_length(inputs: list[Any], dims: dict[str, int]) -> int:
    """Past plus new tokens: the attention mask's length, else the ids' length plus a past input's."""
    from ..._runtimes.ort import dim_value

    for inp in inputs:
        name = inp.name.lower()
        if "attention_mask" in name and "encoder" not in name and len(inp.shape) >= 2:
            return dim_value(inp.shape[-1], dims)
    seq = next((dim_value(i.shape[-1], dims) for i in inputs if "input_ids" in i.name.lower() and i.shape), 1)
    for inp in inputs:
        axes = _past_axes(list(inp.shape)) if _is_past(inp.name) and not is_cross(inp.name) else None
        if axes:
            return seq + dim_value(inp.shape[axes[1]], dims)
    return seq


@dataclass
class DecodePlan:
    """How a model is stepped: which dims are the past / new / total lengths, which present feeds which past."""

    ids: str | None
    logits: str | None
    feeds_back: dict[str, str]  # past input -> present output
    past_dims: set[str]
    seq_dims: set[str]
    total_dims: set[str]


def plan(inputs: list[Any], output_names: list[str]) -> DecodePlan:
    names = [i.name for i in inputs]
    back = pairs(names, output_names)
    ids = next((i for i in inputs if "input_ids" in i.name.lower() and "encoder" not in i.name.lower()), None)
    logits = next((o for o in output_names if "logits" in o.lower()), None)
    seq_dims = {d for d in (ids.shape[-1:] if ids is not None else []) if isinstance(d, str) and _NAME.match(d)}
    past_dims = set()
    for inp in inputs:
        axes = _past_axes(list(inp.shape)) if inp.name in back and not is_cross(inp.name) else None
        d = inp.shape[axes[1]] if axes else None
        if isinstance(d, str) and _NAME.match(d):
            past_dims.add(d)
    total_dims = set()
    for inp in inputs:
        name = inp.name.lower()
        if "attention_mask" in name and "encoder" not in name and inp.shape:
            d = inp.shape[-1]
            if isinstance(d, str) and _NAME.match(d) and d not in seq_dims | past_dims:
                total_dims.add(d)
    return DecodePlan(ids.name if ids is not None else None, logits, back, past_dims, seq_dims, total_dims)


def window_pasts(p: DecodePlan, facts: ModelFacts, dims: dict[str, int], given: dict[str, int]) -> str:
    """Past lengths of at least the sliding window in ``dims`` (those the user did not give, ``given``): ORT's
    GroupQueryAttention with a window-sized cache refuses a shorter past ("KV cache capacity (1) must be at least
    local_window_size (512)", onnxruntime 1.32), and a past as long as the window is what exercises it. A note
    saying so, or ""."""
    from ..._runtimes.ort import dim_value

    raised = [d for d in sorted(p.past_dims) if d not in given and dim_value(d, dims) < facts.window]
    for d in raised:
        dims[d] = facts.window
    if not raised:
        return ""
    return (
        f"past lengths {', '.join(raised)} at {facts.window}: GroupQueryAttention's local_window_size "
        "(sliding-window attention needs a past of at least its window)"
    )


def run_lengths(p: DecodePlan, dims: dict[str, int], past_zero: bool) -> dict[str, int]:
    """``dims`` for a plain run: past lengths 0 when ``past_zero`` (a merged decoder's prefill branch), a mask's
    own length name (``total_sequence_length``) the past's plus the new tokens', unless the user gave them."""
    from ..._runtimes.ort import dim_value

    out = dict(dims)
    if past_zero:
        out.update({d: 0 for d in p.past_dims if d not in dims})
    past = max((dim_value(d, out) for d in p.past_dims), default=0)
    seq = max((dim_value(d, out) for d in p.seq_dims), default=1)
    out.update({d: past + seq for d in p.total_dims if d not in dims})
    return out


def step_dims(p: DecodePlan, dims: dict[str, int], past: int, seq: int) -> dict[str, int]:
    out = dict(dims)
    out.update({d: past for d in p.past_dims})
    out.update({d: seq for d in p.seq_dims})
    out.update({d: past + seq for d in p.total_dims})
    return out


def next_tokens(p: DecodePlan, outs: dict[str, Any], ids: Any, facts: ModelFacts, rng: Any) -> Any:
    """[batch, 1] ids: the argmax of the last position's logits, else a seeded random id below the vocab size."""
    import numpy as np

    batch = ids.shape[0] if getattr(ids, "ndim", 0) >= 1 else 1
    logits = outs.get(p.logits) if p.logits else None
    if isinstance(logits, np.ndarray) and logits.ndim >= 2 and logits.shape[0] == batch and logits.size:
        last = logits.reshape(batch, -1, logits.shape[-1])[:, -1, :]
        token = np.argmax(last, axis=-1)
        if facts.vocab:
            token = token % facts.vocab
    else:
        token = rng.integers(0, facts.vocab or 3, batch)
    return token.reshape(batch, 1).astype(ids.dtype)
