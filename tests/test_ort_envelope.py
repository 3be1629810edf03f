"""The envelope a ``--prepack`` output is exact in: the onnxruntime version, CPU kind and session-option
class recorded at conversion. ``weightshare.ort.session`` keeps the packed graph only inside it; outside it opens the
portable model at the caller's options (the original's outputs there), never ``disable_prepacking`` unless the
caller asks (``share_with_other_numerics``); it refuses a portable twin of another conversion."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import model_forms as mf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from prepack_samples import mixed_onnx, sample_input

import weightshare.ort as wort
from weightshare.errors import InvalidModel
from weightshare.formats.onnx.ort.prepack import portable_name
from weightshare.formats.onnx.ort.prepack_record import PAIR_KEY
from weightshare.formats.onnx.ort.probe import cpu_kind

LEVELS = ["ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED"]


def _convert(src: Path, out: Path, *extra: str) -> dict:
    from conftest import run_cli

    res = run_cli("convert", src, "-o", out, "--prepack", "--json", "-q", *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["reports"][0]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    d = tmp_path_factory.mktemp("envelope")
    src = mixed_onnx(d / "mixed.onnx", conv_layers=2, channels=32, mm_layers=3, dim=256)
    report = _convert(src, d / "out")
    return src, Path(report["outputs"][0])


@pytest.fixture(scope="module")
def fp16(tmp_path_factory):
    d = tmp_path_factory.mktemp("envelope16")
    src = mf.build("fp16", d / "src" / "model.onnx", mib=1)
    report = _convert(src, d / "out")
    return src, Path(report["outputs"][0])


def _so(level: str = "ORT_ENABLE_ALL", **attrs) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    for k, v in attrs.items():
        setattr(so, k, v)
    return so


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "weightshare.ort"]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(wort, "_warned", set())


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("model", ["mixed", "fp16"])
def test_a_level_below_enable_all_opens_the_portable_model_exact_at_that_level(request, model, level, caplog):
    src, packed = request.getfixturevalue(model)
    with caplog.at_level(logging.INFO, logger="weightshare.ort"):
        sess = wort.session(packed, _so(level))
    original = ort.InferenceSession(str(src), _so(level), providers=["CPUExecutionProvider"])
    said = _said(caplog)
    assert len(said) == 1 and level in said[0] and portable_name(packed.name) in said[0], said
    assert "MiB per session" in said[0]
    for batch in (1, 4):
        feeds = mf.feeds(src, batch) if model == "fp16" else sample_input(src, batch)
        assert _equal(sess.run(None, feeds), original.run(None, feeds)), (level, batch)


# one non-default value per allowed attribute: the packed graph stays, and stays exact
ALLOWED = {
    "enable_cpu_mem_arena": False,
    "enable_mem_pattern": False,
    "enable_mem_reuse": False,
    "execution_mode": ort.ExecutionMode.ORT_PARALLEL,
    "inter_op_num_threads": 2,
    "intra_op_num_threads": 1,
    "log_severity_level": 3,
    "log_verbosity_level": 1,
    "logid": "envelope",
    "profile_file_prefix": "p_",
    "use_per_session_threads": True,
}


def test_the_allow_list_is_what_the_loader_keeps():
    assert set(ALLOWED) | {"enable_profiling"} == set(wort.KEEPS_PACKED)


@pytest.mark.parametrize("attr", sorted(ALLOWED))
def test_every_allowed_option_keeps_the_packed_graph_exact(mixed, attr, caplog):
    src, packed = mixed
    with caplog.at_level(logging.INFO, logger="weightshare.ort"):
        sess = wort.session(packed, _so(**{attr: ALLOWED[attr]}))
    assert "prepacked graph" in _said(caplog)[0]
    original = ort.InferenceSession(str(src), _so(**{attr: ALLOWED[attr]}), providers=["CPUExecutionProvider"])
    for batch in (1, 4):
        feeds = sample_input(src, batch)
        assert _equal(sess.run(None, feeds), original.run(None, feeds))


@pytest.mark.parametrize(
    "options",
    [
        {"config": ("session.set_denormal_as_zero", "1")},
        {"config": ("session.disable_prepacking", "1")},
        {"attrs": {"use_deterministic_compute": True}},
        {"kwargs": {"disabled_optimizers": ["ConstantFolding"]}},
    ],
)
def test_an_option_outside_the_allow_list_opens_the_portable_model(mixed, options, caplog):
    src, packed = mixed
    so = _so(**options.get("attrs", {}))
    if "config" in options:
        so.add_session_config_entry(*options["config"])
    with caplog.at_level(logging.INFO, logger="weightshare.ort"):
        wort.session(packed, so, **options.get("kwargs", {}))
    assert "not using its pre-packed weights" in _said(caplog)[0]


def test_another_onnxruntime_falls_back_exactly_and_names_both(mixed, monkeypatch, caplog):
    src, packed = mixed
    here = wort.this_machine()
    monkeypatch.setattr(wort, "_machine", {**here, "onnxruntime": "1.99.0"})
    with caplog.at_level(logging.WARNING, logger="weightshare.ort"):
        sess = wort.session(packed)
    (said,) = _said(caplog)
    kind = cpu_kind(here["cpu_features"], here["machine"])
    assert f"onnxruntime {ort.__version__} on {kind}" in said and "onnxruntime 1.99.0" in said
    original = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    for batch in (1, 4):  # the original at the same (default) options, not under disable_prepacking
        feeds = sample_input(src, batch)
        assert _equal(sess.run(None, feeds), original.run(None, feeds))


def test_sharing_with_other_numerics_is_the_callers_choice(mixed, monkeypatch, caplog):
    src, packed = mixed
    monkeypatch.setattr(wort, "_machine", {**wort.this_machine(), "onnxruntime": "1.99.0"})
    with caplog.at_level(logging.WARNING, logger="weightshare.ort"):
        sess = wort.session(packed, share_with_other_numerics=True)
    assert "share_with_other_numerics" in _said(caplog)[0]
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    original = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    feeds = sample_input(src, 4)
    assert _equal(sess.run(None, feeds), original.run(None, feeds))


def test_the_record_names_the_envelope(mixed):
    _src, packed = mixed
    info, _blob = wort.prepack_info(packed)
    here = wort.this_machine()
    assert info["onnxruntime"] == ort.__version__
    assert info["cpu_kind"] == cpu_kind(here["cpu_features"], here["machine"])
    assert info["session_options"].startswith("ORT_ENABLE_ALL")


def test_both_models_carry_one_pair_id(mixed):
    _src, packed = mixed
    ids = [
        {p.key: p.value for p in onnx.load(str(m), load_external_data=False).metadata_props}.get(PAIR_KEY)
        for m in (packed, packed.parent / portable_name(packed.name))
    ]
    assert ids[0] and ids[0] == ids[1]


@pytest.mark.slow
def test_a_foreign_portable_twin_is_refused(mixed, tmp_path, monkeypatch):
    """A portable model of another conversion left beside the packed one (a stale twin, a copy): refused, not
    opened, when the loader falls back."""
    src, packed = mixed
    out = tmp_path / "out"
    shutil.copytree(packed.parent, out)
    other = mixed_onnx(tmp_path / "mixed.onnx", conv_layers=2, channels=32, mm_layers=3, dim=256, seed=5)
    second = Path(_convert(other, tmp_path / "other")["outputs"][0])
    for f in second.parent.iterdir():
        if f.name != packed.name:
            shutil.copy(f, out / f.name)
    monkeypatch.setattr(wort, "_machine", {**wort.this_machine(), "onnxruntime": "1.99.0"})
    with pytest.raises(InvalidModel, match="was not converted with it"):
        wort.session(out / packed.name)


def test_the_fp16_forms_overridable_initializers_are_explained_first(fp16, caplog):
    """ORT advises removing initializers from the graph inputs; for the fp16 form that would let it fold the Cast
    the original runs at every run: weightshare's own line says so before ORT's advice."""
    _src, packed = fp16
    inputs = {i.name for i in onnx.load(str(packed), load_external_data=False).graph.input}
    inits = {i.name for i in onnx.load(str(packed), load_external_data=False).graph.initializer}
    if not inputs & inits:
        pytest.skip("this fp16 form keeps no overridable initializer on this CPU")
    with caplog.at_level(logging.WARNING, logger="weightshare.ort"):
        wort.session(packed)
    said = _said(caplog)
    assert any("graph inputs on purpose" in s and "remove_initializer_from_input" in s for s in said), said


@pytest.mark.slow
def test_check_judges_a_packed_output_for_the_runtime_it_will_run_under(mixed):
    from conftest import run_cli

    _src, packed = mixed
    here = wort.this_machine()
    kind = cpu_kind(here["cpu_features"], here["machine"])
    same = run_cli("check", packed, "--no-measure", "--json")
    assert same.returncode == 0, same.stdout + same.stderr
    (inv,) = json.loads(same.stdout)["reports"]
    assert inv["judged_for"].startswith(f"judged for onnxruntime {ort.__version__} on {kind} (this machine)")
    assert inv["packed_for"]["version"] == ort.__version__
    other = run_cli("check", packed, "--no-measure", "--runtime", "1.22.1/avx2")
    assert other.returncode == 1
    assert "packed-for-other-runtime" in other.stdout
    assert f"packed for onnxruntime {ort.__version__} on {kind}" in other.stdout and "1.22.1 on avx2" in other.stdout
    assert run_cli("check", packed, "--no-measure", "--runtime", f"{ort.__version__}/{kind}").returncode == 0
    bad = run_cli("check", packed, "--no-measure", "--runtime", "latest")
    assert bad.returncode == 2 and "--runtime takes VERSION" in bad.stderr


def test_verify_names_the_version_mismatch(mixed, monkeypatch):
    from importlib import import_module

    import weightshare
    from weightshare._runtimes import memory

    src, packed = mixed
    monkeypatch.setattr(ort, "__version__", "1.99.0")  # what verify reads of the runtime it runs under
    # verify's runtime half runs in a bounded child, which the patched version would not reach: run it here
    monkeypatch.setattr(
        memory, "call_in_child", lambda module, func, args, *_: getattr(import_module(module), func)(*args)
    )
    report = weightshare.verify(src, packed)
    said = " ".join(report.notes + report.mismatches)
    assert "was packed for onnxruntime" in said and "this machine runs onnxruntime 1.99.0" in said


def test_a_raw_load_under_an_older_onnxruntime_fails_instead_of_computing_otherwise(mixed, tmp_path):
    """The prepacked model imports ORT's internal NHWC domain at the converting release's newest opset: the
    release that converted loads it (exact: the other tests), an older one, knowing fewer opsets, refuses it.
    Shown here by stamping one opset past what this release knows (what an older release sees)."""
    from weightshare.formats.onnx.ort.probe import STAMP_DOMAIN, opset_stamp

    src, packed = mixed
    m = onnx.load(str(packed), load_external_data=False)
    (stamp,) = [o.version for o in m.opset_import if o.domain == STAMP_DOMAIN]
    assert stamp == opset_stamp() > 0
    assert _equal(
        ort.InferenceSession(str(packed)).run(None, sample_input(src, 4)),
        ort.InferenceSession(str(src)).run(None, sample_input(src, 4)),
    )
    for o in m.opset_import:
        if o.domain == STAMP_DOMAIN:
            o.version = stamp + 1
    newer = packed.parent / "as_an_older_release_sees_it.onnx"
    onnx.save(m, str(newer))
    try:
        with pytest.raises(Exception, match=f"Opset {stamp + 1}"):
            ort.InferenceSession(str(newer))
    finally:
        newer.unlink()


def test_check_judges_the_runtime_installed_here_by_default(mixed, monkeypatch):
    """Without --runtime, check judges for the onnxruntime installed where it runs (read from its metadata)."""
    import importlib.metadata

    import weightshare

    _src, packed = mixed
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda n: "1.22.1" if n == "onnxruntime" else real(n))
    result = weightshare.check([packed], measure=False)
    (finding,) = [f for f in result.findings if f.code.value == "packed-for-other-runtime"]
    assert result.exit_code == 1 and "this machine runs onnxruntime 1.22.1" in finding.message
    assert f"packed for onnxruntime {ort.__version__}" in finding.message
