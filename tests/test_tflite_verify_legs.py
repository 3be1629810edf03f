"""TFLite ``verify`` on real model shapes, on every leg.

An LM-like model (EMBEDDING_LOOKUP + GATHER by int32 token ids) needs in-range ids, read from the graph, on every
leg: the Interpreter without and with XNNPACK, CompiledModel for --external, CompiledModel + the --prepack cache.
A model without SignatureDefs runs as the primary subgraph everywhere. An unexpected exception in any leg is an
"internal error" (one line, exit 2), never swallowed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import flatbuffers
import numpy as np
import pytest
from tflite_fixtures import OP, ModelBuilder, lm_model, s

from weightshare._dispatch import verify
from weightshare.api import convert
from weightshare.options import ConvertOptions

CONVERSIONS = {"plain": {}, "external": {"external": True}, "prepack": {"prepack": True}}


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    made = {}
    for sig in (True, False):
        src = lm_model(root / f"lm_{'sig' if sig else 'nosig'}.tflite", signature=sig)
        for name, opts in CONVERSIONS.items():
            out = root / f"{src.stem}_{name}"
            convert(src, out, ConvertOptions(**opts))
            made[(sig, name)] = (src, out / src.name)
    return made


@pytest.mark.covers("tflite", "verify")
@pytest.mark.parametrize("sig", [True, False], ids=["signature", "no-signature-defs"])
@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_verify_passes_on_an_lm_without_inputs(lms, sig, conversion):
    src, out = lms[(sig, conversion)]
    report = verify(src, out, runs=2)
    assert report.passed, report.mismatches
    expected = {"plain": 2, "external": 1, "prepack": 3}[conversion]  # legs that ran
    assert len(report.paths) == expected, report.paths
    if conversion == "prepack":
        assert any("XNNPACK weight cache" in p for p in report.paths)


def _runtime_half_here(monkeypatch):
    """verify runs its runtime half in a bounded child (``_runtimes/memory.verify_bounded``); in this process
    instead, unbounded, so that what the test patches here is what runs."""
    import importlib

    import weightshare._runtimes.memory as M

    def here(module, func, report, original, converted, opts, broken, largest):
        getattr(importlib.import_module(module), func)(report, original, converted, opts, broken)

    monkeypatch.setattr(M, "verify_bounded", here)


def test_given_input_is_used_on_every_leg(lms, monkeypatch):
    """--input reaches every leg, the CompiledModel + cache leg included (it used to feed random ints)."""
    import weightshare._runtimes.litert as L
    from weightshare._verify import OriginalFails

    src, out = lms[(True, "prepack")]
    given = np.arange(8, dtype=np.int32) * 100
    seen: list[tuple[str, np.ndarray]] = []
    real_entry, real_compiled = L.EntryPoint.__call__, L.CompiledEntry.__call__

    def entry(self, feeds):
        seen.append(("Interpreter", feeds["token_ids"]))
        return real_entry(self, feeds)

    def compiled(self, feeds):
        seen.append(("CompiledModel", feeds["token_ids"]))
        return real_compiled(self, feeds)

    monkeypatch.setattr(L.EntryPoint, "__call__", entry)
    monkeypatch.setattr(L.CompiledEntry, "__call__", compiled)
    _runtime_half_here(monkeypatch)  # the spies are in this process: verify's runtime half runs here too
    assert verify(src, out, runs=1, inputs={"token_ids": given}).passed
    assert {k for k, _ in seen} == {"Interpreter", "CompiledModel"} and len(seen) == 6  # 3 legs x (A, B)
    assert all(np.array_equal(v, given) for _, v in seen)
    with pytest.raises(OriginalFails, match="--input token_ids"):
        verify(src, out, runs=1, inputs={"token_ids": np.full(8, 5000, np.int32)})


def _custom_model(path: Path, custom: str) -> Path:
    mb = ModelBuilder()
    g = mb.subgraph("m")
    x = g.input("x", [1, 4])
    y = g.tensor("y", [1, 4], "float32")
    g.op(OP.CUSTOM, [x, x], [y])
    g.outputs = [y]
    mb.signature("serving_default", g)
    m = s.ModelT.InitFromPackedBuf(mb.to_bytes(), 0)
    m.operatorCodes[0].customCode = custom
    b = flatbuffers.Builder(1024)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    path.write_bytes(bytes(b.Output()))
    return path


@pytest.mark.parametrize(("custom", "cause"), [("FlexAddV2", "Flex delegate"), ("MyOp", "custom op")])
def test_hint_names_the_real_cause(tmp_path, custom, cause):
    from weightshare._verify import OriginalFails

    src = _custom_model(tmp_path / "m.tflite", custom)
    with pytest.raises(OriginalFails) as e:
        verify(src, src, runs=1)
    assert cause in str(e.value) and "--input" not in str(e.value)


# Started with every Python process of the run (the CLI and verify's runtime child, ``verify_bounded``): the leg
# named by INJECT_LEG raises, wherever LiteRT runs.
_INJECTION = """
import os
leg = os.environ.get("INJECT_LEG")
if leg:
    import weightshare._runtimes.litert as L

    def boom(*a, **k):
        raise ZeroDivisionError("injected into " + leg)

    if leg in L.MODES:  # one Interpreter mode
        real_open = L.open_mode
        L.open_mode = lambda path, mode: boom() if mode == leg else real_open(path, mode)
    elif leg == "CompiledModel":
        L.CompiledEntry.__call__ = boom
    elif leg == "cache":
        real_cep = L.compiled_entry_points
        L.compiled_entry_points = lambda m, i, c=None, **k: boom() if c else real_cep(m, i, c, **k)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("leg", "conversion"),
    [("no delegate", "plain"), ("XNNPACK", "plain"), ("CompiledModel", "external"), ("cache", "prepack")],
)
def test_injected_exception_in_a_leg_is_an_internal_error(lms, leg, conversion, tmp_path):
    src, out = lms[(True, conversion)]
    (tmp_path / "sitecustomize.py").write_text(_INJECTION)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSHARE_DEBUG"} | {"INJECT_LEG": leg, "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "weightshare", "verify", str(src), str(out), "--runs", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]  # nothing else: no LiteRT teardown logs either
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 1 and "internal error: ZeroDivisionError: injected into " + leg in lines[0], r.stderr
    if leg == "cache":
        debug = subprocess.run(cmd, capture_output=True, text=True, env={**env, "WEIGHTSHARE_DEBUG": "1"})
        assert debug.returncode != 0 and "Traceback" in debug.stderr and "injected into cache" in debug.stderr


@pytest.mark.slow
def test_bench_feeds_in_range_ids_and_given_inputs(lms, tmp_path):
    """bench used to feed random ints to EMBEDDING_LOOKUP and call LiteRT's refusal an internal error."""
    from weightshare._bench import bench
    from weightshare.errors import Unsupported
    from weightshare.formats.tflite.measure import measure_interpreters

    src, _out = lms[(True, "plain")]
    result = bench(src, [1], workdir=tmp_path)
    assert {(r["variant"], r["mode"]) for r in result["rows"]} >= {("original", "XNNPACK"), ("converted", "XNNPACK")}
    bad = tmp_path / "ids.npy"
    np.save(bad, np.full(8, 5000, np.int32))
    with pytest.raises(Unsupported, match="index out of bounds"):
        measure_interpreters(str(src), [1], True, {"token_ids": str(bad)})
