"""``convert --prepack`` computes what ONNX Runtime computes on the ORIGINAL at default options, bit for bit, at
batch 1, 8, 32 and 64, also when the graph is optimized in segments (a small ``WEIGHTSHARE_ORT_SEGMENT_BYTES``):
ORT's fusions depend on facts about the whole graph (consumer counts, nodes CSE merges, tensors several layers
read), so a stitch of separately optimized segments must not stand in for the whole graph where those facts
reach across a cut. Models: ``random_layered``'s two reproductions, random layered models,
and every corpus form of ``model_forms``."""

from __future__ import annotations

from pathlib import Path

import model_forms as mf
import onnx
import pytest
import random_layered as rl

import weightshare
from weightshare.formats.onnx.ort import segments as segs


def _convert(
    model: onnx.ModelProto | Path, tmp: Path, monkeypatch: pytest.MonkeyPatch, budget: str
) -> tuple[Path, weightshare.ConversionReport]:
    monkeypatch.setenv(segs.BUDGET_ENV, budget)
    src = model if isinstance(model, Path) else rl.save(model, tmp / "src" / "model.onnx")
    return src, weightshare.convert(src, tmp / "out", prepack=True)


@pytest.mark.parametrize(
    "build",
    [rl.cse_shared_weight_model, rl.derived_two_segments_model],
    ids=["cse-merged-shared-weight", "derived-tensor-two-segments"],
)
@pytest.mark.slow
def test_issue_30_reproductions_compute_the_originals_bits(tmp_path, monkeypatch, build):
    """Before: (1) a cut between two MatMuls of one weight, "checked" by the answer of a window with two weights,
    kept two Gemms where CSE leaves one MatMul (|diff| ~5e-6); (2) a tensor derived from the inputs and read by two
    segments was recomputed in each and fused into a Gemm there, not in the whole graph (|diff| ~2e-6)."""
    src, _ = _convert(build(), tmp_path, monkeypatch, rl.SEGMENT_BUDGET)
    assert rl.differences(src, tmp_path / "out" / "model.onnx") == []
    assert _ops(tmp_path / "out" / "model.onnx") == _ops(_ort_whole(src, tmp_path / "whole"))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [9, 16, 27])  # seeds the stitching code before got wrong
def test_random_layered_models_compute_the_originals_bits(tmp_path, monkeypatch, seed):
    """A few of ``scripts/check_prepack_exact.py``'s generated models (it runs hundreds)."""
    src, _ = _convert(rl.random_model(seed), tmp_path, monkeypatch, rl.SEGMENT_BUDGET)
    assert rl.differences(src, tmp_path / "out" / "model.onnx") == []


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 5, 9, 18, 153])
def test_generated_fp16_models_compute_the_originals_bits(tmp_path, monkeypatch, seed):
    """fp16 weights read by several nodes (seed 9: ORT casts them at every run; a session loading the saved graph
    folded those Casts, and its MatMuls took packed constants: 0.002 apart at batch 8) and decomposed Gelus whose
    scalars ORT shares (seed 5: with the Casts in the file a FusedMatMul with alpha 0.5, 1.9e-6 apart at batch 1).
    --prepack is exact; --prepack --unpack ort-cpu is exact or refused (seed 18: CSE merged two MatMuls of one
    weight, which the original then read as a constant and the adopted graph through its Cast; seed 153: the same
    ops, but the constant and the cast weight on the other MatMul: 0.0005-0.002 apart at batch 8-64 before; seed 1:
    ORT cannot optimize the graph with the Casts in the file, a refusal of --unpack ort-cpu, in one line)."""
    import weightshare

    monkeypatch.setenv(segs.BUDGET_ENV, rl.SEGMENT_BUDGET_FP16)
    src = rl.save(rl.random_model(seed, fp16=True), tmp_path / "src" / "model.onnx")
    weightshare.convert(src, tmp_path / "out", prepack=True)
    assert rl.differences(src, tmp_path / "out" / "model.onnx") == []
    try:
        weightshare.convert(src, tmp_path / "cpu", prepack=True, unpack="ort-cpu")
    except weightshare.WeightshareError as e:
        assert "--unpack ort-cpu: refused" in str(e) and "\n" not in str(e), str(e)
        assert not (tmp_path / "cpu" / "model.onnx").exists()
    else:
        assert rl.differences(src, tmp_path / "cpu" / "model.onnx") == []


