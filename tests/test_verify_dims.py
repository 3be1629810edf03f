"""``verify`` runs each free symbolic dim at 1 and at the sizes where kernels switch (batch 1, 8, 64; other dims
1 and more): a converted model that differs from the original only at batch >= 32 fails it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import weightshare
from weightshare.formats.onnx import verify_dims


def _mlp(path: Path) -> Path:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(256).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 256])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 256])
    model = helper.make_model(
        helper.make_graph(nodes, "mlp", [x], [y], [w, b]), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _differ_from_batch_32(converted: Path) -> None:
    """Edit the converted graph so that its output is off by one ulp-ish factor from batch 32 on, as a graph ORT
    optimized differently is where MLAS switches kernels (the payloads stay the converted ones)."""
    model = onnx.load(str(converted), load_external_data=False)
    g = model.graph
    g.node[-1].output[0] = "y_exact"
    g.initializer.extend(
        [
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
            numpy_helper.from_array(np.array([32], np.int64), "thirty_two"),
            numpy_helper.from_array(np.array(1.0001, np.float32), "nudge"),
        ]
    )
    g.node.extend(
        [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Slice", ["shape", "zero", "one"], ["batch_size"]),
            helper.make_node("GreaterOrEqual", ["batch_size", "thirty_two"], ["large"]),
            helper.make_node("Mul", ["y_exact", "nudge"], ["y_nudged"]),
            helper.make_node("Where", ["large", "y_nudged", "y_exact"], ["y"]),
        ]
    )
    onnx.save(model, str(converted))


@pytest.mark.slow
def test_verify_fails_a_model_that_differs_only_at_batch_64(tmp_path, cli):
    src = _mlp(tmp_path / "mlp.onnx")
    converted = Path(weightshare.convert(src, tmp_path / "out").outputs[0])
    assert weightshare.verify(src, converted).passed
    _differ_from_batch_32(converted)
    # at batch 1 (what verify ran before: every symbolic dim at 1) the edit is invisible
    assert weightshare.verify(src, converted, dims={"batch": 1, "seq": 1}).passed
    res = cli("verify", src, converted, "--json")
    assert res.returncode == 1, res.stdout + res.stderr
    (report,) = json.loads(res.stdout)["reports"]
    assert any("batch at 1, 8, 64" in n and "seq at 1, 8" in n for n in report["notes"]), report["notes"]
    assert report["mismatches"] and report["runs"] >= 3


def test_dim_variants_and_the_memory_budget():
    class Arg:
        def __init__(self, name: str, shape: list[object], type_: str = "tensor(float)") -> None:
            self.name, self.shape, self.type = name, shape, type_

    inputs = [Arg("ids", ["batch", "sequence_length"], "tensor(int64)"), Arg("mask", ["batch", "total"])]
    variants = verify_dims.dim_variants(inputs, {}, {"total"})
    assert variants == [
        {"batch": 1, "sequence_length": 1},
        {"batch": 8, "sequence_length": 8},
        {"batch": 64, "sequence_length": 1},
    ]
    assert verify_dims.dim_variants(inputs, {"*": 4}) == [{}]  # the user set every dynamic dim
    assert verify_dims.dim_variants(inputs, {"batch": 2, "sequence_length": 3, "total": 5}) == [{}]
    # an image model whose batch-64 run would take more than the budget: halved until it fits
    images = [Arg("pixels", ["N", 3, 1024, 1024])]
    big = verify_dims.fit({"N": 64}, images, images, {}, unit_bytes=0)
    assert big is not None and big["N"] < 64
    assert verify_dims.run_bytes(images, images, big) <= verify_dims.RUN_BUDGET_BYTES
    assert verify_dims.fit({"N": 64}, images, images, {}, unit_bytes=verify_dims.RUN_BUDGET_BYTES) is None
