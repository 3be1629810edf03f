"""External data entries are read exactly as ONNX Runtime reads them: what ORT refuses, weightshare refuses
(exit 2, one line); what ORT accepts, weightshare converts to a model ORT runs with the same outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

from weightshare.api import convert
from weightshare.errors import InvalidModel

DATA = np.arange(32, dtype=np.float32) / 7  # 128 bytes: converted inline, the parse is what is tested
PAD = 16


def _model(d: Path, entries: list[tuple[str, str]], trailing: int = 0) -> Path:
    (d / "w.data").write_bytes(bytes(PAD) + DATA.tobytes() + bytes(trailing))
    t = onnx.TensorProto(name="w", data_type=TP.FLOAT, dims=[DATA.size], data_location=TP.EXTERNAL)
    for k, v in entries:
        e = t.external_data.add()
        e.key, e.value = k, v
    g = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])],
        "g",
        [],
        [helper.make_tensor_value_info("y", TP.FLOAT, [DATA.size])],
        [t],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, d / "m.onnx")
    return d / "m.onnx"


def _ort(path: Path):
    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {})[0]
    except Exception:  # ORT's refusal: the model is invalid for it
        return None


CASES = [
    *[
        [("location", "w.data"), ("offset", v), ("length", "128")]
        for v in (
            "16",
            "016",
            "+16",
            " 16",
            "\t16",
            "16 ",
            "16_16",
            "\u0661\u0666",
            "\uff11\uff16",
            "0x10",
            "16.0",
            "",
            " ",
            "+",
            "1e1",
            str(1 << 64),
        )
    ],
    *[
        [("location", "w.data"), ("offset", "16"), ("length", v)]
        for v in ("128", "0128", "0", "+128", " 128", "128 ", "1_28", "", "-128", "\u0661\u0662\u0668")
    ],
    [("location", "w.data"), ("offset", "16")],  # no length: the tensor's size from the offset
    [("location", "w.data"), ("offset", "16"), ("length", "128"), ("checksum", "abc")],
    [("location", "w.data"), ("offset", "16"), ("length", "128"), ("junk", "x")],
    [("location", "w.data"), ("offset", "16"), ("length", "128"), ("Offset", "16")],
    [("location", "w.data"), ("offset", "0"), ("length", "128"), ("offset", "16")],  # the last one counts
    [("location", "w.data"), ("location", "w.data"), ("offset", "16"), ("length", "128")],
]


@pytest.mark.parametrize("entries", CASES, ids=[repr(c[1:])[:60] for c in CASES])
@pytest.mark.parametrize("trailing", [0, 64])
def test_external_entries_parse_as_ort_does(tmp_path, entries, trailing):
    src = _model(tmp_path, entries, trailing)
    expected = _ort(src)
    try:
        convert(src, tmp_path / "out")
    except InvalidModel as e:
        assert expected is None, f"ORT runs it, weightshare refused: {e}"
        assert "\n" not in e.line() and str(src) in e.line()
        return
    assert expected is not None, "ORT refuses it, weightshare converted it"
    after = _ort(tmp_path / "out" / "m.onnx")
    assert after is not None and after.tobytes() == expected.tobytes() == DATA.tobytes()
