"""Shape-only ops of weights folded into the blob (``formats/onnx/fold_shape.py``).

Before: a plain conversion kept genai's tied-embedding ``Transpose(lm_head.MatMul.weight)``; ONNX Runtime folded it
into a heap tensor in every session, so the portable route (``session.disable_prepacking=1``) paid the embedding's
size per session (Gemma2 fp32: +63 MiB). After: the conversion stores the transposed tensor in the blob (bit-exact,
and says what it adds), a weight read only through a constant Reshape is stored in its reshaped form, and one more
session at the sharing setting keeps nothing of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import weightshare
from weightshare._tensors import FileRange, fp16_to_fp32

sys.path.insert(0, str(Path(__file__).parent))
import model_forms as mf  # noqa: E402

VOCAB, HIDDEN = 4096, 256


def _initializers(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.slow
def test_a_tied_heads_transpose_is_folded_into_the_blob_bit_exact(tmp_path):
    src = mf.tied_head(tmp_path / "src" / "model.onnx", vocab=VOCAB, hidden=HIDDEN)
    report = weightshare.convert(src, tmp_path / "out")
    out = tmp_path / "out" / "model.onnx"
    model = onnx.load(str(out), load_external_data=False)
    assert [n.op_type for n in model.graph.node if n.op_type == "Transpose"] == []
    before, after = _initializers(src), _initializers(out)
    table = after["/model/embed_tokens/Transpose/output_0"]
    assert table.shape == (VOCAB, HIDDEN) and np.array_equal(table, before["lm_head.MatMul.weight"].T)
    assert np.array_equal(after["lm_head.MatMul.weight"], before["lm_head.MatMul.weight"])  # still read by lm_head
    note = next(n for n in report.notes if "shape-only ops" in n)
    assert f"the blob holds {VOCAB * HIDDEN * 4 / (1 << 20):.1f} MiB more" in note, note
    # outputs byte for byte at batch 1, 8 and 64 (verify's default runs)
    res = weightshare.verify(src, out)
    assert res.passed and res.runs == 3, res.mismatches


@pytest.mark.slow
def test_a_weight_read_only_through_a_reshape_is_stored_reshaped(tmp_path):
    src = mf.tied_head(tmp_path / "src" / "model.onnx", vocab=512, hidden=HIDDEN, reshaped=True)
    weightshare.convert(src, tmp_path / "out")
    out = tmp_path / "out" / "model.onnx"
    model = onnx.load(str(out), load_external_data=False)
    assert "Reshape" not in [n.op_type for n in model.graph.node if "proj" in n.output[0]]
    after = _initializers(out)
    assert "proj.weight3d" not in after  # replaced, not kept beside its folded form
    assert np.array_equal(after["proj.weight"], _initializers(src)["proj.weight3d"].reshape(HIDDEN, HIDDEN))
    assert weightshare.verify(src, out, runs=1).passed


@pytest.mark.slow
def test_the_sharing_setting_keeps_nothing_of_a_folded_transpose(cli, tmp_path):
    """ONNX Runtime itself asked (check's measuring child): one more session at session.disable_prepacking=1 keeps
    the tied head's transposed copy before, nothing after."""
    src = mf.tied_head(tmp_path / "src" / "model.onnx", vocab=VOCAB, hidden=HIDDEN)
    weightshare.convert(src, tmp_path / "out")
    res = cli("check", tmp_path / "out" / "model.onnx", "--target", "ort-disable-prepacking", "--json")
    doc = json.loads(res.stdout)
    assert res.returncode == 0, doc["findings"]
    (inv,) = doc["reports"]
    assert inv["copies_source"] == "measured"
    assert inv["copied_per_session_by_setting"]["ort-disable-prepacking"] < VOCAB * HIDDEN * 4 // 4


@pytest.mark.parametrize(("dims", "perm"), [((5, 7), (1, 0)), ((3, 4, 5), (2, 0, 1)), ((3, 4, 5), (1, 2, 0))])
def test_transposed_source_streams_slabs_equal_to_numpy(tmp_path, monkeypatch, dims, perm):
    """Slabs far smaller than the tensor (as a 2 GiB embedding meets the 16 MiB slab), any permutation, with and
    without the fp16 -> fp32 conversion of a folded Cast."""
    import weightshare.formats.onnx.fold_shape as fs

    monkeypatch.setattr(fs, "SLAB_BYTES", 24)
    rng = np.random.default_rng(0)
    data = rng.standard_normal(dims).astype(np.float16)
    path = tmp_path / "payload.bin"
    path.write_bytes(b"xx" + data.tobytes())
    base = FileRange(str(path), 2, data.nbytes)
    expected = np.ascontiguousarray(data.transpose(perm))
    got = b"".join(bytes(c) for c in fs.TransposedSource(base, fs.Layout(dims, perm), 2, 2).chunks())
    assert got == expected.tobytes()
    got = b"".join(bytes(c) for c in fs.TransposedSource(base, fs.Layout(dims, perm), 2, 4, fp16_to_fp32).chunks())
    assert got == expected.astype(np.float32).tobytes()
