"""TFLite conversion: same outputs in LiteRT, page-aligned appended buffers, external blobs.

Before: a fixture model (tests/tflite_fixtures.py) with inline weights, fp16 constants behind DEQUANTIZE.
Under test: ``weightshare.api.convert`` on it.
After: LiteRT gives bit-identical outputs (with and without XNNPACK), every weight at or above the inline
threshold sits outside the flatbuffer at an aligned offset, and everything else in the model is unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert import schema_py_generated as s
from ai_edge_litert.interpreter import Interpreter, OpResolverType
from tflite_fixtures import OP, ModelBuilder, run_compiled_model, sample_inputs, sample_model

from weightshare._placement import AlignPolicy
from weightshare.api import convert
from weightshare.options import ConvertOptions

RESOLVERS = [OpResolverType.AUTO, OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES]


def run_interpreter(path, resolver=OpResolverType.AUTO, inputs=None):
    it = Interpreter(model_path=str(path), experimental_op_resolver_type=resolver)
    return {key: it.get_signature_runner(key)(**feeds) for key, feeds in (inputs or sample_inputs()).items()}


def assert_same_outputs(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert a[key][name].dtype == b[key][name].dtype
            assert np.array_equal(a[key][name], b[key][name]), f"{key}/{name} differs"


def model_of(path) -> s.ModelT:
    return s.ModelT.InitFromPackedBuf(bytearray(path.read_bytes()), 0)


def builtin(model: s.ModelT, op: s.OperatorT) -> int:
    code = model.operatorCodes[op.opcodeIndex]
    return max(code.builtinCode, code.deprecatedBuiltinCode)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("tfl")
    src = sample_model(d / "sample.tflite")
    report = convert(src, d / "out")
    return src, d / "out" / "sample.tflite", report


@pytest.mark.covers("tflite", "convert")
@pytest.mark.parametrize("resolver", RESOLVERS, ids=["xnnpack", "builtin"])
def test_outputs_bit_identical(converted, resolver):
    src, out, _ = converted
    assert_same_outputs(run_interpreter(src, resolver), run_interpreter(out, resolver))


def test_buffers_moved_aligned_and_deduplicated(converted):
    src, out, report = converted
    data = out.read_bytes()
    model = s.Model.GetRootAs(data, 0)
    policy, threshold = AlignPolicy(), ConvertOptions().inline_threshold
    metadata_buffers = {model.Metadata(i).Buffer() for i in range(model.MetadataLength())}
    placed, ends = {}, []
    for i in range(model.BuffersLength()):
        b = model.Buffers(i)
        if b.Offset() > 1:
            assert b.DataIsNone()
            assert b.Offset() % policy.for_size(b.Size()) == 0, f"buffer {i} at {b.Offset()} is not aligned"
            assert b.Size() >= threshold
            placed.setdefault(b.Offset(), []).append(i)
            ends.append(b.Offset() + b.Size())
        elif not b.DataIsNone() and b.DataLength():
            assert b.DataLength() < threshold or i in metadata_buffers, f"buffer {i} stayed inline"
            assert b.Data(0) is not None
            pos = b._tab.Vector(4)
            assert pos % 16 == 0, f"inline buffer {i} data at {pos} is not 16-byte aligned"
    assert len(data) == max(ends) + 16 and data[max(ends) :] == bytes(16)
    assert any(len(v) == 2 for v in placed.values()), "twin constants should share one payload"
    assert report.deduplicated == 1 and report.ops_removed == 2 and report.unpacked == 2
    assert any(b % (64 << 10) == 0 and model.Buffers(v[0]).Size() >= 1 << 20 for b, v in placed.items())


def test_everything_but_buffers_preserved(converted):
    src, out, _ = converted
    a, b = model_of(src), model_of(out)
    assert [sd.signatureKey for sd in a.signatureDefs] == [sd.signatureKey for sd in b.signatureDefs]
    assert [(m.name, bytes(a.buffers[m.buffer].data)) for m in a.metadata] == [
        (m.name, bytes(b.buffers[m.buffer].data)) for m in b.metadata
    ]
    assert b.description == a.description and len(b.subgraphs) == len(a.subgraphs) == 2
    for ga, gb in zip(a.subgraphs, b.subgraphs):
        assert ga.name == gb.name
        assert [t.name for t in ga.tensors] == [t.name for t in gb.tensors]
        for ta, tb in zip(ga.tensors, gb.tensors):
            assert ta.type == tb.type and list(ta.shape) == list(tb.shape)
            if ta.quantization is not None and ta.quantization.scale is not None:
                assert np.array_equal(ta.quantization.scale, tb.quantization.scale)
                assert np.array_equal(ta.quantization.zeroPoint, tb.quantization.zeroPoint)
    ops_a = [builtin(a, op) for op in a.subgraphs[0].operators]
    ops_b = [builtin(b, op) for op in b.subgraphs[0].operators]
    assert ops_b == [c for c in ops_a if c != OP.DEQUANTIZE] and OP.DEQUANTIZE in ops_a


def test_keep_packed_keeps_dequantize(tmp_path, converted):
    src, _, _ = converted
    report = convert(src, tmp_path, ConvertOptions(keep_packed=True))
    out = tmp_path / src.name
    assert report.ops_removed == 0 and report.unpacked == 0
    assert OP.DEQUANTIZE in [builtin(model_of(out), op) for op in model_of(out).subgraphs[0].operators]
    assert_same_outputs(run_interpreter(src), run_interpreter(out))


def test_align_options_and_determinism(tmp_path, converted):
    src, _, _ = converted
    opts = ConvertOptions(align=AlignPolicy(large=4096, small=256, threshold=4096), inline_threshold=100)
    convert(src, tmp_path / "a", opts)
    convert(src, tmp_path / "b", opts)
    data = (tmp_path / "a" / src.name).read_bytes()
    assert data == (tmp_path / "b" / src.name).read_bytes()
    model = s.Model.GetRootAs(data, 0)
    sizes = []
    for i in range(model.BuffersLength()):
        b = model.Buffers(i)
        if b.Offset() > 1:
            assert b.Offset() % (4096 if b.Size() >= 4096 else 256) == 0
            sizes.append(b.Size())
    assert min(sizes) < 4096 <= max(sizes)
    assert_same_outputs(run_interpreter(src), run_interpreter(tmp_path / "a" / src.name))


def _edge_model(path):
    """fp16 constant read by two DEQUANTIZE ops, one of whose outputs is also a subgraph output."""
    rng = np.random.default_rng(3)
    mb = ModelBuilder()
    g = mb.subgraph("edge")
    x = g.input("x", [1, 512])
    w16 = g.const("w_fp16", rng.standard_normal((1, 512)).astype(np.float16))
    d1, d2 = g.tensor("w1", [1, 512], "float32"), g.tensor("w2", [1, 512], "float32")
    g.op(OP.DEQUANTIZE, [w16], [d1])
    g.op(OP.DEQUANTIZE, [w16], [d2])
    y = g.tensor("y", [1, 512], "float32")
    g.op(OP.ADD, [x, d1], [y], s.BuiltinOptions.AddOptions, s.AddOptionsT())
    g.outputs = [y, d2]
    mb.signature("edge", g)
    return mb.save(path)


@pytest.mark.parametrize("resolver", RESOLVERS, ids=["xnnpack", "builtin"])
def test_fold_shared_fp16_and_subgraph_output(tmp_path, resolver):
    src = _edge_model(tmp_path / "edge.tflite")
    report = convert(src, tmp_path / "out")
    assert report.ops_removed == 2
    inputs = {"edge": {"x": np.arange(512, dtype=np.float32).reshape(1, 512)}}
    # The reference runs without XNNPACK: LiteRT 2.3's XNNPACK delegate fails to set up the original
    # (a DEQUANTIZE output that is also a graph output); the converted model runs under both.
    reference = run_interpreter(src, OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES, inputs)
    assert_same_outputs(reference, run_interpreter(tmp_path / "out" / src.name, resolver, inputs))


def run_compiled(path, inputs=None):
    from ai_edge_litert.compiled_model import CompiledModel

    return run_compiled_model(CompiledModel.from_file(str(path)), inputs)


def test_external_blob_through_compiled_model(converted, tmp_path):
    from safetensors.numpy import load_file

    src, _, _ = converted
    report = convert(src, tmp_path, ConvertOptions(external=True))
    model_path, blob_path = tmp_path / src.name, Path(report.outputs[1])
    assert report.outputs == [str(model_path), str(blob_path)]
    assert blob_path.parent == tmp_path and blob_path.name.startswith("sample.weights.")
    assert_same_outputs(run_compiled(src), run_compiled(model_path))
    m = model_of(model_path)
    assert [g.name for g in m.externalBufferGroups] == [blob_path.name.encode()]
    threshold = ConvertOptions().inline_threshold
    assert all(
        b.data is None or len(b.data) < threshold or i in {md.buffer for md in m.metadata}
        for i, b in enumerate(m.buffers)
    )
    for e in m.externalBuffers:
        assert e.offset % AlignPolicy().for_size(e.length) == 0
    tensors = load_file(str(blob_path))  # a valid safetensors file
    original = model_of(src)
    fp16 = next(t for t in original.subgraphs[0].tensors if t.name == b"fc_w_fp16")
    expected = np.frombuffer(bytes(original.buffers[fp16.buffer].data), np.float16).astype(np.float32)
    assert np.array_equal(tensors["fc_w"].reshape(-1), expected)


def test_converted_model_is_a_fixed_point(converted, tmp_path):
    """Input buffers already addressed by Buffer.offset are read in place; converting again changes nothing."""
    _, out, _ = converted
    report = convert(out, tmp_path)
    assert report.ops_removed == 0 and report.tensors_moved > 0
    assert (tmp_path / out.name).read_bytes() == out.read_bytes()


def test_external_model_is_refused_by_classic_interpreter(converted, tmp_path):
    src, _, _ = converted
    convert(src, tmp_path, ConvertOptions(external=True))
    with pytest.raises(Exception, match="lacks data"):
        run_interpreter(tmp_path / src.name)


def test_external_model_converts_back_to_appended(converted, tmp_path):
    """ExternalBuffer groups in the input are read (paths checked) and appended like any other buffer."""
    src, out, _ = converted
    convert(src, tmp_path / "ext", ConvertOptions(external=True))
    report = convert(tmp_path / "ext" / src.name, tmp_path / "back")
    back = tmp_path / "back" / src.name
    assert report.ops_removed == 0 and not model_of(back).externalBuffers
    assert_same_outputs(run_interpreter(src), run_interpreter(back))


def test_cli_convert_external_json(converted, tmp_path):
    src, _, _ = converted
    proc = subprocess.run(
        [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(tmp_path), "--external", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    (report,) = json.loads(proc.stdout)["reports"]
    assert report["format"] == "tflite" and report["ops_removed"] == 2
    (blob,) = tmp_path.glob("sample.weights.*.safetensors")
    assert report["outputs"] == [str(tmp_path / src.name), str(blob)]
    assert_same_outputs(run_compiled(src), run_compiled(tmp_path / src.name))


def test_golden_layout_of_a_single_weight(tmp_path):
    """One 2 KiB fp16 constant: flatbuffer, zeros up to the next 64-byte boundary, 4 KiB of fp32, 16 zeros."""
    mb = ModelBuilder()
    g = mb.subgraph("g")
    x = g.input("x", [1, 1024])
    w16 = (np.arange(1024) - 512).astype(np.float16).reshape(1, 1024) / np.float16(8)
    w = g.dequantize("w", w16)
    y = g.tensor("y", [1, 1024], "float32")
    g.op(OP.ADD, [x, w], [y], s.BuiltinOptions.AddOptions, s.AddOptionsT())
    g.outputs = [y]
    src = mb.save(tmp_path / "one.tflite")
    convert(src, tmp_path / "out")
    data = (tmp_path / "out" / "one.tflite").read_bytes()
    model = s.Model.GetRootAs(data, 0)
    moved = [model.Buffers(i) for i in range(model.BuffersLength()) if model.Buffers(i).Offset() > 1]
    assert len(moved) == 1
    offset, size = moved[0].Offset(), moved[0].Size()
    assert size == 4096 and offset % 64 == 0
    # Small payload: 64-byte alignment, so no more than alignment padding after the flatbuffer's last non-zero byte.
    assert offset - len(data[:offset].rstrip(b"\0")) < 64 + 16
    assert data[offset : offset + size] == w16.astype("<f4").tobytes()
    assert data[offset + size :] == bytes(16) and len(data) == offset + size + 16


def test_zoo_shares_one_external_blob(tmp_path):
    """Two models with the same weights (one with fp16 + DEQUANTIZE folded) store those weights once."""
    from weightshare.api import convert_zoo

    a = sample_model(tmp_path / "a.tflite", seed=0, fc_out=64)
    b = sample_model(tmp_path / "b.tflite", seed=0, fc_out=64)
    report = convert_zoo([a, b], tmp_path / "zoo", "shared.safetensors", ConvertOptions(external=True))
    first, second = report.models
    assert first.bytes_written > 0 and second.bytes_written == 0 and second.deduplicated == second.tensors_moved
    for src in (a, b):
        assert_same_outputs(run_compiled(src), run_compiled(tmp_path / "zoo" / src.name))


def test_dequantize_with_other_output_shape_is_kept(tmp_path):
    """A [] output is broadcast as a scalar by LiteRT; folding would change the result, so the op stays."""
    mb = ModelBuilder()
    g = mb.subgraph("g")
    x = g.input("x", [1, 512])
    w16 = g.const("w_fp16", np.linspace(-2, 2, 512).astype(np.float16).reshape(1, 512))
    w = g.tensor("w", [], "float32")
    g.op(OP.DEQUANTIZE, [w16], [w])
    y = g.tensor("y", [1, 512], "float32")
    g.op(OP.ADD, [x, w], [y], s.BuiltinOptions.AddOptions, s.AddOptionsT())
    g.outputs = [y]
    mb.signature("g", g)
    src = mb.save(tmp_path / "m.tflite")
    report = convert(src, tmp_path / "out")
    assert report.ops_removed == 0 and any("shape" in n for n in report.notes)
    inputs = {"g": {"x": np.ones((1, 512), np.float32)}}
    for resolver in RESOLVERS:
        assert_same_outputs(
            run_interpreter(src, resolver, inputs), run_interpreter(tmp_path / "out" / src.name, resolver, inputs)
        )
