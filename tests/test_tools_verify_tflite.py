"""`weightshare verify` on TFLite: every path the original runs on, dynamic dims, custom ops only XNNPACK has.

Regressions built as equivalents of the real models verify refused: mediapipe's selfie_segmentation (the
custom op Convolution2DTransposeBias, which only the XNNPACK delegate provides) and an audio model whose
input has a dynamic length (shape signature [1, -1]) that must be a multiple of a frame size.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import flatbuffers
import numpy as np
import pytest
from tflite_fixtures import OP, ModelBuilder, s

from weightshare._dispatch import inventory
from weightshare.api import convert
from weightshare.options import ConvertOptions


class _CustomOpModel(ModelBuilder):
    """ModelBuilder whose opcode list may hold ("custom", NAME) entries."""

    def to_bytes(self) -> bytes:
        m = s.ModelT(version=3, description="weightshare test fixture")
        m.operatorCodes = [
            s.OperatorCodeT(deprecatedBuiltinCode=OP.CUSTOM, builtinCode=OP.CUSTOM, customCode=c[1], version=1)
            if isinstance(c, tuple)
            else s.OperatorCodeT(deprecatedBuiltinCode=min(c, 127), builtinCode=c, version=1)
            for c in self.opcodes
        ]
        m.subgraphs = [g.to_subgraph() for g in self.subgraphs]
        m.buffers = self.buffers
        m.signatureDefs = self.signatures or None
        b = flatbuffers.Builder(1 << 16)
        b.Finish(m.Pack(b), file_identifier=b"TFL3")
        return bytes(b.Output())


def deconv_model(path):
    """selfie_segmentation-like: Convolution2DTransposeBias (stride 2, SAME), a custom op XNNPACK implements."""
    rng = np.random.default_rng(0)
    mb = _CustomOpModel()
    g = mb.subgraph("main")
    x = g.input("x", [1, 4, 4, 8])
    w = g.const("deconv_w", rng.standard_normal((16, 3, 3, 8)).astype(np.float32))
    b = g.const("deconv_b", rng.standard_normal(16).astype(np.float32))
    y = g.tensor("y", [1, 8, 8, 16], "float32")
    mb.opcodes.append(("custom", "Convolution2DTransposeBias"))
    params = struct.pack("<iiii", 1, 2, 2, 0) + bytes(16)  # TfLiteTransposeConvParams: SAME, stride 2x2, no act.
    g.ops.append(
        s.OperatorT(opcodeIndex=len(mb.opcodes) - 1, inputs=[x, w, b], outputs=[y], customOptions=list(params))
    )
    g.outputs = [y]
    mb.signature("serving_default", g)
    return mb.save(path)


def dynamic_model(path):
    """audio-like: x[1, -1] -> RESHAPE [-1, 64] -> FULLY_CONNECTED(64 -> 32). The length must be a multiple of 64."""
    rng = np.random.default_rng(1)
    mb = ModelBuilder()
    g = mb.subgraph("main")
    x = g.input("x", [1, 1])
    g.tensors[x].shapeSignature = [1, -1]
    shape = g.const("frames", np.array([-1, 64], np.int32))
    r = g.tensor("framed", [1, 64], "float32")
    g.tensors[r].shapeSignature = [-1, 64]
    g.op(OP.RESHAPE, [x, shape], [r])
    w = g.const("fc_w", (rng.standard_normal((32, 64)) * 0.1).astype(np.float32))
    bias = g.const("fc_b", rng.standard_normal(32).astype(np.float32))
    y = g.tensor("y", [1, 32], "float32")
    g.tensors[y].shapeSignature = [-1, 32]
    g.op(OP.FULLY_CONNECTED, [r, w, bias], [y], s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    g.outputs = [y]
    mb.signature("serving_default", g)
    return mb.save(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("vtfl")
    return deconv_model(d / "deconv.tflite"), dynamic_model(d / "dynamic.tflite")


def _convert(cli, src, out, external=False):
    """In-process (the CLI's convert has its own tests): the converted model's path from the report."""
    return Path(convert(src, out, ConvertOptions(external=external)).outputs[0])


def _flip_largest(model):
    p = max((p for p in inventory(model).payloads if p.location == "external"), key=lambda p: p.nbytes)
    blob = model.parent / p.file
    data = bytearray(blob.read_bytes())
    data[p.offset + 4] ^= 0x40
    blob.write_bytes(bytes(data))


@pytest.mark.slow
def test_a_model_only_xnnpack_runs_is_verified_on_that_path(models, cli, tmp_path):
    deconv, _ = models
    out = _convert(cli, deconv, tmp_path)
    res = cli("verify", deconv, out, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    (report,) = json.loads(res.stdout)["reports"]
    assert report["paths"] == ["LiteRT Interpreter, XNNPACK"] and res.stderr == ""
    assert any("does not run with LiteRT no delegate" in n for n in report["notes"])
    _flip_largest(out)
    res = cli("verify", deconv, out, "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["reports"][0]["mismatches"]


@pytest.mark.slow
def test_dynamic_length_needs_a_shape_and_runs_both_paths_with_it(models, cli, tmp_path):
    _, dynamic = models
    out = _convert(cli, dynamic, tmp_path)
    res = cli("verify", dynamic, out)  # length 1: RESHAPE to [-1, 64] fails in the original
    assert res.returncode == 2 and "the original model fails in LiteRT" in res.stderr and "--shape" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = cli("verify", dynamic, out, "--shape", "x=1,256", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    (report,) = json.loads(res.stdout)["reports"]
    assert report["paths"] == ["LiteRT Interpreter, no delegate", "LiteRT Interpreter, XNNPACK"]
    assert cli("verify", dynamic, out, "--dim", "*=128").returncode == 0
    res = cli("verify", dynamic, out, "--dim", "length=128")
    assert res.returncode == 2 and "TFLite dimensions have no names" in res.stderr
    np.save(tmp_path / "x.npy", np.linspace(-1, 1, 192, dtype=np.float32).reshape(1, 192))
    res = cli("verify", dynamic, out, "--input", f"x={tmp_path / 'x.npy'}", "--runs", "1")
    assert res.returncode == 0, res.stdout + res.stderr
    res = cli("verify", dynamic, out, "--shape", "x=1,a")
    assert res.returncode == 2 and "--shape takes NAME=D0,D1" in res.stderr
    _flip_largest(out)
    res = cli("verify", dynamic, out, "--shape", "x=1,256", "--json")
    (report,) = json.loads(res.stdout)["reports"]
    assert res.returncode == 1 and any("elements differ" in m for m in report["mismatches"]), report


@pytest.mark.slow
def test_external_buffers_are_verified_through_compiled_model(models, cli, tmp_path):
    _, dynamic = models
    out = _convert(cli, dynamic, tmp_path, external=True)
    res = cli("verify", dynamic, out, "--shape", "x=1,128", "--json", "--runs", "2")
    (report,) = json.loads(res.stdout)["reports"]
    assert res.returncode == 0, res.stdout + res.stderr
    assert report["paths"] == ["LiteRT CompiledModel"] and report["outputs_compared"] == 2
    assert res.stderr == ""  # no LiteRT INFO lines (environment setup, accelerators destroyed at exit)
    _flip_largest(out)
    res = cli("verify", dynamic, out, "--shape", "x=1,128", "--json")
    assert res.returncode == 1 and json.loads(res.stdout)["reports"][0]["checksum_mismatches"]
    p = max((p for p in inventory(out).payloads if p.location == "external"), key=lambda p: p.nbytes)
    with open(out.parent / p.file, "r+b") as f:
        f.truncate(p.offset + p.nbytes // 2)
    res = cli("verify", dynamic, out, "--shape", "x=1,128")
    assert res.returncode == 1 and res.stderr == "", res.stderr
    assert f"FAIL: tensor '{p.name}':" in res.stdout, res.stdout
