"""Tied weights in a --prepack output are accepted by `check`.

Before: a model with two equal MatMul weights (tied, as exporters leave an LM head tied to its embedding or
repeated blocks) converted with --prepack failed `check` with bad-prepacked-entry: the packed copy is stored once,
recorded under the first tensor's name, and the second tensor's entry pointing at it was called wrong, although
outputs are bit-identical. Under test: `check --no-measure` on that output, and outputs against the original at
batch 1 and 8. After: no finding, exit 0; outputs identical.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")


def tied_model(path, d: int = 256, vocab: int = 500):
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((d, d)) * 0.05).astype(np.float32)
    embed = (rng.standard_normal((vocab, d)) * 0.05).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w1"), numpy_helper.from_array(w.copy(), "w2")]
    inits.append(numpy_helper.from_array(embed, "embed"))
    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["x"]),
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["h2"]),
        helper.make_node("Gemm", ["h2", "embed"], ["logits"], transB=1),  # the LM head tied to the embedding
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", vocab])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path), save_as_external_data=True, location="tied.data", size_threshold=1024)
    (path.parent / "tied.data").chmod(0o644)
    return path


@pytest.mark.slow
def test_a_tied_weight_prepack_output_passes_check_and_matches_the_original(cli, tmp_path):
    src = tied_model(tmp_path / "tied.onnx")
    assert cli("convert", src, "-o", tmp_path / "out", "-q", "--prepack").returncode == 0
    out = tmp_path / "out" / "tied.onnx"
    res = cli("check", out, "--no-measure", "--json")
    codes = [f["code"] for f in json.loads(res.stdout)["findings"]]
    assert res.returncode == 0 and "bad-prepacked-entry" not in codes, res.stdout
    a, b = ort.InferenceSession(str(src)), ort.InferenceSession(str(out))
    for n in (1, 8):
        ids = np.arange(n, dtype=np.int64) * 7 % 500
        assert np.array_equal(a.run(None, {"ids": ids})[0], b.run(None, {"ids": ids})[0])