@pytest.mark.slow
def test_fp16_decoder_with_one_norm_weight_is_exact(tmp_path, monkeypatch):
    """torch dynamo's fp16 export of an untrained decoder: every RMSNorm reads one all-ones fp16 weight, so in the
    whole graph ORT casts it once, at every run, for all layers (a segment with one norm would make it an fp32
    constant instead: its cuts fail their check). The Cast stays in the written graph, unfolded, and the outputs
    are bit-identical at batch 1, 8, 32 and 64."""
    import numpy as np
    import onnxruntime as ort

    import weightshare

    monkeypatch.setenv(segs.BUDGET_ENV, "65536")
    src = mf.FORMS["llama_fp16"].build(tmp_path / "src" / "model.onnx", mib=1, shared_norm=True)
    report = weightshare.convert(src, tmp_path / "out", prepack=True)
    assert any(" stay behind the Cast onnxruntime runs at every run" in n for n in report.notes), report.notes
    written = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph
    assert "norm.g" in {i.name for i in written.input} & {t.name for t in written.initializer}
    original = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    converted = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    for batch in rl.BATCHES:
        feeds = mf.feeds(src, batch=batch)
        for a, b in zip(original.run(None, feeds), converted.run(None, feeds)):
            assert a.dtype == b.dtype and np.array_equal(a, b), batch


@pytest.mark.slow  # a conversion each (16): the slow tier
@pytest.mark.parametrize("form", sorted(mf.FORMS))
def test_corpus_forms_in_small_segments_compute_the_originals_bits(tmp_path, monkeypatch, form):
    """Every corpus form with a segment budget small enough to cut it, at batch 1, 8, 32 and 64."""
    import numpy as np
    import onnxruntime as ort

    src, report = _convert(mf.build(form, tmp_path / "src" / "model.onnx", mib=1), tmp_path, monkeypatch, "65536")
    # the unfused fp16 encoder stays in one piece (ORT runs its LayerNorms in fp16 or fp32 depending on what
    # follows them, different across every cut); the llama-like fp16 decoder's cuts run through fp32 runs of fp16
    # ops, spliced (3 segments), but its layers all read the mask and rotary tables: one piece over the budget.
    # Both, and only they, are told the route that bounds the child (--unpack ort-cpu: the Casts explicit)
    notes = "\n".join(report.notes)
    assert ("add --unpack ort-cpu" in notes) == (form in {"fp16", "llama_fp16"}), notes
    if form == "llama_fp16":
        assert report.prepack["segments"]["segments"] > 1, notes
    original = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    converted = ort.InferenceSession(str(tmp_path / "out" / "model.onnx"), providers=["CPUExecutionProvider"])
    branches = (True, False) if form == "merged_decoder" else (True,)
    for batch in rl.BATCHES:
        for branch in branches:
            feeds = mf.feeds(src, batch=batch, use_cache_branch=branch)
            for a, b in zip(original.run(None, feeds), converted.run(None, feeds)):
                assert a.dtype == b.dtype and np.array_equal(a, b), (form, batch, branch)


def _ort_whole(src: Path, tmp: Path) -> Path:
    """ORT's own level-ALL optimization of the whole ``src``, saved (pre-packing off)."""
    import onnxruntime as ort

    tmp.mkdir()
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp / "ort.onnx")
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "ort.bin")
    so.log_severity_level = 3
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    return tmp / "ort.onnx"


def _ops(path: Path) -> list[str]:
    return sorted(f"{n.domain}.{n.op_type}" for n in onnx.load(str(path), load_external_data=False).graph.node)


