"""The runtime children of check, inspect and verify are bounded in memory; a model the runtime refuses fails check.

Before: models built here: a model of a few hundred bytes whose one ``Expand`` asks onnxruntime for a
[20000, 20000] float tensor (1.6 GB; its shape computed from the input, so that no static size estimate sees
it), a model with an op of a custom domain and one stamped opset 99 (onnxruntime 1.32 refuses both).
Under test: ``weightshare check`` / ``inspect`` / ``verify`` as a user runs them, the memory bound's formula
(``_runtimes/bound.py``), and the ``runtime-refuses-model`` finding.
After: the Expand model is "not measured" / "not verified" in one line naming ``--child-memory``, and the whole
process tree's peak RSS stayed within the bound (on 89e1c40: check 6.6 GB, verify 3.3 GB, no line); the refused
models exit 1 with an error finding (on 89e1c40: exit 0, a ``note:``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from weightshare._runtimes import bound

pytest.importorskip("onnxruntime")


def _expand_bomb(path: Path, n: int = 20000) -> Path:
    """y = Expand(x, [n, n]) with the shape computed from x (x * 0 + [n, n]): small file, n*n floats at run time."""
    inits = [
        helper.make_tensor("c", TensorProto.FLOAT, [2], [n, n]),
        helper.make_tensor("z", TensorProto.FLOAT, [], [0.0]),
    ]
    nodes = [
        helper.make_node("Mul", ["x", "z"], ["x0"]),
        helper.make_node("Add", ["x0", "c"], ["s"]),
        helper.make_node("Cast", ["s"], ["s64"], to=TensorProto.INT64),
        helper.make_node("Expand", ["x", "s64"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "expand",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert path.stat().st_size < 300
    return path


def _run_tree(*args: object) -> tuple[int, str, int]:
    """`weightshare ARGS` in a child: (exit code, stdout + stderr, peak RSS in bytes of the child and every
    descendant it waited for: ``wait4``'s rusage folds reaped descendants' peaks in)."""
    env = {k: v for k, v in os.environ.items() if k != bound.ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightshare", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, out, usage.ru_maxrss * 1024


def test_formula_and_override(monkeypatch):
    monkeypatch.delenv(bound.ENV, raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert bound.child_memory_bytes(300 << 20) == 600 * (1 << 20) + bound.FLOOR_BYTES + bound.PER_CPU_BYTES * cpus
    monkeypatch.setenv(bound.ENV, "700")
    assert bound.child_memory_bytes(300 << 20) == 700 << 20


@pytest.mark.slow
def test_check_measures_the_expand_model_within_the_bound(tmp_path):
    # one run's output 3.6 GB: over the bound in a session's first run (at 20000, 1.6 GB a run, only three arena
    # sessions held at once went over it; check now opens one)
    model = _expand_bomb(tmp_path / "expand.onnx", 30000)
    limit = bound.child_memory_bytes(model.stat().st_size)
    code, out, peak = _run_tree("check", model)
    assert code == 0, out  # over the bound is not a failure by itself
    lines = [line for line in out.splitlines() if "not measured" in line]
    assert lines and all("--child-memory MIB" in line for line in lines), out
    assert "runtime-refuses-model" not in out  # out of memory is not a refusal
    assert peak <= limit, f"peak {peak >> 20} MiB over the bound {limit >> 20} MiB"


@pytest.mark.slow
def test_inspect_over_a_given_bound_is_one_line(tmp_path):
    model = _expand_bomb(tmp_path / "expand.onnx")
    code, out, peak = _run_tree("inspect", model, "--child-memory", "1024")
    assert code == 0, out
    notes = [line for line in out.splitlines() if "not measured" in line]
    assert len(notes) == 2, out  # both settings, one line each
    assert all("1024 MiB" in line and "--child-memory MIB" in line for line in notes), out
    assert "Traceback" not in out
    assert peak <= 1024 << 20


@pytest.mark.slow
def test_verify_over_the_bound_is_not_verified(tmp_path):
    model = _expand_bomb(tmp_path / "expand.onnx")
    limit = bound.child_memory_bytes(model.stat().st_size)
    code, out, peak = _run_tree("verify", model, model)
    assert code == 2, out  # verify cannot vouch for what it did not run; not a difference (exit 1) either
    lines = out.strip().splitlines()
    assert len(lines) == 1 and "not verified" in lines[0] and "--child-memory MIB" in lines[0], out
    assert peak <= limit, f"peak {peak >> 20} MiB over the bound {limit >> 20} MiB"


def test_verify_within_a_raised_bound_runs(tmp_path):
    """The option raises the bound: a smaller Expand (64 MiB) passes under an explicit 3 GiB."""
    model = _expand_bomb(tmp_path / "small.onnx", n=4096)
    code, out, _ = _run_tree("verify", model, model, "--child-memory", "3072", "--runs", "1")
    assert code == 0 and "ok: 1 runs" in out, out


def _refused(path: Path, kind: str) -> Path:
    if kind == "custom-domain":
        node = helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    else:
        node = helper.make_node("Relu", ["x"], ["y"])
        opsets = [helper.make_opsetid("", 99)]
    graph = helper.make_graph(
        [node],
        kind,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    onnx.save(helper.make_model(graph, opset_imports=opsets), path)
    return path


@pytest.mark.parametrize("kind", ["custom-domain", "opset-99"])
def test_check_fails_a_model_onnxruntime_refuses(tmp_path, kind):
    import onnxruntime

    model = _refused(tmp_path / f"{kind}.onnx", kind)
    with pytest.raises(Exception):  # noqa: B017 -- the premise: this onnxruntime refuses it
        onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    code, out, _ = _run_tree("check", model)
    assert code == 1, out
    errors = [line for line in out.splitlines() if ": error: runtime-refuses-model:" in line]
    assert len(errors) == 1, out  # one finding for both settings
    assert f"onnxruntime {onnxruntime.__version__}" in errors[0]
    assert "[ONNXRuntimeError]" not in errors[0]  # the reason, not ORT's wrapping
    assert "Traceback" not in out


def test_check_api_reports_the_refusal(tmp_path):
    import weightshare

    report = weightshare.check([_refused(tmp_path / "custom.onnx", "custom-domain")])
    assert not report.ok and report.exit_code == 1
    assert [f.code.value for f in report.findings] == ["runtime-refuses-model"]
