"""``--unpack sparse``: DENSIFY of a constant sparse tensor becomes a dense constant.

Before: DENSIFY(constant sparse weights, CSR with or without 1x4 blocks) [-> DEQUANTIZE] -> FULLY_CONNECTED.
Under test: conversion with ``unpack={"sparse"}``, and ``densify`` itself against an encoder.
After: the DENSIFY (and DEQUANTIZE) ops are gone, LiteRT outputs are bit-identical, bad indices are refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tflite_convert import RESOLVERS, builtin, model_of, run_interpreter
from tflite_fixtures import OP, sparse_encode, sparse_model

from weightshare.api import convert
from weightshare.errors import InvalidModel
from weightshare.formats.tflite.sparse import densify
from weightshare.options import ConvertOptions

SPARSE = ConvertOptions(unpack=frozenset({"sparse"}))
INPUTS = {"sparse": {"x": np.linspace(-1, 1, 128, dtype=np.float32).reshape(1, 128)}}


@pytest.mark.parametrize("dtype,block,kind", [(np.float32, 1, "i32"), (np.float32, 4, "u8"), (np.float16, 4, "u16")])
def test_densify_folded_outputs_identical(tmp_path, dtype, block, kind):
    src = sparse_model(tmp_path / "sp.tflite", dtype, block, index_kind=kind)
    report = convert(src, tmp_path / "out", SPARSE)
    out = tmp_path / "out" / src.name
    m = model_of(out)
    codes = [builtin(m, op) for op in m.subgraphs[0].operators]
    assert codes == [OP.FULLY_CONNECTED] and report.ops_removed == (2 if dtype == np.float16 else 1)
    for resolver in RESOLVERS:
        assert np.array_equal(
            run_interpreter(src, resolver, INPUTS)["sparse"]["y"], run_interpreter(out, resolver, INPUTS)["sparse"]["y"]
        )


def test_sparse_kept_without_option(tmp_path):
    src = sparse_model(tmp_path / "sp.tflite")
    convert(src, tmp_path / "out")
    m = model_of(tmp_path / "out" / src.name)
    assert OP.DENSIFY in [builtin(m, op) for op in m.subgraphs[0].operators]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    nblocks=st.integers(1, 6),
    block=st.sampled_from([1, 2, 4]),
    density=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_densify_inverts_encoding(rows, nblocks, block, density, seed):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((rows, nblocks * block)).astype(np.float32)
    dense[rng.random(dense.shape) > density] = 0
    values, sparsity = sparse_encode(dense, block)
    assert np.array_equal(densify(sparsity, list(dense.shape), values, "m"), dense.ravel())


def test_densify_rejects_bad_indices():
    dense = np.eye(4, dtype=np.float32)
    values, sparsity = sparse_encode(dense)
    sparsity.dimMetadata[1].arrayIndices.values[2] = 9
    with pytest.raises(InvalidModel, match="out of range"):
        densify(sparsity, [4, 4], values, "m")
    values, sparsity = sparse_encode(dense)
    sparsity.dimMetadata[1].arraySegments.values[-1] = 99
    with pytest.raises(InvalidModel, match="array_segments"):
        densify(sparsity, [4, 4], values, "m")
    with pytest.raises(InvalidModel, match="stores"):
        densify(sparse_encode(dense)[1], [4, 4], values[:-1], "m")
    bad = sparse_encode(dense)[1]
    bad.traversalOrder = [0, 0]
    with pytest.raises(InvalidModel):
        densify(bad, [4, 4], values, "m")
