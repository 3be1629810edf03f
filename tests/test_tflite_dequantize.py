"""``--unpack dequantize``: weight-only int8 (DEQUANTIZE of an integer constant) stored once as fp32.

Before: FULLY_CONNECTED(x, DEQUANTIZE(int weights), bias); every interpreter makes its own fp32 copy.
Proof of the arithmetic: a model whose output IS the DEQUANTIZE output is run by LiteRT's kernel, and the values
this converter computes (in small chunks, to cross chunk boundaries) must be the same bits, on every layout.
After: the DEQUANTIZE op is gone and outputs are bit-identical under every LiteRT path; ``check`` exits 1 before
(with the --unpack dequantize fix) and 0 after.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from ai_edge_litert.compiled_model import CompiledModel
from ai_edge_litert.interpreter import Interpreter, OpResolverType
from tflite_fixtures import OP, TT, ModelBuilder, run_compiled_model, s

from weightshare.api import convert
from weightshare.formats.tflite import flatbuf
from weightshare.formats.tflite.dequantize import plan_dequantize
from weightshare.formats.tflite.graph import builtin_code
from weightshare.options import ConvertOptions

DEQ = ConvertOptions(unpack=frozenset({"dequantize"}))
N, K = 48, 40

# layout -> (tensor type, shape, scales, zero points, quantized dimension)
LAYOUTS = {
    "int8 per tensor": ("int8", (N, K), [0.0123], [0], 0),
    "int8 per tensor zp": ("int8", (N, K), [0.031], [-3], 0),
    "int8 per channel dim 0": ("int8", (N, K), "per-row", "zeros", 0),
    "int8 per channel dim 1 zps": ("int8", (N, K), "per-col", "per-col", 1),
    "uint8 per tensor zp": ("uint8", (N, K), [0.02], [128], 0),
    "int16 per tensor": ("int16", (N, K), [1e-4], [0], 0),
    "int4 per tensor": ("int4", (N, K), [0.11], [0], 0),
    "int4 per channel odd": ("int4", (N, K - 1), "per-row", "zeros", 0),
}


def _params(rng, shape, scales, zps, qd):
    n = shape[qd]
    if isinstance(scales, str):
        scales = list((rng.random(n) * 0.05 + 1e-3).astype(np.float32))
    if zps == "zeros":  # LiteRT wants one zero point per scale
        zps = [0] * n
    elif isinstance(zps, str):
        zps = list(rng.integers(-5, 6, n))
    return scales, zps


def _quantized(g, rng, name, layout):
    kind, shape, scales, zps, qd = LAYOUTS[layout]
    scales, zps = _params(rng, shape, scales, zps, qd)
    if kind == "int4":
        q = rng.integers(-8, 8, shape).astype(np.int8).ravel()
        q = np.concatenate([q, np.zeros(len(q) % 2, np.int8)])
        packed = ((q[0::2] & 0x0F) | (q[1::2] << 4)).astype(np.int8)
        t = g.tensor(name, shape, "int8", g.model.buffer(packed.tobytes()), quant=(scales, zps))
        g.tensors[t].type = TT.INT4
    else:
        info = np.iinfo(kind)
        q = rng.integers(info.min, info.max + 1, shape).astype(kind)
        t = g.const(name, q, quant=(scales, zps)) if kind != "int16" else _int16(g, name, q, scales, zps)
    g.tensors[t].quantization.quantizedDimension = qd
    return t, shape


def _int16(g, name, q, scales, zps):
    t = g.tensor(name, q.shape, "int8", g.model.buffer(q.tobytes()), quant=(scales, zps))
    g.tensors[t].type = TT.INT16
    return t


def kernel_model(path, layout):
    """DEQUANTIZE(constant) as the model's output: what LiteRT's kernel computes, readable."""
    rng = np.random.default_rng(1)
    mb = ModelBuilder()
    g = mb.subgraph("k")
    x = g.input("x", [1])  # unused: an interpreter needs an input
    w, shape = _quantized(g, rng, "w", layout)
    y = g.tensor("y", shape, "float32")
    g.op(OP.DEQUANTIZE, [w], [y])
    z = g.tensor("z", [1], "float32")
    g.op(OP.ADD, [x, x], [z], s.BuiltinOptions.AddOptions, s.AddOptionsT())
    g.outputs = [y, z]
    return mb.save(path)


def fc_model(path, layout):
    rng = np.random.default_rng(2)
    mb = ModelBuilder()
    g = mb.subgraph("fc")
    w, shape = _quantized(g, rng, "w_q", layout)
    x = g.input("x", [2, shape[1]])
    wf = g.tensor("w", shape, "float32")
    g.op(OP.DEQUANTIZE, [w], [wf])
    b = g.const("b", rng.standard_normal(shape[0]).astype(np.float32))
    y = g.tensor("y", [2, shape[0]], "float32")
    g.op(OP.FULLY_CONNECTED, [x, wf, b], [y], s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    g.outputs = [y]
    mb.signature("serving_default", g)
    return mb.save(path)


def _ours(path):
    with flatbuf.open_model(str(path)) as (reader, mapping):
        flatbuf.check_header(reader)
        refs = flatbuf.read_buffer_refs(reader)
        graph = flatbuf.read_graph(reader, mapping)
    sources = [r.source(str(path)) if r.nbytes else None for r in refs]
    graph.subgraphs[0].outputs = graph.subgraphs[0].outputs[1:]  # the kernel's output, planned as a weight
    folds, notes = plan_dequantize(graph, sources, str(path), frozenset({TT.INT8, TT.UINT8, TT.INT16, TT.INT4}))
    assert len(folds) == 1, notes
    return b"".join(bytes(c) for c in folds[0][1].chunks(chunk_size=64))  # 16 elements per chunk


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_values_are_the_kernels_bits(tmp_path, layout):
    path = kernel_model(tmp_path / "k.tflite", layout)
    it = Interpreter(
        model_path=str(path), experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    )
    it.allocate_tensors()
    it.set_tensor(it.get_input_details()[0]["index"], np.zeros(1, np.float32))
    it.invoke()
    kernel = it.get_tensor(it.get_output_details()[0]["index"])
    assert np.array_equal(np.frombuffer(_ours(path), np.uint32), kernel.view(np.uint32).ravel())


def _runs(path, x):
    out = {}
    for label, resolver in (("no delegate", OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES), ("XNNPACK", None)):
        kw = {"experimental_op_resolver_type": resolver} if resolver is not None else {}
        r = Interpreter(model_path=str(path), **kw).get_signature_runner("serving_default")
        out[label] = r(x=x)["y"]
    out["CompiledModel"] = run_compiled_model(CompiledModel.from_file(str(path)), {"serving_default": {"x": x}})[
        "serving_default"
    ]["y"]
    return out


FOLDED = [k for k in LAYOUTS if LAYOUTS[k][0] == "int8"]


@pytest.mark.parametrize("layout", FOLDED)
def test_unpacked_model_is_bit_identical_everywhere(tmp_path, layout):
    src = fc_model(tmp_path / "fc.tflite", layout)
    report = convert(src, tmp_path / "out", DEQ)
    out = tmp_path / "out" / src.name
    m = s.ModelT.InitFromPackedBuf(out.read_bytes()[: 1 << 20], 0)
    assert [builtin_code(m.operatorCodes[op.opcodeIndex]) for op in m.subgraphs[0].operators] == [OP.FULLY_CONNECTED]
    assert report.ops_removed == 1 and report.unpacked == 1
    x = np.random.default_rng(3).standard_normal((2, LAYOUTS[layout][1][1])).astype(np.float32)
    a, b = _runs(src, x), _runs(out, x)
    for path in a:
        assert np.array_equal(a[path].view(np.uint32), b[path].view(np.uint32)), path


@pytest.mark.slow
def test_check_counts_the_copies_and_passes_after_unpack(tmp_path, cli):
    src = fc_model(tmp_path / "fc.tflite", "int8 per channel dim 0")
    before = cli("check", src, "--json")
    assert before.returncode == 1, before.stdout + before.stderr
    found = [f for f in json.loads(before.stdout)["findings"] if f["code"] == "unpacked-per-session"]
    assert len(found) == 1 and "--unpack dequantize" in found[0]["fix"] and "DEQUANTIZE INT8" in found[0]["message"]
    inspected = cli("inspect", src, "--json")
    payloads = json.loads(inspected.stdout)["reports"][0]["payloads"]
    assert [p["copied_per_session"] for p in payloads if p["name"] == "w_q"] == [4 * N * K]
    plain = cli("convert", src, "-o", tmp_path / "plain", "-q")
    assert plain.returncode == 0 and cli("check", tmp_path / "plain" / src.name).returncode == 1  # still copies
    done = cli("convert", src, "-o", tmp_path / "out", "--unpack", "dequantize", "-q")
    assert done.returncode == 0, done.stderr
    after = cli("check", tmp_path / "out" / src.name)
    assert after.returncode == 0, after.stdout + after.stderr


@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - set(FOLDED)))
def test_other_integer_types_are_kept_with_a_note(tmp_path, layout):
    """Not folded: with XNNPACK the consumer would move from the builtin kernel to XNNPACK's (outputs differ)."""
    src = fc_model(tmp_path / "fc.tflite", layout)
    report = convert(src, tmp_path / "out", DEQ)
    assert report.ops_removed == 0 and any("does not unpack them" in n for n in report.notes)


