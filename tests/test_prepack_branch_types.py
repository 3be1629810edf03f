"""--prepack types each If branch's tensors in that branch: a name the sibling branch also uses is not its type.

optimum's merged decoders name tensors alike in both branches; Marian's with-past branch computes int64 positions
under the name its no-past branch gives the float embeddings that the first layer's MatMuls read. Typed as one
scope, those MatMuls' one-node models took an int64 activation, ORT refused them and their weights were never
packed. Under test, on a generated merged decoder with that clash (the int64 tensor in the branch walked first):
the types seen in each branch, the packed copies (the same ORT's own whole-model session saves, every MatMul
packed), and the prepacked model's outputs at batch 1 and 8 against the original's, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from test_ort_prepack_forms import _packed, ort_saved_session

from weightshare.formats.onnx.ort.types import ScopeTypes, all_nodes

DIM = 64
CLASH = "h"  # int64 in the with-past branch, float (what the MatMuls read) in the no-past branch


def _clashing_merged_decoder(path: Path) -> Path:
    """An ``If`` on ``use_cache_branch``, its branches' MatMuls reading the main graph's weights; ``then_branch``
    (stored first, as optimum stores it) makes ``h`` from shapes, ``else_branch`` from ``x`` and the positions."""
    rng = np.random.default_rng(0)
    weights = [
        onnx.numpy_helper.from_array((rng.standard_normal((DIM, DIM)) * 0.1).astype(np.float32), name)
        for name in ("w_q", "w_k", "w_v")
    ]
    weights.append(onnx.numpy_helper.from_array(rng.standard_normal(DIM).astype(np.float32), "positions"))
    with_past = h.make_graph(
        [
            h.make_node("Add", ["x", "past"], ["x_past"]),
            h.make_node("MatMul", ["x_past", "w_q"], ["q"]),
            h.make_node("Shape", ["x"], ["shape_x"]),
            h.make_node("Shape", ["past"], ["shape_past"]),
            h.make_node("Sub", ["shape_past", "shape_x"], ["grown"]),
            h.make_node("Add", ["shape_x", "grown"], [CLASH]),  # the past's shape: int64
            h.make_node("Reshape", ["q", CLASH], ["with_past.y"]),
        ],
        "with_past",
        [],
        [h.make_tensor_value_info("with_past.y", T.FLOAT, None)],
    )
    no_past = h.make_graph(
        [
            h.make_node("Add", ["x", "positions"], [CLASH]),  # the embeddings: float
            h.make_node("MatMul", [CLASH, "w_q"], ["q"]),
            h.make_node("MatMul", [CLASH, "w_k"], ["k"]),
            h.make_node("MatMul", [CLASH, "w_v"], ["v"]),
            h.make_node("Mul", ["q", "k"], ["qk"]),
            h.make_node("Add", ["qk", "v"], ["no_past.y"]),
        ],
        "no_past",
        [],
        [h.make_tensor_value_info("no_past.y", T.FLOAT, None)],
    )
    branch = h.make_node("If", ["use_cache_branch"], ["y"])
    branch.attribute.extend([h.make_attribute("then_branch", with_past), h.make_attribute("else_branch", no_past)])
    graph = h.make_graph(
        [branch],
        "merged",
        [
            h.make_tensor_value_info("x", T.FLOAT, ["batch", "seq", DIM]),
            h.make_tensor_value_info("past", T.FLOAT, ["batch", "seq", DIM]),
            h.make_tensor_value_info("use_cache_branch", T.BOOL, [1]),
        ],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        weights,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.data", size_threshold=1024)
    return path


def _feeds(batch: int, cache: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch)
    x, past = (rng.standard_normal((batch, 5, DIM)).astype(np.float32) for _ in range(2))
    return {"x": x, "past": past, "use_cache_branch": np.array([cache])}


def test_each_branch_sees_its_own_type_of_a_shared_name(tmp_path):
    src = _clashing_merged_decoder(tmp_path / "src" / "model.onnx")
    model = onnx.load(str(src), load_external_data=False)
    types = ScopeTypes(model)
    seen = {scope[-1].name: types.of(scope)[CLASH] for node, scope in all_nodes(model.graph) if CLASH in node.output}
    assert seen == {"with_past": T.INT64, "no_past": T.FLOAT}
    # and in ORT's optimized graph, the one --prepack packs node by node
    optimized = onnx.load(str(ort_saved_session(src, tmp_path)), load_external_data=False)
    types = ScopeTypes(optimized)
    readers = [(n, s) for n, s in all_nodes(optimized.graph) if n.op_type == "MatMul" and CLASH in n.input]
    assert len(readers) == 3
    assert all(types.of(s)[CLASH] == T.FLOAT and types.of(s)[n.output[0]] == T.FLOAT for n, s in readers)


@pytest.mark.slow  # a conversion's ORT child
def test_branch_matmuls_reading_a_clashing_name_are_packed_and_exact(tmp_path):
    from conftest import run_cli

    src = _clashing_merged_decoder(tmp_path / "src" / "model.onnx")
    res = run_cli("convert", src, "-o", tmp_path / "out", "--prepack", "--json", "-q")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)["reports"][0]
    matmuls = report["prepack"]["ops"]["MatMul"]
    assert matmuls["nodes"] == 4 and matmuls["packed"] == 4, matmuls
    prepacked = Path(report["outputs"][0])
    expected = _packed(ort_saved_session(src, tmp_path))
    assert len(expected) == 3  # w_q, w_k, w_v: the no-past MatMuls' weights among them
    assert _packed(prepacked) == expected

    original, converted = ort.InferenceSession(str(src)), ort.InferenceSession(str(prepacked))
    for batch in (1, 8):
        outs = []
        for cache in (True, False):
            feeds = _feeds(batch, cache)
            a, b = original.run(None, feeds)[0], converted.run(None, feeds)[0]
            assert a.shape == (batch, 5, DIM) and np.abs(a).max() > 0
            assert a.dtype == b.dtype and np.array_equal(a, b)
            outs.append(a)
        assert not np.array_equal(outs[0], outs[1])  # each branch ran
