"""What one more ONNX Runtime session keeps beyond shared weights is told apart: weight bytes, or ORT's own state.

Before: deep, narrow models built in code (many nodes, few weights: ORT's per-session state grows with the node
count, not the weights): quantize_dynamic's int8 MLP (MatMulInteger, fused to DynamicQuantizeMatMul at
ORT_ENABLE_ALL), quantize_static's QDQ one (QLinearMatMul at ORT_ENABLE_ALL) and an optimum-style merged decoder
(both branches inside ``If`` on outer-scope weights), converted with ``--prepack``; the int8 original as it is (its
weights embedded: copied into every session).
Under test: the measuring child's breakdown (``measure.probe(..., explain=True)``: per-mapping PSS, the added
sessions' pages matched against the model's tensors) and ``check`` (child processes, real onnxruntime).
After: the breakdown accounts for the PSS growth; on the ``--prepack`` outputs it is ORT's state, no weight bytes, and
check passes with an ``ort-session-state`` line (it failed them before, "no known fix"); on the embedded original the
weight bytes found are the int8 weights, named, within a few percent of their size.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import model_forms as mf
import pytest

pytest.importorskip("onnxruntime")

MiB = 1 << 20
DIM, LAYERS = 32, 160  # ~1300 nodes after quantize_dynamic: ~4 MiB of ORT state per session, 0.9 MiB of int8 weights


def _int8(path: Path) -> Path:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        src = mf._save(mf._mlp(DIM, LAYERS, 0), Path(tmp) / "fp32.onnx", external=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        quantize_dynamic(str(src), str(path), weight_type=QuantType.QInt8)
    return path


def _qdq(path: Path) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self, model: str) -> None:
            self.batches = iter([mf.feeds(model, batch=1, seq=4, seed=s) for s in range(2)])

        def get_next(self):
            return next(self.batches, None)

    with tempfile.TemporaryDirectory() as tmp:
        src = str(mf._save(mf._mlp(DIM, LAYERS, 0), Path(tmp) / "fp32.onnx", external=True))
        path.parent.mkdir(parents=True, exist_ok=True)
        quantize_static(
            src,
            str(path),
            Reader(src),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
        )
    return path


def _merged(path: Path) -> Path:
    from onnx import TensorProto as T
    from onnx import helper as h

    def branch(name: str, x: str):
        nodes, inits = mf._mlp_nodes(DIM, LAYERS, 0, x=x)
        nodes[-1] = h.make_node("Identity", [nodes[-1].input[0]], [f"{name}.y"])
        return h.make_graph(nodes, name, [], [mf._io(f"{name}.y", T.FLOAT, None)]), inits

    with_past, inits = branch("with_past", "x_past")
    without, _ = branch("without_past", "x")
    nodes = [
        h.make_node("Add", ["x", "past"], ["x_past"]),
        h.make_node("If", ["use_cache_branch"], ["y"], then_branch=with_past, else_branch=without),
    ]
    inputs = [
        mf._io("x", T.FLOAT, ["batch", "seq", DIM]),
        mf._io("past", T.FLOAT, ["batch", "seq", DIM]),
        mf._io("use_cache_branch", T.BOOL, [1]),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    return mf._save(mf._model(nodes, inits, inputs, [mf._io("y", T.FLOAT, None)]), path, external=True)


BUILDERS = {"int8": _int8, "merged": _merged, "qdq": _qdq}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def prepacked(request, tmp_path_factory):
    from conftest import run_cli

    d = tmp_path_factory.mktemp(request.param)
    src = BUILDERS[request.param](d / "src" / "model.onnx")
    res = run_cli("convert", src, "-o", d / "out", "--prepack", "-q")
    assert res.returncode == 0, res.stderr
    return src, d / "out" / "model.onnx"


def _probe(model: Path, share: bool) -> dict:
    from weightshare._runtimes.memory import in_child
    from weightshare.formats.onnx.measure import MALLOC_ENV, SESSIONS

    return in_child(
        "weightshare.formats.onnx.measure",
        "probe",
        [str(model), share, SESSIONS, False, False, {}, {}, True],
        MALLOC_ENV,
    )


def _growth(res: dict) -> int:
    data = res["data_pss"]  # read after the first and the last session
    return (data[-1] - data[0]) // (res["sessions"] - 1)


@pytest.mark.slow
@pytest.mark.parametrize("share", [False, True], ids=["ort-default", "ort-disable-prepacking"])
def test_the_prepack_remainder_is_runtime_state_not_weights(prepacked, share):
    _src, model = prepacked
    res = _probe(model, share)
    b, growth = res["breakdown"], _growth(res)
    pages = b["pages"]
    assert growth >= 2 * MiB, growth  # the remainder this is about
    # the pages the added sessions made resident account for what PSS measured (the heap holds it all)
    assert abs(sum(pages.values()) - growth) <= 0.15 * growth + (256 << 10), (pages, growth)
    assert abs(b["pss"]["heap"] + b["pss"]["anonymous"] - growth) <= 0.1 * growth + (256 << 10), (b["pss"], growth)
    assert pages["runtime objects"] >= 0.8 * growth, (pages, growth)
    assert pages["weights"] <= 256 << 10, b


@pytest.mark.slow
def test_embedded_int8_weights_are_found_copied_and_named(tmp_path):
    from weightshare.formats.onnx.inventory import inventory_file

    src = _int8(tmp_path / "model.onnx")
    payloads = inventory_file(src, hash_payloads=False).payloads
    int8 = {p.name: p.nbytes for p in payloads if p.dtype == "INT8"}
    res = _probe(src, share=True)  # pre-packing off: ORT keeps each embedded weight as it is, in its heap
    b = res["breakdown"]
    # whole pages: the int8 weights, and the biases and scales that share their pages
    found, least, most = b["pages"]["weights"], sum(int8.values()), sum(p.nbytes for p in payloads)
    assert 0.9 * least <= found <= 1.1 * most + 4 * 4096 * LAYERS / 3, (b["pages"], least, most)
    assert b["tensors"] and all(name in int8 and ops == ["MatMulInteger"] for name, _n, ops in b["tensors"]), b
    assert b["pages"]["runtime objects"] >= 2 * MiB, b["pages"]


@pytest.mark.slow
def test_check_passes_a_prepack_output_whose_remainder_is_runtime_state(prepacked):
    from conftest import run_cli

    _src, model = prepacked
    res = run_cli("check", model, "--json", "--no-cache")
    doc = json.loads(res.stdout)
    findings = {f["code"]: f for f in doc["findings"]}
    assert res.returncode == 0, doc["findings"]
    assert "copied-per-session" not in findings
    state = findings["ort-session-state"]
    assert state["severity"] == "info" and "ONNX Runtime's own state" in state["message"], state
    assert not any("--prepack" in (f.get("fix") or "") for f in doc["findings"]), doc["findings"]
    (summary,) = doc["reports"]
    assert all(n < MiB for n in summary["copied_per_session_by_setting"].values()), summary


@pytest.fixture(scope="module")
def fp32_prepacked(tmp_path_factory):
    from conftest import run_cli

    d = tmp_path_factory.mktemp("fp32")
    src = mf.build("fp32", d / "src" / "m.onnx", mib=2)
    assert run_cli("convert", src, "-o", d / "out", "-q", "--prepack").returncode == 0
    return d / "out"


def _measured_fix(model: Path, measured: dict[str, int]) -> str:
    """The fix line check gives the copy one more session of ``model`` (a real inventory) keeps at ``measured``."""
    from weightshare._check import Gate, findings_for
    from weightshare._dispatch import inventory

    inv = inventory(model, hash_payloads=False)
    inv.measured, inv.measured_one_session = measured, dict.fromkeys(measured, 8 * MiB)
    (copy,) = [f for f in findings_for(inv, Gate()) if f.code.value == "copied-per-session"]
    return copy.fix


# a copy at default options only, none with pre-packing off: what a --prepack'd int8 BERT and its portable twin were
# measured at before the remainder was told apart (the twin: 18.6 MiB, its sessions pre-packing what the blob stores)
FIGURES = {"ort-disable-prepacking": 0, "ort-default": 4 * MiB}


def test_a_prepack_output_is_never_told_to_convert_with_prepack_again(fp32_prepacked):
    fix = _measured_fix(fp32_prepacked / "m.onnx", FIGURES)
    assert "convert with --prepack" not in fix and "re-run convert --prepack" not in fix, fix


def test_a_portable_twin_is_sent_to_its_packed_model_not_to_another_conversion(fp32_prepacked):
    fix = _measured_fix(fp32_prepacked / "m.portable.onnx", FIGURES)
    assert fix.startswith("open m.onnx") and "convert with --prepack" not in fix, fix


@pytest.mark.slow
def test_a_sampled_breakdown_tells_the_same_shares_as_the_whole(tmp_path, monkeypatch):
    """Beyond ``SAMPLE`` pages, evenly spread pages are classified and stand for all: on the embedded int8 model
    (weights copied into every session, and ORT's state) the classes come out within a few percent of all pages'."""
    from weightshare._runtimes import remainder as r
    from weightshare._runtimes.ort import new_session
    from weightshare.formats.onnx.inventory import inventory_file
    from weightshare.formats.onnx.remainder import sources

    src = _int8(tmp_path / "model.onnx")
    found = sources(src)
    first = r.snapshot([f for f, _t in found])
    sessions = [new_session(str(src), share=True, log_level=4, arena=False) for _ in range(3)]
    last = r.snapshot([f for f, _t in found])
    whole = r.breakdown(first, last, len(sessions), found)
    monkeypatch.setattr(r, "SAMPLE", max(64, whole["new_pages"] * len(sessions) // r.PAGE // 8))
    sampled = r.breakdown(first, last, len(sessions), found)
    assert sampled["new_pages"] == whole["new_pages"]
    for k, n in whole["pages"].items():
        assert abs(sampled["pages"][k] - n) <= 0.08 * whole["new_pages"], (k, sampled["pages"], whole["pages"])
    # the weights it names are the model's int8 weights (all of one size here: which five come first is a tie)
    int8 = {p.name for p in inventory_file(src, hash_payloads=False).payloads if p.dtype == "INT8"}
    assert sampled["tensors"] and {t[0] for t in sampled["tensors"]} <= int8, sampled["tensors"]
    del sessions


# --- the figure check reports against what the sessions hold, measured in onnxruntime itself ----------------------

WIDE, ROWS, OUTPUTS = 256, 512, 32  # each output and activation 0.5 MiB: below the measuring child's mmap threshold


def _int8_wide_outputs(path: Path) -> Path:
    """quantize_dynamic's int8 chain of 8 MatMuls [256, 256] (DynamicQuantizeMatMul at ORT_ENABLE_ALL, pre-packed by
    ``--prepack``; 0.5 MiB of weights) on x [1, 512, 256], returning 32 more outputs of 0.5 MiB (x + k): a run's
    outputs, freed after it, stay in glibc's heap whenever a block the run allocated sits above them, as a decoder's
    present key/values do."""
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(0)
    nodes, inits, outputs, x = [], [], [], "x"
    for i in range(8):
        inits.append(nh.from_array((rng.standard_normal((WIDE, WIDE)) / 16).astype(np.float32), f"w{i}"))
        nodes.append(h.make_node("MatMul", [x, f"w{i}"], [f"h{i}"]))
        x = f"h{i}"
    outputs.append(mf._io(x, T.FLOAT, [1, ROWS, WIDE]))
    for k in range(OUTPUTS):
        inits.append(nh.from_array(np.float32(k), f"c{k}"))
        nodes.append(h.make_node("Add", ["x", f"c{k}"], [f"o{k}"]))
        outputs.append(mf._io(f"o{k}", T.FLOAT, [1, ROWS, WIDE]))
    model = mf._model(nodes, inits, [mf._io("x", T.FLOAT, [1, ROWS, WIDE])], outputs)
    with tempfile.TemporaryDirectory() as tmp:
        src = mf._save(model, Path(tmp) / "fp32.onnx", external=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        quantize_dynamic(str(src), str(path), weight_type=QuantType.QInt8)
    return path


# onnxruntime alone (no weightshare code): 4 sessions opened and run once each, the CPU arena off and pre-packing as
# the setting says (check's measuring conditions), and the PSS of the process's data (anonymous memory, the heap and
# the model's files; code left out, whose PSS moves with other processes) after the first and the fourth, read once
# the allocator has handed its free pages back: what the sessions hold. Prints MiB per session more.
_REFERENCE = r"""
import ctypes, gc, os, sys
import numpy as np, onnxruntime as ort
model, prepacking, rows, wide = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
files = {os.path.realpath(os.path.join(os.path.dirname(model), f)) for f in os.listdir(os.path.dirname(model))}
def data():
    gc.collect(); ctypes.CDLL(None).malloc_trim(0)
    total, keep = 0, False
    for line in open("/proc/self/smaps"):
        p = line.split()
        if "-" in p[0] and not p[0].endswith(":"):
            path = p[5] if len(p) > 5 else ""
            keep = path in ("", "[heap]") or path.startswith("[anon") or os.path.realpath(path) in files
        elif p[0] == "Pss:" and keep:
            total += int(p[1]) * 1024
    return total