def test_blockwise_is_kept_with_a_note(tmp_path):
    src = fc_model(tmp_path / "fc.tflite", "int8 per tensor")
    m = s.ModelT.InitFromPackedBuf(src.read_bytes(), 0)
    q = m.subgraphs[0].tensors[0].quantization
    q.detailsType = s.QuantizationDetails.BlockwiseQuantization
    q.details = s.BlockwiseQuantizationT(scales=0, zeroPoints=0, blockSize=8)
    import flatbuffers

    b = flatbuffers.Builder(1 << 16)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    src.write_bytes(bytes(b.Output()))
    report = convert(src, tmp_path / "out", DEQ)
    assert report.ops_removed == 0 and any("blockwise" in n for n in report.notes)


def test_setting_costs_count_the_unpacked_weights(tmp_path):
    """inspect's per-setting estimate: the int8 weights' fp32 unpacking stays per instance even with a weight
    cache (XNNPACK keeps its own), until --unpack dequantize stores it in the file."""
    from weightshare.formats.tflite.xnnpack_cache import interpreter_costs

    src = fc_model(tmp_path / "fc.tflite", "int8 per channel dim 0")
    before = {c.setting: c.per_instance_bytes for c in interpreter_costs(src)}
    assert before["CompiledModel + XNNPACK weight cache"] == 4 * N * K
    assert before["Interpreter, default XNNPACK"] >= 2 * 4 * N * K  # unpacked and packed
    convert(src, tmp_path / "out", DEQ)
    after = {c.setting: c.per_instance_bytes for c in interpreter_costs(tmp_path / "out" / src.name)}
    assert after["CompiledModel + XNNPACK weight cache"] == 0 and after["Interpreter, no delegate"] == 0
