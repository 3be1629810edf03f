"""--unpack ort-cpu matches ORT's probe nodes to the model's by identity, not by tensor names."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import weightshare
from weightshare.options import ConvertOptions

ORT_CPU = ConvertOptions(unpack=frozenset({"ort-cpu"}))
D = 16


def _model(named: bool) -> onnx.ModelProto:
    """Two fp32 Transposes ORT leaves alone, one output named like ORT's rename of the other; then an fp16
    MatMul whose weight ORT casts per session (so the probe graph is adopted)."""
    rng = np.random.default_rng(0)
    name = (lambda s: {"name": s}) if named else (lambda s: {})
    nodes = [
        h.make_node("Transpose", ["x"], ["X"], perm=[0, 1], **name("t")),
        h.make_node(
            "Transpose", ["x"], ["InsertedPrecisionFreeCast_X"], perm=[1, 0], **name("InsertedPrecisionFreeCast_t")
        ),
        h.make_node("Sub", ["X", "InsertedPrecisionFreeCast_X"], ["s"], **name("InsertedPrecisionFreeCast_w")),
        h.make_node("Cast", ["s"], ["s16"], to=T.FLOAT16, **name("c16")),
        h.make_node("MatMul", ["s16", "w"], ["m"], **name("mm")),
        h.make_node("Identity", ["w"], ["w_again"], **name("node0")),  # a second consumer: the inserted Cast stays
        h.make_node("Cast", ["m"], ["y"], to=T.FLOAT, **name("c32")),
        h.make_node("Cast", ["w_again"], ["w_out"], to=T.FLOAT, **name("c_w")),
    ]
    g = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, [D, D])],
        [h.make_tensor_value_info("y", T.FLOAT, [D, D]), h.make_tensor_value_info("w_out", T.FLOAT, [D, D])],
        [nh.from_array((rng.standard_normal((D, D)) / 4).astype(np.float16), "w")],
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _run(path: Path, x: np.ndarray) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
def test_a_tensor_named_like_orts_rename_does_not_change_the_outputs(tmp_path, named):
    """Before: unnamed, exit 0 with max diff 4.5 (the Transposes swapped); named, two nodes called "t" and
    ORT refused the output."""
    src = tmp_path / "src.onnx"
    onnx.save(_model(named), src)
    report = weightshare.convert(src, tmp_path / "out", ORT_CPU)
    assert any("adopted" in n for n in report.notes), report.notes
    out = Path(report.outputs[0])
    graph = onnx.load(str(out), load_external_data=False).graph
    names = [n.name for n in graph.node if n.name]
    assert len(names) == len(set(names)), names
    assert not any(n.startswith("weightshare.probe/") for n in names)
    if named:  # the user's names stay on the user's nodes
        assert {"t", "InsertedPrecisionFreeCast_t", "mm", "node0"} <= set(names)
    x = np.random.default_rng(1).standard_normal((D, D)).astype(np.float32)
    for want, got in zip(_run(src, x), _run(out, x)):
        assert np.array_equal(want, got)
