"""The model-forms corpus (tests/model_forms.py): every form builds small, loads in ORT and runs."""

from __future__ import annotations

import model_forms as mf
import numpy as np
import onnx
import onnxruntime as ort
import pytest

# The op each form must contain after it is written (what makes it that form).
SIGNATURE = {
    "fp32": "MatMul",
    "fp16": "LayerNormalization",
    "fp16_cast": "Cast",
    "llama": "Sigmoid",
    "llama_fp16": "Sigmoid",
    "matmulnbits4": "MatMulNBits",
    "matmulnbits4_sym_b128_acc4": "MatMulNBits",
    "matmulnbits8": "MatMulNBits",
    "matmulnbits8_sym_b64_acc4": "MatMulNBits",
    "matmulnbits4_gidx_bias": "MatMulNBits",
    "qdq": "DequantizeLinear",
    "qdq_per_channel": "DequantizeLinear",
    "dynamic": "MatMulInteger",
    "attention": "Attention",
    "merged_decoder": "If",
    "conv": "Conv",
}


def test_every_form_has_a_signature():
    assert set(SIGNATURE) == set(mf.FORMS)


@pytest.mark.parametrize("name", sorted(mf.FORMS))
def test_form_builds_loads_and_runs(tmp_path, name):
    path = mf.build(name, tmp_path / name / "model.onnx", mib=1)
    model = onnx.load(str(path), load_external_data=False)
    assert SIGNATURE[name] in {n.op_type for n in model.graph.node}
    weights = sum(f.stat().st_size for f in path.parent.iterdir())
    assert 0.5 * 2**20 < weights < 4 * 2**20
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y = session.run(None, mf.feeds(path, batch=2))[0]
    assert y.shape[0] == 2 and np.isfinite(y.astype(np.float32)).all() and np.abs(y).max() > 0


def test_merged_decoder_branches_differ(tmp_path):
    path = mf.build("merged_decoder", tmp_path / "model.onnx", mib=1)
    graph = onnx.load(str(path), load_external_data=False).graph
    outer = {t.name for t in graph.initializer}
    branches = [a.g for n in graph.node if n.op_type == "If" for a in n.attribute]
    assert len(branches) == 2
    for g in branches:  # the branches' MatMuls use the main graph's weights, as optimum's merged decoder
        assert not g.initializer
        assert all(n.input[1] in outer for n in g.node if n.op_type == "MatMul")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    past, fresh = (session.run(None, mf.feeds(path, use_cache_branch=b))[0] for b in (True, False))
    assert not np.array_equal(past, fresh)


def test_rebuild_does_not_grow_the_data_file(tmp_path):
    first = mf.build("fp32", tmp_path / "model.onnx", mib=1)
    size = (tmp_path / "model.data").stat().st_size
    mf.build("fp32", first, mib=1)
    assert (tmp_path / "model.data").stat().st_size == size
