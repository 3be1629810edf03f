"""convert --prepack on the forms LLM teams ship (model_forms): MatMulNBits, QDQ, dynamic int8, Attention,
an If-merged decoder, fp16, Conv. For each: the output opens in a plain default-option InferenceSession,
bit-identical to the original; the blob carries a packed entry for exactly the weights (and kernels) ORT's
own whole-model session saves; the portable model is bit-identical under disable_prepacking; the report
names every weight-bearing op type with what was packed and why the rest was not."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import model_forms as mf
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from weightshare.formats.onnx.graph import external_tensors
from weightshare.formats.onnx.ort.prepack import PREPACKED_ENTRY
from weightshare.formats.onnx.ort.types import all_nodes

# Forms whose weights ORT's CPU kernels pre-pack at default options (on every x86-64/arm64 CPU ORT runs on),
# and the op type that does it; the others (MatMulNBits 8-bit with zero points at accuracy 0, with g_idx)
# are packed by nothing in ORT 1.32 and must say so.
PACKING_OP = {
    "fp32": "MatMul",
    "fp16": "MatMul",
    "fp16_cast": "MatMul",
    "matmulnbits4": "com.microsoft.MatMulNBits",
    "matmulnbits4_sym_b128_acc4": "com.microsoft.MatMulNBits",
    "matmulnbits8_sym_b64_acc4": "com.microsoft.MatMulNBits",
    "qdq": "QLinearMatMul",
    "qdq_per_channel": "QLinearMatMul",
    "dynamic": "com.microsoft.DynamicQuantizeMatMul",
    "attention": "com.microsoft.Attention",
    "merged_decoder": "MatMul",
    "conv": "Gemm",
    "llama": "MatMul",
    "llama_fp16": "MatMul",
}


# The op each form must contain once written: what makes it that form (else the tests below convert something
# else than what they name).
FORM_OP = {
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


def test_every_form_of_the_corpus_is_named_by_its_op():
    assert set(FORM_OP) == set(mf.FORMS)


def _assert_is_the_form(name: str, src: Path) -> None:
    """What the corpus promises of a form, checked where it is converted: its op, its size (``mib=1``), and for
    the merged decoder optimum's layout (both branches' MatMuls read the main graph's weights)."""
    model = onnx.load(str(src), load_external_data=False)
    assert FORM_OP[name] in {n.op_type for n in model.graph.node}
    weights = sum(f.stat().st_size for f in src.parent.iterdir())
    assert 0.5 * 2**20 < weights < 4 * 2**20
    if name == "merged_decoder":
        outer = {t.name for t in model.graph.initializer}
        branches = [a.g for n in model.graph.node if n.op_type == "If" for a in n.attribute]
        assert len(branches) == 2
        for g in branches:
            assert not g.initializer
            assert all(n.input[1] in outer for n in g.node if n.op_type == "MatMul")


# Variants of a form another parameter already covers run in the slow tier only (each costs a conversion).
VARIANTS = {
    "matmulnbits4_sym_b128_acc4",
    "matmulnbits8_sym_b64_acc4",
    "qdq_per_channel",
    "fp32",
    "conv",
    "llama",
    "llama_fp16",
}


@pytest.fixture(
    scope="module",
    params=[pytest.param(n, marks=pytest.mark.slow) if n in VARIANTS else n for n in sorted(mf.FORMS)],
)
def converted(request, tmp_path_factory):
    from conftest import run_cli

    d = tmp_path_factory.mktemp(request.param)
    src = mf.build(request.param, d / "src" / "model.onnx", mib=1)
    _assert_is_the_form(request.param, src)
    res = run_cli("convert", src, "-o", d / "out", "--prepack", "--json", "-q")
    assert res.returncode == 0, res.stderr
    return request.param, src, json.loads(res.stdout)["reports"][0]


