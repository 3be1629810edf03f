"""check and bench on the layouts real TFLite exporters write.

Before: models built as MediaPipe's ``.task`` members are (no SignatureDef, 0-d activations:
``tflite_fixtures.mediapipe_member``) and as litert-torch writes an LM (two signatures, a 0-d intermediate:
``two_signature_lm(scalar=True)``), as given and converted with ``--prepack``. Under test: `check --json`
(LiteRT in measuring children) and `bench`. After: every setting is measured (no child crash on a 0-d tensor; a
model without SignatureDef measured through ``weightshare.litert``), the JSON labels a figure "measured" only when
it was, bench runs the helper on a model without signatures, and a copy under a loader that does not read the
cache names that loader's fix, not another conversion.
"""

from __future__ import annotations

import json

import pytest
from tflite_fixtures import mediapipe_member, two_signature_lm

pytest.importorskip("ai_edge_litert")


def _summary(cli, *args) -> tuple[dict, dict]:
    res = cli("check", *args, "--json")
    doc = json.loads(res.stdout)
    return doc["reports"][0], doc


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["mediapipe-member", "litert-torch-lm"])
def test_check_measures_models_with_0d_tensors(cli, tmp_path, layout):
    if layout == "mediapipe-member":
        model = mediapipe_member(tmp_path / "face_blendshapes.tflite")
    else:
        model = two_signature_lm(tmp_path / "lm.tflite", vocab=512, width=64, scalar=True)
    summary, _doc = _summary(cli, model)
    assert not [n for n in summary["measure_notes"] if "could not measure" in n], summary["measure_notes"]
    by = summary["copies_source_by_setting"]
    assert by["litert-builtin"] == by["litert-xnnpack"] == "measured", summary
    assert summary["copies_source"] == "measured"  # the default setting (litert-xnnpack) was measured


@pytest.mark.slow
def test_a_figure_is_measured_only_when_it_was(cli, tmp_path):
    """A plain model has no cache: litert-compiled-cache keeps its static figure, and a gate held to it says so."""
    model = mediapipe_member(tmp_path / "m.tflite")
    summary, doc = _summary(cli, model, "--target", "litert-compiled-cache")
    assert summary["copies_source_by_setting"]["litert-compiled-cache"] == "static"
    assert summary["copies_source"] == "static", summary
    summary, doc = _summary(cli, model, "--target", "litert-compiled-cache", "--target", "litert-xnnpack")
    assert summary["copies_source"] == "partly measured", summary


@pytest.mark.slow
def test_check_measures_a_prepack_output_without_signatures_through_the_helper(cli, tmp_path):
    """MediaPipe's members have no SignatureDef: the helper runs them through the Interpreter calls (CompiledModel's
    placeholder signature), and a copy under the classic Interpreter's XNNPACK names the helper as the fix."""
    model = mediapipe_member(tmp_path / "face_blendshapes.tflite", width=1024)
    assert cli("convert", model, "-o", tmp_path / "out", "--prepack", "-q").returncode == 0
    out = tmp_path / "out" / model.name
    summary, doc = _summary(cli, out)
    assert summary["default_setting"] == "litert-compiled-cache"
    assert not [n for n in summary["measure_notes"] if "refuses" in n or "could not" in n], summary["measure_notes"]
    assert summary["copies_source_by_setting"]["litert-compiled-cache"] == "measured", summary
    assert summary["copied_per_session_by_setting"]["litert-compiled-cache"] < 1 << 20
    (xnnpack,) = [f for f in doc["findings"] if f["code"] == "copied-per-session"]
    assert "litert-xnnpack" in xnnpack["message"]
    assert "re-run convert --prepack" not in xnnpack["fix"] and "weightshare.litert" in xnnpack["fix"], xnnpack


