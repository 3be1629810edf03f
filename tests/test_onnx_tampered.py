"""Re-converting a weightshare output checks the digests (BLAKE3, or SHA-256 in older blobs) its blob records:
a modified payload is refused
(exit 2, one line naming the tensor, nothing written) instead of being laundered into fresh digests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

import weightshare


def _first_output(tmp_path: Path) -> tuple[Path, Path, dict[str, tuple[int, int]]]:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(2001).astype(np.float32), n) for n in ("a", "b")]
    inits.append(numpy_helper.from_array(rng.standard_normal(2001).astype(np.float16), "h"))
    nodes = [
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("Cast", ["h"], ["hf"], to=TP.FLOAT),
        helper.make_node("Add", ["s", "hf"], ["y"]),
    ]
    g = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", TP.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "m.onnx")
    report = weightshare.convert(tmp_path / "m.onnx", tmp_path / "v1")
    model = next(Path(p) for p in report.outputs if p.endswith(".onnx"))
    blob = next(Path(p) for p in report.outputs if not p.endswith(".onnx"))
    out = onnx.load(model, load_external_data=False)
    where = {}
    for t in out.graph.initializer:
        entries = {e.key: e.value for e in t.external_data}
        where[t.name] = (int(entries["offset"]), int(entries["length"]))
    return model, blob, where


def test_untouched_output_reconverts(tmp_path):
    model, _, _ = _first_output(tmp_path)
    report = weightshare.convert(model, tmp_path / "v2")
    assert report.tensors_moved == 3


def test_modified_payload_is_refused(tmp_path, cli):
    model, blob, where = _first_output(tmp_path)
    offset, length = where["b"]
    with open(blob, "r+b") as f:  # one bit, in the middle of b's bytes
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 1]))
    res = cli("convert", model, "-o", tmp_path / "v2")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "'b'" in lines[0] and str(blob.name) in lines[0], lines
    assert "digest weightshare recorded" in lines[0], lines
    assert not (tmp_path / "v2").exists() or not any((tmp_path / "v2").iterdir())


def test_modified_padding_is_not_a_payload(tmp_path):
    model, blob, where = _first_output(tmp_path)
    spans = sorted(where.values())
    gap = spans[0][0] + spans[0][1]  # just past the first payload: alignment padding, no tensor's bytes
    assert gap < spans[1][0]
    with open(blob, "r+b") as f:
        f.seek(gap)
        f.write(b"\xff")
    weightshare.convert(model, tmp_path / "v2")
