"""Every input bounded by what it can justify.

Before: a 400-byte ONNX model whose constant part is ConstantOfShape([N, N]) feeding a chain of MatMuls (onnxruntime's
constant folding evaluates it while optimizing); a model whose input's last dim is named only by a lying
``config.json`` (hidden_size 50,000,000); a verdict cache written 150 times.
Under test: ``weightshare convert --prepack`` (CLI), ``ort_limits.limits_for``, ``weightshare verify`` (CLI, in a
child whose peak RSS is measured), ``ort_verdict.remember_intact``.
After: the folding bomb is refused in one line, exit 2, nothing in OUTDIR, within 60 s (before: busy until the
child's 300 s wall limit); a model of a few hundred bytes gets a wall limit of seconds; verify's generated
inputs stay far below 500 MiB; the verdict cache holds at most ``MAX_ENTRIES`` entries and none older than
``MAX_AGE_S``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from weightshare.formats.onnx.ort import verdict as ort_verdict
from weightshare.formats.onnx.ort.limits import limits_for


def folding_bomb(path, n: int, steps: int):
    shape = numpy_helper.from_array(np.array([n, n], np.int64), "dims")
    fill = helper.make_tensor("fill", TensorProto.FLOAT, [1], [0.25])
    nodes = [helper.make_node("ConstantOfShape", ["dims"], ["k0"], value=fill)]
    for i in range(1, steps + 1):
        nodes.append(helper.make_node("MatMul", [f"k{i - 1}", "k0"], [f"k{i}"]))
    nodes.append(helper.make_node("ReduceSum", [f"k{steps}"], ["total"], keepdims=0))  # a tiny folded result
    nodes.append(helper.make_node("Add", ["features", "total"], ["scores"]))
    graph = helper.make_graph(
        nodes,
        "bomb",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 3])],
        [shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path.write_bytes(model.SerializeToString())
    return path


def test_a_folding_bomb_is_refused_within_a_minute(tmp_path):
    bomb = folding_bomb(tmp_path / "tiny.onnx", n=3072, steps=9)
    assert bomb.stat().st_size < 500
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "weightshare", "convert", str(bomb), "-o", str(out), "--prepack"],
        capture_output=True,
        text=True,
        timeout=60,  # the bound; before: the child ran until its 300 s wall limit
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "constant folding" in lines[0] and "--ort-max-growth" in lines[0], res.stderr
    assert not out.exists() or not any(out.iterdir())


def test_a_tiny_model_gets_seconds_not_minutes():
    small = limits_for(400, "tiny.onnx")
    assert small.wall_s <= 60 and small.cpu_s <= 60 * (os.cpu_count() or 1)
    assert limits_for(1 << 30, "big.onnx").wall_s >= 600  # a real model still gets what its size justifies


@pytest.mark.slow
def test_verify_with_a_lying_config_stays_small(tmp_path, cli):
    src = tmp_path / "src"
    src.mkdir()
    nodes = [
        helper.make_node("ReduceMean", ["encoder_hidden_states"], ["m"], keepdims=0),
        helper.make_node("Add", ["m", "bias"], ["pooled"]),
    ]
    graph = helper.make_graph(
        nodes,
        "pool",
        [helper.make_tensor_value_info("encoder_hidden_states", TensorProto.FLOAT, ["batch", "seq", "width"])],
        [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, [])],
        [helper.make_tensor("bias", TensorProto.FLOAT, [], [0.5])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    (src / "encoder.onnx").write_bytes(model.SerializeToString())
    (src / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 50_000_000}))
    out = tmp_path / "out"
    assert cli("convert", src / "encoder.onnx", "-o", out).returncode == 0
    measure = (
        "import resource, subprocess, sys\n"
        "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.stderr.write(r.stderr)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", measure, sys.executable, "-m", "weightshare", "verify", str(src / "encoder.onnx"),
         str(out / "encoder.onnx")],
        capture_output=True,
        text=True,
    )  # fmt: skip
    code, peak_kib = map(int, res.stdout.split())
    assert peak_kib < 500 * 1024, (peak_kib, res.stderr)
    assert code == 2 and "--dim" in res.stderr, res.stderr  # the config's width is not taken; the user gives it
    res = cli("verify", src / "encoder.onnx", out / "encoder.onnx", "--dim", "width=64")
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_verdict_cache_is_pruned(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for i in range(ort_verdict.MAX_ENTRIES + 22):
        ort_verdict.remember_intact((1, i, 2, 3, 4), "ab" * 32)
    d = ort_verdict.cache_dir()
    assert d is not None
    entries = [p for p in d.iterdir() if p.name != "key"]
    assert len(entries) == ort_verdict.MAX_ENTRIES
    assert ort_verdict.is_intact((1, ort_verdict.MAX_ENTRIES + 21, 2, 3, 4), "ab" * 32)  # the newest are kept
    old = time.time() - ort_verdict.MAX_AGE_S - 60
    for p in entries[:5]:
        os.utime(p, (old, old))
    ort_verdict.remember_intact((9, 9, 9, 9, 9), "cd" * 32)
    assert not any(p.exists() for p in entries[:5])
    assert len([p for p in d.iterdir() if p.name != "key"]) == ort_verdict.MAX_ENTRIES - 4


def test_check_does_not_hand_a_folding_bomb_to_onnxruntime(tmp_path):
    """check's measuring child has convert's bounds: the folding bomb is never given to onnxruntime (before: the
    child had neither the folding bound nor a wall limit and ran for minutes)."""
    bomb = folding_bomb(tmp_path / "tiny.onnx", n=3072, steps=9)
    res = subprocess.run(
        [sys.executable, "-m", "weightshare", "check", str(bomb)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "not given to onnxruntime: onnxruntime's constant folding would compute" in res.stderr, res.stderr
