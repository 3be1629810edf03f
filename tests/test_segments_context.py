"""``--prepack``'s segments on graphs whose every layer reads tensors derived from the inputs (a decoder's causal
mask and rotary tables, a ViT's mask from the pixels' shape): the context is computed again in each segment, each
segment holds a witness of the other layers' readers, and the stitch is compared node for node with ORT's
optimization of the whole graph with every weight an input. What one ORT session is handed stays bounded as the
model grows, the result is ORT's whole-graph optimization, and a stitch the whole graph would not make falls back
to one piece."""

from __future__ import annotations

from pathlib import Path

import model_forms as mf
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from weightshare.formats.onnx.ort import segments as segs
from weightshare.formats.onnx.ort.child import optimize as ort_optimize

BUDGET = 200_000  # weight bytes per segment: a few segments per layer of the 1-3 MiB models below


def _optimized(src: Path, out: Path, budget: int, witnesses: bool = True) -> dict:
    """ORT's level-ALL graph of ``src`` in ``out`` (segments of ``budget`` weight bytes), and the segmenter's report."""
    out.parent.mkdir(parents=True)
    seg = segs.Segmenter(str(src), str(out), lambda a, b, c: ort_optimize(a, b, c, "1024"), budget)
    if not witnesses:
        seg.shared = None
    return seg.run().as_dict()


def _fingerprint(path: Path) -> tuple:
    return segs.fingerprint(onnx.load(str(path), load_external_data=False), path.parent)


def _same_outputs(src: Path, other: Path, feeds_of: Path | None = None) -> bool:
    """Default-option sessions of ``src`` and ``other`` compute the same bits at batch 1, 4 and 16."""
    a = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(other), providers=["CPUExecutionProvider"])
    for batch, seq in ((1, 8), (4, 16), (16, 5)):
        feeds = mf.feeds(feeds_of or src, batch=batch, seq=seq)
        if not all(np.array_equal(x, y) for x, y in zip(a.run(None, feeds), b.run(None, feeds), strict=True)):
            return False
    return True


@pytest.mark.slow
def test_an_fp16_decoder_is_cut_into_bounded_segments_at_any_size(tmp_path):
    """An fp16 decoder with a causal mask and rotary tables read by every layer: before, no cut could hand those
    over, and the whole graph went to one session (its largest piece was every weight). Now the largest segment
    is bounded by the budget at both sizes, and the stitch is ORT's whole-graph optimization, bit for bit."""
    largest = {}
    for mib in (1, 3):
        src = mf.causal_llama_fp16(tmp_path / f"m{mib}" / "model.onnx", mib=mib)
        report = _optimized(src, tmp_path / f"split{mib}" / "ort.onnx", BUDGET)
        weights = sum(segs._tensor_bytes(t) for t in onnx.load(str(src), load_external_data=False).graph.initializer)
        assert report["segments"] > 4 and report["single_reason"] == "", report
        assert report["largest_segment_bytes"] <= BUDGET < weights / 4, report
        largest[mib] = report["largest_segment_bytes"]
    assert largest[3] <= largest[1] * 1.25  # flat: three times the weights, not a larger piece
    whole = tmp_path / "whole" / "ort.onnx"
    _optimized(tmp_path / "m1" / "model.onnx", whole, 1 << 40)
    assert _fingerprint(tmp_path / "split1" / "ort.onnx") == _fingerprint(whole)
    assert _same_outputs(tmp_path / "m1" / "model.onnx", tmp_path / "split1" / "ort.onnx")


@pytest.mark.slow
def test_an_fp16_vit_is_cut_into_segments_that_stitch_to_the_whole_graph(tmp_path):
    """The ORT-optimizer fp16 ViT: its attention mask is built from the pixels' shape and read by every layer, its
    norms share one fp16 weight that ORT reads through a Cast in one place only."""
    src = mf.vit_fp16(tmp_path / "m" / "model.onnx", mib=4)
    report = _optimized(src, tmp_path / "split" / "ort.onnx", 1 << 19)
    assert report["segments"] > 4 and report["largest_segment_bytes"] <= 2 << 19, report
    _optimized(src, tmp_path / "whole" / "ort.onnx", 1 << 40)
    assert _fingerprint(tmp_path / "split" / "ort.onnx") == _fingerprint(tmp_path / "whole" / "ort.onnx")
    # a saved level-ALL fp16 ViT is optimized again when loaded (what --prepack's reload check handles): here the
    # stitch is compared with ORT's own saved whole graph, and the conversion below with the original
    whole, split = tmp_path / "whole" / "ort.onnx", tmp_path / "split" / "ort.onnx"
    assert _same_outputs(whole, split, feeds_of=src)


@pytest.mark.slow
@pytest.mark.parametrize("build", [mf.causal_llama_fp16, mf.vit_fp16], ids=["decoder", "vit"])
def test_prepack_in_context_segments_computes_the_originals_bits(tmp_path, monkeypatch, build):
    """``convert --prepack`` end to end, the graph cut into segments that read the context: bit for bit what ORT
    computes on the original at batch 1, 4 and 16."""
    import weightshare

    monkeypatch.setenv(segs.BUDGET_ENV, str(1 << 19))
    src = build(tmp_path / "src" / "model.onnx", mib=4)
    report = weightshare.convert(src, tmp_path / "out", prepack=True)
    assert report.prepack["segments"]["segments"] > 4, report.prepack["segments"]
    assert _same_outputs(src, tmp_path / "out" / "model.onnx")


