"""`verify --dim` takes a dimension's whole name, whatever its characters.

Before: names were split at the dot, so `--dim DynamicDimension.0=3` (paddle2onnx's names) was refused with "no
input has a dimension of that name". Under test: a model whose input dim is named DynamicDimension.0 and that runs
only when it is 3 (a Reshape to [3, 4]). After: `--dim DynamicDimension.0=3` verifies (the value is used: without
it the original fails), and a name no input has is still refused.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


def dotted(path):
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4) / 16, "w"),
        numpy_helper.from_array(np.array([3, 4], np.int64), "shape"),
    ]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Reshape", ["h", "shape"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["DynamicDimension.0", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.slow
def test_a_dotted_dim_name_is_one_name(cli, tmp_path):
    src = dotted(tmp_path / "m.onnx")
    assert cli("convert", src, "-o", tmp_path / "out", "-q").returncode == 0
    out = tmp_path / "out" / "m.onnx"
    res = cli("verify", src, out, "--dim", "DynamicDimension.0=3")
    assert res.returncode == 0, res.stderr
    assert cli("verify", src, out).returncode == 2  # at 1 the Reshape to [3, 4] fails: the value above was used
    res = cli("verify", src, out, "--dim", "DynamicDimension.1=3")
    assert res.returncode == 2 and "DynamicDimension.0" in res.stderr, res.stderr
