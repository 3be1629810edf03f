"""Mutation fuzzing of the ONNX converter: >= 600 damaged models, no traceback, nothing left behind
(per test run; scripts/fuzz.py runs for minutes)."""

from __future__ import annotations

import random
import shutil

import onnx
import pytest
from fuzz_harness import MUTATIONS, FuzzStats, check_one, mutate, runtime_loads, scratch_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx_fixtures import fuzz_seed_model

from weightshare.api import convert
from weightshare.errors import InvalidModel
from weightshare.formats.onnx.wire import encode_len_field, encode_varint_field


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    d = tmp_path_factory.mktemp("fz")
    model = fuzz_seed_model(d)
    return model.read_bytes(), {"fz.data": (d / "fz.data").read_bytes()}


@pytest.mark.slow
def test_fuzz_600_mutations(seed, tmp_path):
    data, extra = seed
    stats = FuzzStats(keep_dir=tmp_path / "kept", keep_every=8)
    rng = random.Random(20261130)
    work = scratch_dir(tmp_path)
    try:
        for i in range(600):
            kind, mutated = mutate(data, rng, MUTATIONS[i % len(MUTATIONS)])
            try:
                check_one(mutated, "fz.onnx", work, stats, kind, extra)
            except AssertionError as e:
                (tmp_path / "failing.onnx").write_bytes(mutated)
                raise AssertionError(f"input {i} ({kind}): {e}; saved as {tmp_path / 'failing.onnx'}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert stats.inputs == 600
    assert stats.rejected > 150 and stats.converted > 30, stats  # both paths really exercised
    loads = runtime_loads(stats)  # onnxruntime loads every kept conversion whose damaged input it loads
    assert loads["original_loads"] >= 5, loads


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@pytest.mark.slow
@given(st.binary(min_size=0, max_size=400))
def test_fuzz_random_bytes(tmp_path, data):
    check_one(data, "r.onnx", tmp_path / "w", FuzzStats())


def _nested_if(depth: int) -> bytes:
    graph = b""
    for _ in range(depth):
        attr = encode_len_field(1, b"then_branch") + encode_varint_field(20, 5) + encode_len_field(6, graph)
        node = encode_len_field(1, b"c") + encode_len_field(4, b"If") + encode_len_field(5, attr)
        graph = encode_len_field(1, node)
    return encode_varint_field(1, 8) + encode_len_field(7, graph) + encode_len_field(8, encode_varint_field(2, 17))


def test_deeply_nested_subgraphs_are_refused(tmp_path):
    path = tmp_path / "deep.onnx"
    path.write_bytes(_nested_if(400))
    with pytest.raises(InvalidModel, match="nested deeper"):
        convert(path, tmp_path / "out")


def test_moderately_nested_subgraphs_convert(tmp_path):
    """20 levels of If (no weights): accepted, and written back unchanged down to the innermost graph."""
    path = tmp_path / "nested.onnx"
    path.write_bytes(_nested_if(20))
    report = convert(path, tmp_path / "out")
    assert report.tensors_moved == 0 and report.outputs == [str(tmp_path / "out" / "nested.onnx")]
    out = onnx.load(report.outputs[0])
    assert out == onnx.load(str(path))
    depth, graph = 0, out.graph
    while graph.node:
        graph, depth = graph.node[0].attribute[0].g, depth + 1
    assert depth == 20


def test_non_utf8_names_are_refused(seed, tmp_path):
    # Found by scripts/fuzz.py: protobuf returns invalid UTF-8 in onnx's (proto2) string fields as bytes.
    data, extra = seed
    assert data.count(b"sub_w") >= 2
    path = tmp_path / "fz.onnx"
    path.write_bytes(data.replace(b"sub_w", b"\x80ub_w"))
    (tmp_path / "fz.data").write_bytes(extra["fz.data"])
    with pytest.raises(InvalidModel, match="not valid UTF-8"):
        convert(path, tmp_path / "out")