def test_window_shape_tells_one_weight_read_twice_from_two_weights(tmp_path):
    """The key a cut check's answer is reused under: two MatMuls of ONE weight (CSE merges them) are not two
    MatMuls of two weights of the same type and shape."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    def window(tied: bool) -> onnx.ModelProto:
        rng = np.random.default_rng(0)
        w = [numpy_helper.from_array(rng.standard_normal((128, 128)).astype(np.float32), n) for n in ("w1", "w2")]
        nodes = [
            helper.make_node("MatMul", ["x", "w1"], ["a"]),
            helper.make_node("MatMul", ["x", "w1" if tied else "w2"], ["b"]),
            helper.make_node("Add", ["a", "b"], ["y"]),
        ]
        x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 128]) for n in ("x", "y"))
        return helper.make_model(helper.make_graph(nodes, "w", [x], [y], w if not tied else w[:1]))

    shape = lambda m: segs.window_shape(m, 2, frozenset(), frozenset(), tmp_path)  # noqa: E731
    assert shape(window(tied=True)) != shape(window(tied=False))
    assert shape(window(tied=False)) == shape(window(tied=False))


def test_cuts_keep_every_reader_of_a_shared_tensor_in_one_pair_of_segments():
    """``locality``: a graph input or weight read in two segments, a tensor read two segments after the one that
    makes it, identical nodes of the inputs in two segments: each is named; the plan never cuts across a shared
    graph input or weight."""
    m = rl.derived_two_segments_model()
    g = m.graph
    n = len(g.node)
    heavy = 65536
    assert "'m' would be read in 2 segments" in segs.locality(g, [0, 3, n], heavy)
    d = g.node[0].output[0]  # MatMul(m, small): derived from the input m, read by layer 0 and layer 7
    first, last = (k for k, node in enumerate(g.node) if d in node.input)
    assert "beyond the segment after" in segs.locality(g, [0, first + 1, last, n], heavy)
    assert segs.locality(g, [0, first + 1, n], heavy) == ""  # made and read in one pair of adjacent segments
    plan = segs.plan(g, int(rl.SEGMENT_BUDGET), segs.tensor_types(m))
    assert segs.locality(g, plan.bounds, plan.heavy) == ""
    cse = rl.cse_shared_weight_model().graph
    plan = segs.plan(cse, int(rl.SEGMENT_BUDGET), segs.tensor_types(rl.cse_shared_weight_model()))
    assert len(plan.bounds) > 2 and segs.locality(cse, plan.bounds, plan.heavy) == ""


def test_locality_sees_identical_nodes_of_constants_in_two_segments():
    """Two DequantizeLinear of one small quantized weight (ORT does not constant-fold them; its CSE merges them in
    the whole graph): in two segments they would stay two."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(np.ones((16, 16), np.int8), "wq"),
        numpy_helper.from_array(np.array(0.1, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["a"]),
        helper.make_node("MatMul", ["x", "a"], ["h"]),
        helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["b"]),
        helper.make_node("MatMul", ["h", "b"], ["y"]),
    ]
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 16]) for n in ("x", "y"))
    g = helper.make_graph(nodes, "dq", [x], [y], inits)
    assert "identical DequantizeLinear nodes" in segs.locality(g, [0, 2, 4], 65536)
    assert segs.locality(g, [0, 4], 65536) == ""


def _part(nodes, inputs, outputs, inits=()):
    from onnx import helper as h

    io = (
        [h.make_tensor_value_info(n, t, [4]) for n, t in inputs],
        [h.make_tensor_value_info(n, t, [4]) for n, t in outputs],
    )
    return h.make_model(h.make_graph(nodes, "part", *io, list(inits)), opset_imports=[h.make_opsetid("", 17)])


def test_stitch_splices_the_casts_a_cut_through_an_fp32_run_adds_and_merges_casts_of_equal_constants():
    """What the whole graph holds at such a cut: the fp32 tensor read directly (ORT casts only at a run's ends),
    and one Cast of a constant that every segment reads (ORT shares equal constants)."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    cast = "InsertedPrecisionFreeCast_"
    g = [nh.from_array(np.ones(4, np.float16), "g"), nh.from_array(np.ones(4, np.float16), "g2")]
    left = _part(
        [
            h.make_node("Cast", ["x"], ["xf"], name=f"{cast}x", to=T.FLOAT),
            h.make_node("Cast", ["g"], ["gf"], name=f"{cast}g", to=T.FLOAT),
            h.make_node("Mul", ["xf", "gf"], ["m"]),
            h.make_node("Cast", ["m"], ["t"], name=f"{cast}t", to=T.FLOAT16),
        ],
        [("x", T.FLOAT16)],
        [("t", T.FLOAT16)],
        g[:1],
    )
    right = _part(
        [
            h.make_node("Cast", ["t"], ["tf"], name=f"{cast}tf", to=T.FLOAT),
            h.make_node("Cast", ["g2"], ["g2f"], name=f"{cast}g2", to=T.FLOAT),
            h.make_node("Mul", ["tf", "g2f"], ["yf"]),
            h.make_node("Cast", ["yf"], ["y"], name=f"{cast}y", to=T.FLOAT16),
        ],
        [("t", T.FLOAT16)],
        [("y", T.FLOAT16)],
        g[1:],
    )
    whole = segs.stitch([left, right], left.graph.input, right.graph.output)
    ops = [(n.op_type, list(n.input)) for n in whole.graph.node]
    assert ("Mul", ["m", "gf"]) in ops, ops  # the fp32 tensor, and the first Cast of the equal constant
    assert [n for n in whole.graph.node if n.op_type == "Cast"] == [
        whole.graph.node[0],
        whole.graph.node[1],
        whole.graph.node[-1],
    ]
    assert {t.name for t in whole.graph.initializer} == {"g"}
    onnx.checker.check_model(whole)
