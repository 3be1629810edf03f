"""verify holds one original and one converted runtime at a time.

Before: TFLite's verify opened both models on every LiteRT mode (no delegate, XNNPACK) before running the first,
so `verify --decode-steps 4` of an LM held four interpreters (a 128 MiB two-signature LM: 682 MiB largest process;
scripts/bench_check.py --cost); the child's memory bound counted a TFLite model whose buffers are appended to
itself twice.
Under test: the runtime half of verify (``verify_in_runtime``, in this process so that a hook sees every
interpreter it opens: ``open_mode`` wrapped, calling through to LiteRT) and ``bound.mapped_bytes``.
After: when an interpreter opens, at most one other of verify's is alive (the original of its pair); a model is
counted once.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
from tflite_fixtures import two_signature_lm

from weightshare._verify import VerifyReport
from weightshare.api import convert
from weightshare.options import ConvertOptions

pytest.importorskip("ai_edge_litert")


def test_tflite_verify_opens_one_pair_at_a_time(tmp_path, monkeypatch):
    import weightshare._runtimes.litert as L
    from weightshare.formats.tflite.verify import verify_in_runtime

    src = two_signature_lm(tmp_path / "lm.tflite")
    convert(src, tmp_path / "out", ConvertOptions())
    converted = tmp_path / "out" / src.name
    alive: list[weakref.ref] = []
    seen: list[int] = []
    real = L.open_mode

    def counting(model_path: str, mode: str):
        gc.collect()
        seen.append(sum(1 for r in alive if r() is not None))
        interpreter = real(model_path, mode)
        alive.append(weakref.ref(interpreter))
        return interpreter

    monkeypatch.setattr(L, "open_mode", counting)
    report = VerifyReport(str(src), str(converted), "tflite")
    opts = {"runs": 1, "dims": {}, "seed": 0, "inputs": {}, "shapes": {}, "decode_steps": 2}
    verify_in_runtime(report, src, converted, opts, False)
    assert report.passed and len(report.paths) == 2 and report.decode_steps == 2, report.mismatches
    assert len(seen) >= 4 and max(seen) <= 1, seen  # both modes ran, never more than the pair's original alive


def test_a_model_whose_buffers_are_appended_to_itself_is_counted_once(tmp_path):
    from weightshare._runtimes.bound import mapped_bytes
    from weightshare.formats.tflite.verify import mapped

    src = two_signature_lm(tmp_path / "lm.tflite")
    convert(src, tmp_path / "out", ConvertOptions())
    converted = tmp_path / "out" / src.name
    assert mapped(converted) == converted.stat().st_size
    assert mapped_bytes(Path(converted), [converted.name]) == converted.stat().st_size


def test_onnx_verify_runs_the_encoder_before_the_converted_decoder_opens(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    import decoder_fixtures as fx

    import weightshare
    import weightshare._runtimes.ort as O
    from weightshare.formats.onnx.verify import verify_in_runtime

    srcs = fx.t5_like(tmp_path / "t5")
    weightshare.convert_folder(tmp_path / "t5", tmp_path / "out")
    decoder = srcs[1]
    alive: list[weakref.ref] = []
    seen: list[int] = []
    real = O.new_session

    def counting(model, *a, **k):
        gc.collect()
        seen.append(sum(1 for r in alive if r() is not None))
        session = real(model, *a, **k)
        alive.append(weakref.ref(session))
        return session

    monkeypatch.setattr(O, "new_session", counting)
    report = VerifyReport(str(decoder), str(tmp_path / "out" / decoder.name), "onnx")
    opts = {"runs": 1, "dims": {}, "seed": 0, "inputs": {}, "shapes": {}, "decode_steps": 2}
    verify_in_runtime(report, decoder, tmp_path / "out" / decoder.name, opts, False)
    assert report.passed and report.decode_steps == 2, report.mismatches
    assert any("encoder_hidden_states from encoder_model.onnx" in n for n in report.notes), report.notes
    assert len(seen) == 3 and max(seen) <= 1, seen  # original, encoder, converted: never three at once