@pytest.mark.slow
def test_segments_the_whole_graph_would_not_make_fall_back_to_the_cut_without_context(tmp_path):
    """Without witnesses each segment reads the shared fp16 attention scale once, ORT folds its Cast and fuses it
    into the scores' MatMul, which the whole graph (a Cast read by every layer) does not: the pair checks cannot
    see it, the comparison with the whole graph does, and the graph is cut as it was without context."""
    src = mf.causal_llama_fp16(tmp_path / "m" / "model.onnx", mib=1)
    report = _optimized(src, tmp_path / "split" / "ort.onnx", BUDGET, witnesses=False)
    # cut as without context: the pieces before the first layer reads the mask and after the last one
    weights = sum(segs._tensor_bytes(t) for t in onnx.load(str(src), load_external_data=False).graph.initializer)
    assert "every layer reads" in report["dropped_cuts"][0] and report["largest_segment_bytes"] > weights / 2, report
    _optimized(src, tmp_path / "whole" / "ort.onnx", 1 << 40)
    assert _fingerprint(tmp_path / "split" / "ort.onnx") == _fingerprint(tmp_path / "whole" / "ort.onnx")
    # nothing of the dropped segments is left beside the output
    files = {p.name for p in (tmp_path / "split").iterdir()}
    assert "ort.onnx" in files and not any("win" in f or f.endswith("b.bin") for f in files), files


def test_context_is_what_the_inputs_alone_compute_and_moves_to_the_front():
    m = onnx.load(str(mf.causal_llama_fp16(Path(__import__("tempfile").mkdtemp()) / "m.onnx", mib=1)))
    g = m.graph
    small = {t.name for t in g.initializer if segs._tensor_bytes(t) < 16384}  # each weight: 32 KiB
    context, prologue = segs.hoist_context(g, small, segs.tensor_types(m))
    assert {"cos", "sin", "mask.full"} <= context and "causal" in prologue
    assert not any(t.startswith("layer") and ".norm" not in t for t in context)  # no layer's own tensor
    first_layer = next(k for k, n in enumerate(g.node) if n.op_type == "MatMul")
    assert all(o in prologue for n in g.node[:first_layer] for o in n.output if n.op_type != "Pow")


def test_fingerprint_leaves_out_attributes_at_their_default(tmp_path):
    """ORT 1.32 writes com.microsoft Attention's ``unidirectional=0`` in one save route and leaves it out in the
    other; the attention form's cuts were dropped for it. A non-default value still counts."""
    from onnx import TensorProto as T
    from onnx import helper as h

    def attention(**attrs: int) -> onnx.ModelProto:
        node = h.make_node("Attention", ["x", "w", "b"], ["y"], domain="com.microsoft", num_heads=2, **attrs)
        io = [h.make_tensor_value_info(n, T.FLOAT, None) for n in ("x", "w", "b", "y")]
        graph = h.make_graph([node], "a", io[:3], io[3:])
        return h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])

    fp = lambda m: segs.fingerprint(m, tmp_path)  # noqa: E731
    assert fp(attention(unidirectional=0)) == fp(attention())
    assert fp(attention(unidirectional=1)) != fp(attention())


@pytest.mark.parametrize(("build", "slack"), [(mf.causal_llama_fp16, 0.5), (mf.vit_fp16, 2.0)], ids=["decoder", "vit"])
def test_the_residual_stream_passes_over_a_segment_so_no_segment_outgrows_the_budget(tmp_path, build, slack):
    """The budget holds one layer's attention (four projections) or one or two MLP weights; the MLP (gate, up,
    down; a ViT's fc1, fc2) holds more. The only cut inside it hands over the residual stream, made before the MLP's
    segment began: it now passes over that segment (made by one weight-free node, read by another), so every
    segment stays within the budget (before: the whole MLP in one, 1.5x-2x the budget, and at 1 GiB a 363/457 MiB
    --prepack tree). The stitch is still ORT's whole-graph optimization, node for node, and computes its bits."""
    src = build(tmp_path / "m" / "model.onnx", mib=1)
    graph = onnx.load(str(src), load_external_data=False).graph
    q = next(segs._tensor_bytes(t) for t in graph.initializer if t.name == "layer0.q.w")
    # the four projections, and room for the first layer's embedding (the ViT's patch Conv: the cut before its
    # first layer does not hold, as before)
    budget = int((4 + slack) * q)
    report = _optimized(src, tmp_path / "split" / "ort.onnx", budget)
    assert report["single_reason"] == "" and report["unsafe_cuts"] == 0, report
    assert report["largest_segment_bytes"] <= budget, report
    # the layers' windows alike: checked once (shape inference names each layer's unknown dimensions apart)
    assert report["checks_reused"] >= report["checked_cuts"] // 3, report
    _optimized(src, tmp_path / "whole" / "ort.onnx", 1 << 40)
    assert _fingerprint(tmp_path / "split" / "ort.onnx") == _fingerprint(tmp_path / "whole" / "ort.onnx")
    assert _same_outputs(tmp_path / "whole" / "ort.onnx", tmp_path / "split" / "ort.onnx", feeds_of=src)
