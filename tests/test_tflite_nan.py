"""fp16 -> DEQUANTIZE folding keeps every bit LiteRT's builtin DEQUANTIZE kernel produces (the reference,
no-delegate path): signalling NaNs keep their bits there (XNNPACK would quiet them), -0, inf, subnormals."""

from __future__ import annotations

import numpy as np
from ai_edge_litert import schema_py_generated as s
from ai_edge_litert.interpreter import Interpreter, OpResolverType
from tflite_fixtures import OP, ModelBuilder

import weightshare

SPECIAL = np.array(
    [0x7C01, 0x7D55, 0xFC01, 0x7E00, 0x7E01, 0xFE00, 0x7C00, 0xFC00, 0x8000, 0x0000, 0x0001, 0x83FF, 0x03FF, 0x3C00],
    np.uint16,
)


def _run(path) -> np.ndarray:
    it = Interpreter(
        model_path=str(path), experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    )
    return it.get_signature_runner("serving_default")(x=np.zeros(4, np.float32))["y"]


def test_fp16_special_values_fold_to_the_builtin_kernels_bits(tmp_path):
    bits = np.resize(SPECIAL, 1000)
    mb = ModelBuilder()
    g = mb.subgraph("main")
    x = g.input("x", [4])
    w = g.dequantize("w", bits.view(np.float16))
    y = g.tensor("y", [4 + bits.size], "float32")
    # CONCATENATION copies bits: no arithmetic between DEQUANTIZE and the output to quiet a NaN
    g.op(OP.CONCATENATION, [x, w], [y], s.BuiltinOptions.ConcatenationOptions, s.ConcatenationOptionsT(axis=0))
    g.outputs = [y]
    mb.signature("serving_default", g)
    src = mb.save(tmp_path / "n.tflite")
    report = weightshare.convert(src, tmp_path / "out")
    assert report.ops_removed == 1  # the DEQUANTIZE is gone: the fp32 bits now come from the file
    before, after = _run(src), _run(tmp_path / "out" / "n.tflite")
    assert (before.dtype, before.shape, before.tobytes()) == (after.dtype, after.shape, after.tobytes())
    assert 0x7F802000 in after.view(np.uint32)  # the signalling NaN kept, as the builtin kernel keeps it
