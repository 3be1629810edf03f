"""--prepack packs the nodes a family has not packed yet in few ORT sessions, and probes no load twice.

Before: each weight-bearing node packed for the first time in a run had a session of its own (an optimum BART
folder: 105 sessions, ~7 ms each), and the load check opened the portable model again although the child had
just opened it whole. Under test, counted from the real child (the report's ``ort_sessions`` and
``pack_sessions``) and from the load probes the parent asks for: a generated decoder family's first model packs
its nodes in one session; packed node by node (``BATCH_ENV`` "0") the outputs are the same bytes; the
prepacked model computes the original's bits at batch 1 and 8; the portable model of a graph optimized in one
piece is not probed again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from model_forms import decoder_family

import weightshare
from weightshare.formats.onnx.ort import prepack
from weightshare.formats.onnx.ort.child import BATCH_ENV

pytestmark = pytest.mark.slow  # ORT children

FIRST = "decoder_model.onnx"  # the folder's first model: it packs what the others reuse


def _reports(src: Path, out: Path) -> dict[str, dict]:
    report = weightshare.convert_folder(src, out, prepack=True)
    return {Path(m.model).name: m.prepack for m in report.models}


def _files(d: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(d.iterdir()) if f.is_file() and not f.name.startswith(".")}


def test_new_nodes_of_a_family_are_packed_in_one_session_with_the_same_bytes(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    decoder_family(src)
    batched = _reports(src, tmp_path / "batched")
    first = batched[FIRST]
    assert first["node_sessions"] >= 5  # nodes that needed a packing of their own
    assert first["ort_sessions"] == 2, first  # the graph's optimization + one packing (base: 1 + node_sessions)
    assert first["pack_sessions"] == 1, first  # their weights within one batch: one session
    monkeypatch.setenv(BATCH_ENV, "0")
    alone = _reports(src, tmp_path / "alone")
    assert alone[FIRST]["pack_sessions"] == alone[FIRST]["node_sessions"] == first["node_sessions"]
    assert _files(tmp_path / "batched") == _files(tmp_path / "alone")
    model = tmp_path / "batched" / FIRST
    a, b = ort.InferenceSession(str(src / FIRST)), ort.InferenceSession(str(model))
    dim = a.get_inputs()[0].shape[-1]
    for batch in (1, 8):
        x = np.random.default_rng(batch).standard_normal((batch, 3, dim), dtype=np.float32)
        assert all(np.array_equal(p, q) for p, q in zip(a.run(None, {"x": x}), b.run(None, {"x": x}))), batch


def test_a_portable_model_opened_whole_by_the_child_is_not_probed_again(tmp_path, monkeypatch):
    probed: list[str] = []
    real = prepack.load_probes

    def counting(models, stage):  # noqa: ANN001, ANN202 - load_probes' own signature
        probed.extend(name for _model, name in models)
        return real(models, stage)

    monkeypatch.setattr(prepack, "load_probes", counting)
    src = tmp_path / "src"
    src.mkdir()
    decoder_family(src)
    reports = _reports(src, tmp_path / "out")
    assert all(r["segments"]["segments"] == 1 for r in reports.values())  # each optimized in one piece
    assert sorted(probed) == sorted(reports)  # the prepacked models only (base: their portable twins too)


def test_packings_a_later_model_copies_are_not_hashed_again(tmp_path, monkeypatch):
    """The merged decoder and decoder_with_past take the decoder's packings, copied into their blobs: adopted
    with the digest the decoder's blob computed (``StagedBlob.known``), not read back and hashed again."""
    from weightshare import _safetensors

    adopted: list[tuple[str, int]] = []
    real = _safetensors.SafetensorsBlob.adopt

    def counting(self, tensor, offset, prefix="", digest=None):  # noqa: ANN001, ANN202 - adopt's own signature
        adopted.append(("known" if digest else "hashed", tensor.nbytes))
        return real(self, tensor, offset, prefix, **({"digest": digest} if digest else {}))

    monkeypatch.setattr(_safetensors.SafetensorsBlob, "adopt", counting)
    src = tmp_path / "src"
    src.mkdir()
    decoder_family(src)
    reports = _reports(src, tmp_path / "out")
    assert reports[FIRST]["node_sessions"] >= 5 and reports["decoder_with_past_model.onnx"]["node_sessions"] == 0
    known = sum(n for how, n in adopted if how == "known")
    # every packed byte of the two later models is a copy of the first's (base: all hashed again)
    later = sum(reports[m]["packed_bytes"] for m in ("decoder_model_merged.onnx", "decoder_with_past_model.onnx"))
    assert known == later > 0, (known, later)
