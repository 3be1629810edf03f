"""`check` on an encoder-decoder family as optimum exports it (Whisper: encoder_model.onnx, the merged decoder with
an ``If`` on use_cache_branch, config.json), against what onnxruntime really keeps per session.

Before: check measured the merged decoder unrun ("inputs could not be generated": no head sizes, no encoder
states), and nothing tested its figure on this family. Under test: ``weightshare.check`` with no options on the
plain and the --prepack conversion of the folder (``tests/model_forms.whisper_family``, 17 MiB of decoder
weights). After: the plain conversion fails at ORT's defaults (the MatMuls inside the If branches are pre-packed
per session), with a figure within 1.25x of an independent arena-off measurement, measured with a run on the
encoder's real outputs; the --prepack one passes.
"""

from __future__ import annotations

import pytest
from model_forms import whisper_family

import weightshare
from weightshare.options import ConvertOptions

pytest.importorskip("onnxruntime")
MiB = 1 << 20


@pytest.mark.slow
def test_a_whisper_export_s_plain_conversion_fails_at_ort_defaults_and_its_prepack_conversion_passes(tmp_path):
    from weightshare._runtimes.ort import measure_sessions
    from weightshare.formats.onnx.measure import MALLOC_ENV

    src = tmp_path / "whisper"
    whisper_family(src, dim=256, vocab=8192)
    weightshare.convert_folder(src, tmp_path / "plain")
    weightshare.convert_folder(src, tmp_path / "prepack", ConvertOptions(prepack=True))

    plain = tmp_path / "plain" / "decoder_model_merged.onnx"
    report = weightshare.check([plain])
    (inv,) = report.models
    assert report.exit_code == 1, report.findings  # measured: 9.9 MiB per session at ort-default, 0.3 sharing
    assert not any("without a run" in n for n in inv.measure_notes), inv.measure_notes
    assert any("encoder_hidden_states from encoder_model.onnx" in n for n in inv.measure_notes), inv.measure_notes
    figure = inv.measured["ort-default"]
    rows = {r["sessions"]: r for r in measure_sessions(str(plain), [1, 4], share=False, env=MALLOC_ENV, arena=False)}
    measured = (rows[4]["data_pss_mib"] - rows[1]["data_pss_mib"]) / 3 * MiB
    assert measured >= MiB and measured / 1.25 <= figure <= measured * 1.25, (figure, measured)

    report = weightshare.check([tmp_path / "prepack" / "decoder_model_merged.onnx"])
    assert report.exit_code == 0, report.findings


def test_a_familys_decoders_are_fed_by_one_encoder_run_until_the_encoder_changes(tmp_path, monkeypatch):
    """check measures a family's decoders one after another, each setting in turn: the encoder beside them runs
    once for all (same files, same sizes), and again once one of its files changes."""
    import os

    import onnxruntime as ort

    from weightshare.formats.onnx import decode

    files = whisper_family(tmp_path)
    decoder = next(f for f in files if f.name == "decoder_model_merged.onnx")
    opened: list[str] = []
    real = ort.InferenceSession.__init__

    def counting(self, path, *a, **k):  # the real session, counted
        opened.append(str(path))
        real(self, path, *a, **k)

    monkeypatch.setattr(ort.InferenceSession, "__init__", counting)
    inputs = ort.InferenceSession(str(decoder)).get_inputs()
    opened.clear()
    first = decode.encoder_states(decoder, inputs, {}, {})
    again = decode.encoder_states(decoder, inputs, {}, {})
    assert len(opened) == 1 and opened[0].endswith("encoder_model.onnx"), opened  # f3774c5: 2 runs
    assert again[0]["encoder_hidden_states"] is first[0]["encoder_hidden_states"] and again[1] == first[1]
    other = decode.encoder_states(decoder, inputs, {}, {"batch_size": 2})
    assert len(opened) == 2 and other[0]["encoder_hidden_states"].shape != first[0]["encoder_hidden_states"].shape
    encoder = tmp_path / "encoder_model.onnx"
    st = encoder.stat()
    os.utime(encoder, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a file changed: run again
    decode.encoder_states(decoder, inputs, {}, {"batch_size": 2})
    assert len(opened) == 3, opened