@pytest.mark.slow
def test_bench_runs_the_helper_on_a_model_without_signatures(cli, tmp_path):
    model = mediapipe_member(tmp_path / "face_detector.tflite")
    res = cli("bench", model, "--sessions", "1,2", "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["reports"][0]["rows"]
    assert any(r["variant"] == "converted --prepack" for r in rows), rows


def _same(a, b) -> bool:
    """Details equal in every field (numpy arrays element for element, dicts recursively)."""
    import numpy as np

    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.slow
def test_helper_lists_details_exactly_as_litert(tmp_path):
    """The helper's get_input_details()/get_output_details(), per signature and for the primary subgraph, equal
    LiteRT's Interpreter's in order and in every field (index, name, dtype, shape, shape_signature, quantization
    and its parameters, sparsity): code that fills inputs by position gets the same tensors. Models: the
    litert-torch LM layout (two signatures; SignatureDef order tokens, input_pos, kv_cache_k_0, kv_cache_v_0, which
    LiteRT lists sorted), the sample model (an int8 signature with quantized inputs) and a MediaPipe member
    (no SignatureDef)."""
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter
    from tflite_fixtures import sample_model

    from weightshare.api import convert
    from weightshare.litert import interpreter
    from weightshare.options import ConvertOptions

    models = [
        two_signature_lm(tmp_path / "lm.tflite", vocab=256, width=32, scalar=True),
        sample_model(tmp_path / "sample.tflite"),
        mediapipe_member(tmp_path / "member.tflite"),
    ]
    for src in models:
        convert(src, tmp_path / "out", ConvertOptions(prepack=True))
        out = tmp_path / "out" / src.name
        ref, it = Interpreter(model_path=str(out)), interpreter(out)
        assert it.weightshare_cache is not None
        assert _same(it.get_signature_list(), ref.get_signature_list())
        for key in ref.get_signature_list():
            ra, rb = ref.get_signature_runner(key), it.get_signature_runner(key)
            assert _same(rb.get_input_details(), ra.get_input_details()), (src.name, key)
            assert _same(rb.get_output_details(), ra.get_output_details()), (src.name, key)
            feeds = {n: np.zeros(d["shape"], d["dtype"]) for n, d in ra.get_input_details().items()}
            assert list(rb(**feeds)) == list(ra(**feeds)), (src.name, key)  # results in LiteRT's order too
        if not ref.get_signature_list() or any(
            ref.get_signature_runner(k)._subgraph_index == 0 for k in ref.get_signature_list()
        ):
            assert _same(it.get_input_details(), ref.get_input_details()), src.name
            assert _same(it.get_output_details(), ref.get_output_details()), src.name
        it.close()


@pytest.mark.slow
def test_sparse_rule_matches_what_litert_copies(cli, tmp_path):
    """A sparse (DENSIFY) --prepack output, 2 MiB dense: the static per-setting figures are within 2x of LiteRT's
    measured ones (the rule said 2 MiB under the default XNNPACK delegate, which keeps 4.7: its dense copy beside
    the packed weights, also under CompiledModel with the cache); the rule is held to the gate's threshold like any
    copy (a threshold above every figure passes); a measured copy names --unpack sparse as its fix."""
    from tflite_fixtures import sparse_model

    src = sparse_model(tmp_path / "sparse.tflite", rows=1024, cols=512)
    assert cli("convert", src, "-o", tmp_path / "out", "--prepack", "-q").returncode == 0
    out = tmp_path / "out" / src.name
    (doc,) = json.loads(cli("inspect", out, "--json").stdout)["reports"]
    for setting, measured in doc["measured"].items():
        static = doc["static_copied_per_session_by_setting"][setting]
        assert measured / 2 <= static <= measured * 2, (setting, static, measured)
    loose = cli("check", out, "--threshold", str(16 << 20))
    assert loose.returncode == 0, loose.stdout + loose.stderr
    summary, checked = _summary(cli, out)
    assert summary["copies_source"] == "measured"
    measured = [f for f in checked["findings"] if f["code"] == "copied-per-session"]
    assert measured and all("--unpack sparse" in f["fix"] for f in measured), measured
    static = [f for f in checked["findings"] if f["code"] == "unpacked-per-session"]
    assert [f["severity"] for f in static] == ["info"], static  # the measured figure decides