x = np.random.default_rng(0).standard_normal((1, rows, wide)).astype(np.float32)
held, figures = [], []
for i in range(4):
    o = ort.SessionOptions()
    o.enable_cpu_mem_arena = False
    o.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not prepacking:
        o.add_session_config_entry("session.disable_prepacking", "1")
    s = ort.InferenceSession(model, o, providers=["CPUExecutionProvider"])
    s.run(None, {"x": x})
    held.append(s)
    if i in (0, 3):
        figures.append(data())
print((figures[1] - figures[0]) / 3 / (1 << 20))
"""


def _reference(model: Path, prepacking: bool) -> float:
    import subprocess
    import sys

    from weightshare.formats.onnx.measure import MALLOC_ENV

    env = {**os.environ, **MALLOC_ENV}
    res = subprocess.run(
        [sys.executable, "-c", _REFERENCE, str(model), "1" if prepacking else "0", str(ROWS), str(WIDE)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return float(res.stdout.split()[-1]) * MiB


@pytest.mark.slow
def test_check_counts_no_more_than_the_sessions_hold_in_pss(tmp_path):
    """Before: the figures were read with the run's freed outputs still in the heap's free lists, by chance of the
    allocation order: check counted 1.0-4.6 MiB of weights per session under ort-disable-prepacking (4 runs) where
    the sessions hold 0.3 MiB, and the ort-session-state line reported 1.4-5.0 MiB kept."""
    from conftest import run_cli

    src = _int8_wide_outputs(tmp_path / "src" / "model.onnx")
    assert run_cli("convert", src.parent, "-o", tmp_path / "out", "--prepack", "-q").returncode == 0
    model = tmp_path / "out" / "model.onnx"
    res = run_cli("check", model, "--json", "--no-cache")
    doc = json.loads(res.stdout)
    (summary,) = doc["reports"]
    counted = summary["copied_per_session_by_setting"]
    held = {"ort-disable-prepacking": _reference(model, False), "ort-default": _reference(model, True)}
    assert all(n < MiB for n in held.values()), held  # the model this is about: its sessions hold little
    for setting, n in held.items():
        assert counted[setting] <= n + (256 << 10), (setting, counted, held)
    for f in doc["findings"]:  # the growth it reports, when it breaks one down, is the one measured here
        kept = re.search(r"under (\S+) keeps ([\d.]+) MiB \(PSS, measured\)", f["message"])
        if f["code"] == "ort-session-state" and kept:
            assert abs(float(kept[2]) * MiB - held[kept[1]]) <= 512 << 10, (f["message"], held)
    assert res.returncode == 0, doc["findings"]


def test_the_measuring_child_takes_the_parents_listing_unless_a_file_changed(tmp_path, monkeypatch):
    """check lists a model's tensors when it reads the model; its measuring child is handed that list instead of
    parsing the model again (0.2 CPU s a T5 decoder), and lists it itself when a file changed in between."""
    from weightshare._dispatch import inventory
    from weightshare.formats.onnx import inventory as listing
    from weightshare.formats.onnx import remainder

    src = mf.build("fp32", tmp_path / "m.onnx", 1)
    inventory(src)  # as check reads it
    handed = json.loads(json.dumps(remainder.handed(src)))  # through the child's pipe
    assert handed and any(f != str(src) and tensors for f, tensors in handed["table"]), handed

    def parsed(*_a, **_k):
        raise AssertionError("parsed again")

    monkeypatch.setattr(listing, "inventory_file", parsed)
    remainder._LAST.clear()  # a fresh child
    remainder.adopt(src, handed)
    assert remainder.sources(src) == [(f, [tuple(t) for t in ts]) for f, ts in handed["table"]]
    data = next(Path(f) for f, _t in handed["table"] if f != str(src))
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # its weights rewritten since
    remainder._LAST.clear()
    remainder.adopt(src, handed)
    with pytest.raises(AssertionError, match="parsed again"):
        remainder.sources(src)


def test_the_measuring_child_indexes_a_models_sources_once_for_both_settings(tmp_path, monkeypatch):
    """Each setting's call of the measuring child is handed the same listing: the second keeps the list the first
    adopted, so that the breakdown's index of the model's tensors (0.1-0.3 CPU s a T5 decoder) is built once."""
    import numpy as np

    from weightshare._dispatch import inventory
    from weightshare._runtimes import remainder as pages
    from weightshare.formats.onnx import remainder

    src = mf.build("fp32", tmp_path / "m.onnx", 1)
    inventory(src)
    handed = json.loads(json.dumps(remainder.handed(src)))
    remainder._LAST.clear()  # a fresh child
    built = []

    class Counted(pages._Index):
        def __init__(self, sources):
            built.append(1)
            super().__init__(sources)

    monkeypatch.setattr(pages, "_Index", Counted)
    pages._INDEX.clear()
    for _setting in range(2):
        remainder.adopt(src, json.loads(json.dumps(handed)))  # each call's arguments come through the pipe anew
        found = remainder.sources(src)
        first = pages.snapshot([f for f, _t in found])
        held = np.ones(5 << 20)  # 40 MiB made resident between the snapshots (mmapped, above any threshold)
        last = pages.snapshot([f for f, _t in found])
        assert pages.breakdown(first, last, 1, found)["new_pages"] >= 1 << 20
        del held
    assert len(built) == 1
    pages._INDEX.clear()
