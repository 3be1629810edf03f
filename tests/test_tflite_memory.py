"""Invariant 1 for TFLite: converting never holds a payload; peak RSS stays flat as the model grows.

Before: two models, one with a few KiB of weights and one with a 96 MiB fp16 constant behind DEQUANTIZE.
Under test: conversion in a fresh child process (ru_maxrss of RUSAGE_CHILDREN).
After: the big conversion (192 MiB of fp32 written) peaks within 24 MiB of the small one.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from ai_edge_litert import schema_py_generated as s

from tflite_fixtures import OP, ModelBuilder

_PROBE = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
          "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
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


def test_peak_rss_flat_as_model_grows(tmp_path):
    small = _peak_rss_mib(_model(tmp_path / "small.tflite", 4096), tmp_path / "a")
    big_src = _model(tmp_path / "big.tflite", 48 << 20)
    big = _peak_rss_mib(big_src, tmp_path / "b")
    assert (tmp_path / "b" / "big.tflite").stat().st_size > 192 << 20
    assert big - small < 24, f"peak RSS grew from {small:.1f} MiB to {big:.1f} MiB"
