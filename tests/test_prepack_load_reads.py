"""convert --prepack --inline-threshold 0: onnxruntime saves its optimized graph with every initializer external,
the small constants ONNX shape inference reads at load included (a Reshape's shape, Slice's starts, Resize's
scales), and refuses to load what it saved. The prepacked model keeps those inline, as the plain conversion does,
and a pair the installed onnxruntime would refuse is never written: one line, nothing in OUT."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import model_forms as mf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import weightshare
from weightshare.errors import Unsupported
from weightshare.formats.onnx.ort import prepack


def _save(path: Path, nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], shape: list[object]) -> Path:
    graph = h.make_graph(
        nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, shape)], [h.make_tensor_value_info("z", T.FLOAT, None)]
    )
    graph.initializer.extend(inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def shape_chain(path: Path, d: int = 64) -> Path:
    """MatMul -> Shape -> Slice -> Concat -> Reshape: Slice's starts and ends are read at load."""
    rng = np.random.default_rng(0)
    inits = [
        nh.from_array(rng.standard_normal((d, d)).astype(np.float32), "w"),
        nh.from_array(np.array([0], np.int64), "starts"),
        nh.from_array(np.array([2], np.int64), "ends"),
        nh.from_array(np.array([-1], np.int64), "tail"),
    ]
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["y"]),
        h.make_node("Shape", ["y"], ["s"]),
        h.make_node("Slice", ["s", "starts", "ends"], ["s2"]),
        h.make_node("Concat", ["s2", "tail"], ["shape"], axis=0),
        h.make_node("Reshape", ["y", "shape"], ["z"]),
    ]
    return _save(path, nodes, inits, ["b", 4, d])


def resize_scales(path: Path, d: int = 64) -> Path:
    """MatMul then Resize by float scales (its input 2): the scales are read at load, whatever their type."""
    rng = np.random.default_rng(1)
    inits = [
        nh.from_array(rng.standard_normal((d, d)).astype(np.float32), "w"),
        nh.from_array(np.array([1.0, 1.0, 2.0, 1.0], np.float32), "scales"),
    ]
    nodes = [h.make_node("MatMul", ["x", "w"], ["y"]), h.make_node("Resize", ["y", "", "scales"], ["z"])]
    return _save(path, nodes, inits, ["b", 2, 4, d])


def _feeds(src: Path, batch: int) -> dict[str, np.ndarray]:
    model = onnx.load(str(src), load_external_data=False)
    dims = [x.dim_value for x in model.graph.input[0].type.tensor_type.shape.dim]
    return {"x": np.random.default_rng(batch).standard_normal([batch, *dims[1:]], dtype=np.float32)}


def _assert_bit_identical(src: Path, outputs: list[str], feeds: object = _feeds) -> None:
    """Prepacked vs original at default options; portable vs original with pre-packing off; batch 1 and 8."""
    off = ort.SessionOptions()
    off.add_session_config_entry("session.disable_prepacking", "1")
    pairs = [
        (ort.InferenceSession(str(src)), ort.InferenceSession(outputs[0])),
        (ort.InferenceSession(str(src), off), ort.InferenceSession(outputs[1], off)),
    ]
    for batch in (1, 8):
        x = feeds(src, batch)  # type: ignore[operator]
        for original, converted in pairs:
            a, b = original.run(None, x)[0], converted.run(None, x)[0]
            assert a.shape[0] == batch and np.abs(a.astype(np.float32)).max() > 0
            assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("build", [shape_chain, resize_scales])
def test_constants_read_at_load_stay_inline_at_threshold_zero(build, tmp_path, cli):
    src = build(tmp_path / "src" / "model.onnx")
    res = cli("convert", src, "-o", tmp_path / "out", "--prepack", "--inline-threshold", "0", "--json", "-q")
    assert res.returncode == 0, res.stderr
    outputs = json.loads(res.stdout)["reports"][0]["outputs"]
    _assert_bit_identical(src, outputs)
    packed = onnx.load(outputs[0], load_external_data=False)
    inline = {t.name for t in packed.graph.initializer if t.data_location != T.EXTERNAL}
    assert {"starts", "ends"} <= inline if build is shape_chain else "scales" in inline
    assert any(t.data_location == T.EXTERNAL for t in packed.graph.initializer)  # the weights are still shared
    assert cli("check", "--no-measure", tmp_path / "out").returncode == 0


