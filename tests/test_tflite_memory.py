"""Invariant 1 for TFLite: converting never holds a payload; peak RSS stays flat as the model grows.

Before: two models, one with a few KiB of weights and one with a 96 MiB fp16 constant behind DEQUANTIZE.
Under test: conversion in a fresh child process (ru_maxrss of RUSAGE_CHILDREN).
After: the big conversion (192 MiB of fp32 written) peaks within 24 MiB of the small one.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as s
from tflite_fixtures import OP, ModelBuilder

_PROBE = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)
_CONVERT = "import sys; from weightshare.api import convert; convert(sys.argv[1], sys.argv[2])"


def _model(path, elements: int):
    mb = ModelBuilder()
    g = mb.subgraph("g")
    x = g.input("x", [1, elements])
    w = g.dequantize("w", (np.arange(elements) % 2048).astype(np.float16).reshape(1, elements))
    y = g.tensor("y", [1, elements], "float32")
    g.op(OP.ADD, [x, w], [y], s.BuiltinOptions.AddOptions, s.AddOptionsT())
    g.outputs = [y]
    return mb.save(path)


def _peak_rss_mib(src, out) -> float:
    cmd = [sys.executable, "-c", _PROBE, sys.executable, "-c", _CONVERT, str(src), str(out)]
    return int(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1]) / 1024


@pytest.mark.slow
def test_peak_rss_flat_as_model_grows(tmp_path):
    small = _peak_rss_mib(_model(tmp_path / "small.tflite", 4096), tmp_path / "a")
    big_src = _model(tmp_path / "big.tflite", 48 << 20)
    big = _peak_rss_mib(big_src, tmp_path / "b")
    assert (tmp_path / "b" / "big.tflite").stat().st_size > 192 << 20
    assert big - small < 24, f"peak RSS grew from {small:.1f} MiB to {big:.1f} MiB"


_INTERPRETERS = """
import sys, numpy as np
from ai_edge_litert.interpreter import Interpreter, OpResolverType
def pss():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
base = pss()
keep = []
for _ in range(int(sys.argv[2])):
    it = Interpreter(model_path=sys.argv[1],
                     experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    run = it.get_signature_runner("g")
    run(x=np.ones((1, 4096), np.float32))
    keep.append((it, run))
print(pss() - base)
"""


def _fc_model(path):
    mb = ModelBuilder()
    g = mb.subgraph("g")
    x = g.input("x", [1, 4096])
    w = g.dequantize("w", (np.arange(1024 * 4096) % 1999 - 999).astype(np.float16).reshape(1024, 4096))
    y = g.tensor("y", [1, 1024], "float32")
    g.op(OP.FULLY_CONNECTED, [x, w, -1], [y], s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    g.outputs = [y]
    mb.signature("g", g)
    return mb.save(path)


def _pss_growth_mib(path, n: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETERS, str(path), str(n)], check=True, capture_output=True, text=True
    ).stdout
    return float(out.split()[-1])


@pytest.mark.slow
def test_eight_interpreters_share_the_converted_weights(tmp_path):
    """16 MiB of fp32 weights (8 MiB fp16 + DEQUANTIZE): 8 interpreters of the converted model cost about one."""
    src = _fc_model(tmp_path / "fc.tflite")
    convert_out = tmp_path / "out"
    subprocess.run([sys.executable, "-c", _CONVERT, str(src), str(convert_out)], check=True)
    one, eight = (_pss_growth_mib(convert_out / src.name, n) for n in (1, 8))
    original_eight = _pss_growth_mib(src, 8)
    # each interpreter past the first keeps its own state (tensor arena, op data: ~0.2 MiB here), never the weights:
    # below check's 1 MiB per-instance line, whatever the run's noise (a 1.10x bound on the total: 18.1 vs 16.4 failed)
    assert (eight - one) / 7 < 1.0, f"8 interpreters: {eight:.1f} MiB, one: {one:.1f} MiB"
    assert original_eight > 4 * one  # the original pays a private fp32 copy per interpreter
