"""check measures a folder in one runtime child, and a warm check or inspect starts none; counted, never timed.

Before: `check` of a `--prepack` folder of 3 models (6 models with the portable twins) started 12 children, one
per model and setting, each importing python, numpy and onnxruntime again and spinning its sessions' threads after
each run (cold: 3.8x the CPU of the conversion it judges, scripts/bench_check_cost.txt); `inspect` never used
check's measured verdicts; a warm check of an fp16 model still started the `--unpack ort-cpu` probe's ORT child.
Under test: `weightshare.check` and `_check.inspected` in this process, ``subprocess.Popen`` wrapped to count the
children they start (calling through to the real one: the children run the real onnxruntime), and the measuring
child's trace (``WEIGHTSHARE_MEASURE_TRACE``: one line per model and setting, with its pid and the sessions it
opened and found still open); ``_runtimes.memory.in_worker`` on plain library functions for its failure paths.
After: one child measures the 6 models one after another, each setting's 4 sessions (+3 with the arena on at the
defaults) closed before the next opens; a warm check, an inspect after it, and a warm check of an fp16 model start
no child; a call that kills or stalls its child is answered as a fresh child's would be.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import weightshare

sys.path.insert(0, str(Path(__file__).parent))
import model_forms as mf  # noqa: E402

pytest.importorskip("onnxruntime")


@pytest.fixture
def started(monkeypatch):
    """The argv of every child process started from now on (every runtime child goes through subprocess.Popen)."""
    argvs: list[list[str]] = []
    real = subprocess.Popen

    class Counting(real):  # type: ignore[misc,valid-type]
        def __init__(self, args, *a, **k):
            argvs.append([str(x) for x in args])
            super().__init__(args, *a, **k)

    monkeypatch.setattr(subprocess, "Popen", Counting)
    return argvs


@pytest.fixture
def trace(tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("WEIGHTSHARE_MEASURE_TRACE", str(path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache-home"))

    def lines() -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return lines


def _prepack_folder(tmp_path: Path) -> Path:
    """The bench's folder (scripts/bench_check.py --cost), small: an fp32 MLP, a Conv net, a merged decoder."""
    src = tmp_path / "src"
    mf.build("fp32", src / "mlp.onnx", 0.5)
    mf.build("conv", src / "cnn.onnx", 0.25)
    mf.build("merged_decoder", src / "decoder_model_merged.onnx", 0.25)
    weightshare.convert_folder(src, tmp_path / "out", prepack=True)
    return tmp_path / "out"


@pytest.mark.slow
def test_a_prepack_folder_is_measured_by_one_child_one_model_at_a_time(tmp_path, started, trace):
    out = _prepack_folder(tmp_path)
    started.clear()  # the conversion's own children
    report = weightshare.check([out])
    models = sorted(Path(m.model).name for m in report.models)
    assert len(models) == 6 and sum(".portable." in m for m in models) == 3, models
    # every model measured in the runtime under both settings, as before
    assert all(set(m.measured) == {"ort-disable-prepacking", "ort-default"} for m in report.models), [
        (m.model, m.measured, m.measure_notes) for m in report.models
    ]
    assert report.exit_code == 0, [f.line() for f in report.findings]
    assert len(started) == 1, [a[:2] for a in started]  # d9d5adc: 12 (one per model and setting)
    lines = trace()
    assert len({line["pid"] for line in lines}) == 1
    # model after model (a figure near a line measured again right away: check's repeats), each setting's
    # sessions in turn, none of an earlier call still open
    order = [Path(line["model"]).name for line in lines]
    assert [n for i, n in enumerate(order) if i == 0 or order[i - 1] != n] == [
        Path(m.model).name for m in report.models
    ]
    assert all(line["earlier_alive"] == 0 for line in lines), lines
    for m in report.models:
        mine = [(line["share"], line["sessions"]) for line in lines if Path(line["model"]).name == Path(m.model).name]
        if ".portable." in m.model:
            # a twin is not packed again at default options: its packed model's blob holds what this runtime
            # packs of it (f3774c5: [(True, 4), (False, 2)], its copy held twice)
            assert mine[:1] == [(True, 4)] and (False, 2) not in mine, mine
            assert any("not measured again" in n for n in m.measure_notes), m.measure_notes
            continue
        assert mine[:2] == [(True, 4), (False, 5)], mine  # 4 per setting, 1 more: arena on (f3774c5: 3 more)
        assert all(n == 4 for _, n in mine[2:]), mine  # repeats near a line: those settings only, arena off
    # warm: the verdicts reused, no child at all, for check and for inspect after it
    started.clear()
    again = weightshare.check([out])
    assert started == [] and all(m.measured_cached for m in again.models)
    assert [f.line() for f in again.findings] == [f.line() for f in report.findings]
    from weightshare._check import inspected

    inv = inspected(out / "mlp.onnx")
    assert started == [] and inv.measured_cached, inv.measure_notes


@pytest.mark.slow
def test_a_warm_check_of_an_fp16_model_asks_onnxruntime_nothing(tmp_path, started, trace):
    model = mf.build("fp16", tmp_path / "m.onnx", 0.25)
    first = weightshare.check([model])
    (inv,) = first.models
    casts = [n for n in inv.notes if "casts" in n and "fp16 initializers" in n]
    assert casts and started  # the --unpack ort-cpu probe's child and the measuring child
    started.clear()
    again = weightshare.check([model])
    assert started == [], started  # d9d5adc: the probe's ORT child again
    (inv2,) = again.models
    assert inv2.measured_cached and [n for n in inv2.notes if n in casts] == casts


def test_a_child_is_reused_and_one_that_dies_or_stalls_is_replaced(monkeypatch):
    from weightshare._runtimes.bound import ChildMemory, OverBound
    from weightshare._runtimes.memory import in_worker, reused_children

    memory = ChildMemory(4 << 30)
    with reused_children():
        a = in_worker("os", "getpid", [], None, 30, memory)
        assert in_worker("os", "getpid", [], None, 30, memory) == a != os.getpid()  # one child, reused
        with pytest.raises(RuntimeError, match="failed in a child process"):
            in_worker("os", "_exit", [3], None, 30, memory)
        b = in_worker("os", "getpid", [], None, 30, memory)
        assert b != a  # a fresh child after the one that died
        # a child that dies as one over its bound does (SIGABRT) is asked once more in a fresh child, and only a
        # fresh child's death is the bound's
        with pytest.raises(OverBound):
            in_worker("os", "abort", [], None, 30, memory)
        with pytest.raises(RuntimeError, match="did not finish within"):
            in_worker("time", "sleep", [30], None, 0.5, memory)
        c = in_worker("os", "getpid", [], None, 30, memory)
        assert c not in (a, b)
        # an answer the caller says a fresh child must give again (a runtime's own out-of-memory answer)
        assert in_worker("os", "getpid", [], None, 30, memory, lambda answer: answer == c) != c
    # outside the block: a fresh child per call, as in_child
    assert in_worker("os", "getpid", [], None, 30, memory) != in_worker("os", "getpid", [], None, 30, memory)