def test_fp16_decoder_at_threshold_zero_converts_bit_identical(tmp_path, cli):
    src = mf.build("llama_fp16", tmp_path / "src" / "model.onnx", mib=1)
    res = cli("convert", src, "-o", tmp_path / "out", "--prepack", "--inline-threshold", "0", "--json", "-q")
    assert res.returncode == 0, res.stderr
    _assert_bit_identical(src, json.loads(res.stdout)["reports"][0]["outputs"], mf.feeds)


def test_plain_conversion_keeps_resize_scales_inline_at_threshold_zero(tmp_path):
    """The portable model is the plain conversion's: a float tensor read at load stays inline too."""
    src = resize_scales(tmp_path / "src" / "model.onnx")
    report = weightshare.convert(src, tmp_path / "out", inline_threshold=0)
    ort.InferenceSession(report.outputs[0])  # base: "Cannot parse data from external tensors ... scales"
    _assert_bit_identical(src, [report.outputs[0], report.outputs[0]])


def _refusal(src: Path, out: Path) -> str:
    """The line ``convert --prepack --inline-threshold 0`` refuses ``src`` with. The traceback is dropped here: it
    holds the run, whose onnxruntime child lives as long as the run does (later tests count live children)."""
    try:
        weightshare.convert(src, out, prepack=True, inline_threshold=0)
    except Unsupported as e:
        return e.line()
    finally:
        gc.collect()
    raise AssertionError(f"{src} was converted")


@pytest.mark.parametrize("form", ["shape_chain", "llama_fp16"])
def test_a_pair_onnxruntime_refuses_is_never_written(form, tmp_path, monkeypatch):
    """The load checks are the backstop: with the tensors ORT reads at load left where ORT put them (the write-back
    disabled), the conversion is refused in one line naming the model and ORT's reason, and OUT stays empty (the
    fp16 decoder's is met first by the reload check of its inserted Casts, which loaded a staging file)."""
    path = tmp_path / "src" / "model.onnx"
    src = shape_chain(path) if form == "shape_chain" else mf.build(form, path, mib=1)
    monkeypatch.setattr(prepack, "inline_load_reads", lambda model, stage: 0)
    out = tmp_path / "out"
    line = _refusal(src, out)
    assert line.startswith(f"{src}: --prepack: refused: ") and "\n" not in line
    assert "Cannot parse data from external tensors" in line
    if form == "shape_chain":
        assert "model.onnx: " in line and "starts" in line
    assert ".weightshare-tmp" not in line and "probe" not in line and str(tmp_path / "out") not in line
    assert not out.exists() or not any(out.iterdir())


def _all_external(src: Path, dst: Path) -> Path:
    """``src`` saved with every initializer in external data, the shape constants included."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(onnx.load(str(src)), str(dst), save_as_external_data=True, location="w.data", size_threshold=0)
    return dst


def _range_model(path: Path) -> Path:
    """Range(x, limit, delta) with the constants external: ONNX shape inference does not read them (x is not
    constant), and onnxruntime loads the model."""
    inits = [nh.from_array(np.array(5.0, np.float32), "limit"), nh.from_array(np.array(1.0, np.float32), "delta")]
    return _save(path, [h.make_node("Range", ["x", "limit", "delta"], ["z"])], inits, [])


def test_check_names_a_shape_constant_onnxruntime_cannot_read(tmp_path, cli):
    src = shape_chain(tmp_path / "src" / "model.onnx")
    bad = _all_external(src, tmp_path / "bad" / "model.onnx")
    with pytest.raises(Exception, match="Cannot parse data from external tensors"):
        ort.InferenceSession(str(bad))
    res = cli("check", "--no-measure", bad)
    assert res.returncode == 1
    refused = [line for line in res.stdout.splitlines() if ": error: runtime-refuses-model: " in line]
    assert [line.split(": ")[3].split()[0] for line in refused] == ["'starts'", "'ends'"]  # not the Concat's 'tail'
    # the rule is as narrow as onnxruntime: an external constant its shape inference does not read is no finding
    fine = _all_external(_range_model(tmp_path / "range" / "src.onnx"), tmp_path / "range" / "model.onnx")
    ort.InferenceSession(str(fine))
    assert "runtime-refuses-model" not in cli("check", "--no-measure", fine).stdout
