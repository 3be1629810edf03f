"""Every ``--external`` output of the TFLite test corpus loads and runs in CompiledModel.

A sparse tensor moved to an external buffer made an output CompiledModel cannot load ("Insufficient buffer
size") with exit 0; it is now refused with the --unpack sparse hint, and with --unpack sparse it loads.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_tflite_dequantize import fc_model
from tflite_fixtures import ModelBuilder, float_graph, int8_graph, lm_model, sample_model, sparse_model

from weightshare._runtimes.litert import compiled_entry_points
from weightshare.api import convert
from weightshare.errors import UsageError
from weightshare.formats.tflite.signatures import signature_bounds
from weightshare.options import ConvertOptions


def _nosig(path):
    mb = ModelBuilder()
    float_graph(mb, np.random.default_rng(3))
    int8_graph(mb, np.random.default_rng(4))
    return mb.save(path)


CORPUS = {
    "sample (fp16, int8, two signatures)": (lambda p: sample_model(p), {}),
    "no SignatureDefs": (_nosig, {}),
    "LM (EMBEDDING_LOOKUP, GATHER)": (lambda p: lm_model(p), {}),
    "LM without SignatureDefs": (lambda p: lm_model(p, signature=False), {}),
    "sparse fp32, --unpack sparse": (lambda p: sparse_model(p), {"unpack": frozenset({"sparse"})}),
    "sparse fp16 blocks, --unpack sparse": (
        lambda p: sparse_model(p, np.float16, 4, index_kind="u16"),
        {"unpack": frozenset({"sparse"})},
    ),
    "sparse int8 (small: stays inline)": (lambda p: sparse_model(p, np.int8, 1), {}),
    "weight-only int8": (lambda p: fc_model(p, "int8 per channel dim 0"), {}),
    "weight-only int8, --unpack dequantize": (
        lambda p: fc_model(p, "int8 per tensor zp"),
        {"unpack": frozenset({"dequantize"})},
    ),
}


@pytest.mark.parametrize("case", list(CORPUS))
def test_external_output_loads_and_matches_in_compiled_model(tmp_path, case):
    build, opts = CORPUS[case]
    src = build(tmp_path / "m.tflite")
    report = convert(src, tmp_path / "out", ConvertOptions(external=True, **opts))
    out = tmp_path / "out" / src.name
    assert any(o.endswith(".safetensors") for o in report.outputs) == (report.tensors_moved > 0)
    original = dict(compiled_entry_points(str(src), str(src), bounds_of=signature_bounds))
    converted = dict(compiled_entry_points(str(out), str(src), bounds_of=signature_bounds))
    assert original.keys() == converted.keys()
    for key, entry in original.items():
        feeds = entry.feeds(0)
        a, b = entry(feeds), converted[key](feeds)
        assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a), (key, case)


@pytest.mark.parametrize("dtype,block", [(np.float32, 1), (np.float16, 1), (np.float16, 4)])
def test_external_sparse_is_refused_with_the_hint(tmp_path, dtype, block):
    src = sparse_model(tmp_path / "sp.tflite", dtype, block)
    with pytest.raises(UsageError, match="--unpack sparse"):
        convert(src, tmp_path / "out", ConvertOptions(external=True))
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