def _ort_packed(src: Path, tmp: Path) -> set[tuple[str, str]]:
    """(initializer, kernel key) of every pre-packed copy ORT's own default-option session of ``src`` saves;
    its optimized graph at ``tmp``/ort.onnx."""
    return _packed(ort_saved_session(src, tmp))


def ort_saved_session(src: Path, tmp: Path) -> Path:
    """ORT's own default-option session of ``src``, saved with its pre-packed copies: ``tmp``/ort.onnx."""
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp / "ort.onnx")
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "ort.bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    so.log_severity_level = 3
    ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    return tmp / "ort.onnx"


def _packed(path: Path) -> set[tuple[str, str]]:
    model = onnx.load(str(path), load_external_data=False)
    return {
        (t.name, e.value.split("|")[0])
        for t in external_tensors(model)
        for e in t.external_data
        if e.key.startswith(PREPACKED_ENTRY)
    }


def _runs(src: Path) -> list[tuple[int, dict[str, np.ndarray]]]:
    """(batch, feeds) at batch 1 and 8, both branches of a merged decoder."""
    branches = (True, False) if src.parent.parent.name.startswith("merged_decoder") else (True,)
    return [(b, mf.feeds(src, batch=b, use_cache_branch=c)) for b in (1, 8) for c in branches]


@pytest.mark.slow
def test_prepacked_model_is_bit_identical_at_default_options(converted):
    _, src, report = converted
    original, prepacked = ort.InferenceSession(str(src)), ort.InferenceSession(report["outputs"][0])
    seen = []
    for batch, feeds in _runs(src):
        a, b = original.run(None, feeds)[0], prepacked.run(None, feeds)[0]
        assert a.dtype == b.dtype and np.array_equal(a, b)
        # outputs worth comparing: one row per input row, finite, not all zero
        assert a.shape[0] == batch
        assert np.isfinite(a.astype(np.float32)).all() and np.abs(a).max() > 0
        seen.append(a)
    if src.parent.parent.name.startswith("merged_decoder"):  # each branch computes its own (batch 1: runs 0, 1)
        assert not np.array_equal(seen[0], seen[1])


def test_portable_model_is_bit_identical_without_prepacking(converted):
    _, src, report = converted
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    original, portable = (ort.InferenceSession(str(p), so) for p in (src, report["outputs"][1]))
    for _, feeds in _runs(src):
        assert np.array_equal(original.run(None, feeds)[0], portable.run(None, feeds)[0])


def test_blob_holds_exactly_the_packs_ort_makes(converted, tmp_path):
    name, src, report = converted
    expected = _ort_packed(src, tmp_path)
    assert bool(expected) == (name in PACKING_OP)
    assert _packed(Path(report["outputs"][0])) == expected  # same weights, same kernel+content keys
    # and the same optimized graph, subgraphs included (QDQ pairs fused, no DequantizeLinear left over)
    assert _ops(Path(report["outputs"][0])) == _ops(tmp_path / "ort.onnx")


def _ops(path: Path) -> Counter[str]:
    model = onnx.load(str(path), load_external_data=False)
    return Counter(f"{n.domain}.{n.op_type}" for n, _ in all_nodes(model.graph))


def test_report_names_what_was_packed_and_why_not(converted):
    name, _, report = converted
    ops = report["prepack"]["ops"]
    assert ops, "every form has weight-bearing nodes"
    for op, tally in ops.items():
        assert tally["packed"] + sum(tally["not_packed"].values()) == tally["nodes"], op
    notes = "\n".join(report["notes"])
    if name in PACKING_OP:
        assert ops[PACKING_OP[name]]["packed"] == ops[PACKING_OP[name]]["nodes"] > 0
        assert f"{PACKING_OP[name]}: {ops[PACKING_OP[name]]['nodes']} of " in notes
    else:
        nbits = ops["com.microsoft.MatMulNBits"]
        assert nbits["packed"] == 0 and nbits["not_packed"] == {"its kernel pre-packs nothing here": nbits["nodes"]}
        assert "not packed: its kernel pre-packs nothing here" in notes
