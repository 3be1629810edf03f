"""--unpack ort-cpu at ORT's default options: bit-identical to the original, or refused in one line.

Once the Casts ORT's CPU provider inserts are in the file, the graph is fp32 where it was fp16, and ORT's fp32
fusions apply where they did not before (MatMul(Q, K^T) / scale -> FusedMatMul, MatMulScaleFusion). A fusion
that rounds differently (x * (1/7) is not x / 7) must not pass silently: the conversion compares what ORT fuses
in the original and in the converted graph and refuses the model, naming the fusion. A power-of-two scale
(sqrt(64) = 8, BERT's head size) fuses exactly and is converted.
"""

from __future__ import annotations

from pathlib import Path

import model_forms as mf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper as nh

from weightshare.formats.onnx.ort.cpu import rounding_change

pytestmark = pytest.mark.slow  # an ORT probe child and a check child per conversion, many sessions


def _outputs_equal(src: Path, out: Path) -> int:
    """Comparisons made (seeds x batches x sequence lengths); asserts each is bit-identical."""
    a, b = ort.InferenceSession(str(src)), ort.InferenceSession(str(out))
    n = 0
    for seed in (1, 2, 3):
        for batch in (1, 2, 8):
            for seq in (1, 7, 33):
                feeds = mf.feeds(src, batch=batch, seq=seq, seed=seed)
                x, y = a.run(None, feeds)[0], b.run(None, feeds)[0]
                assert x.dtype == y.dtype and np.array_equal(x, y), (seed, batch, seq)
                n += 1
    return n


def _optimized_ops(path: Path, tmp: Path) -> list[onnx.NodeProto]:
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp / f"{path.stem}.opt.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(str(path), so)
    return list(onnx.load(so.optimized_model_filepath, load_external_data=False).graph.node)


@pytest.mark.parametrize("form", ["fp16", "fp16_fused"])
def test_unfused_and_fused_fp16_transformers_are_bit_identical(tmp_path, cli, form):
    build = {"fp16": mf.fp16_transformer, "fp16_fused": mf.fp16_fused_transformer}[form]  # fp16_fused is kept out
    src = build(tmp_path / "src" / "model.onnx", mib=2)  # of FORMS, which the --prepack form tests run one by one
    res = cli("convert", src, "-o", tmp_path / "out", "--unpack", "ort-cpu", "-q")
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out" / "model.onnx"
    converted = onnx.load(str(out), load_external_data=False)
    assert any(n.name.startswith("InsertedPrecisionFreeCast_") for n in converted.graph.node)  # Casts adopted
    assert _outputs_equal(src, out) == 27


def test_unfused_fp16_scale_is_not_fused_even_by_a_power_of_two(tmp_path, cli):
    """The unfused model's attention scale is sqrt(64) = 8: with the Casts in the file ORT would make
    FusedMatMul(alpha=0.125), which the original does not have. Even a power-of-two alpha is not the same
    arithmetic (FusedMatMul took another GEMM path at batch 1 on a generated fp16 model: 1.9e-6 apart), so the
    Div gets Expand(scalar, Shape(x)) and no FusedMatMul is left."""
    src = mf.build("fp16", tmp_path / "src" / "model.onnx", mib=2)
    res = cli("convert", src, "-o", tmp_path / "out", "--unpack", "ort-cpu")
    assert res.returncode == 0, res.stderr
    assert "Expand(scalar, Shape(x))" in res.stdout
    out = tmp_path / "out" / "model.onnx"
    assert not [n for n in _optimized_ops(out, tmp_path) if n.op_type == "FusedMatMul"]
    assert not [n for n in _optimized_ops(src, tmp_path) if n.op_type == "FusedMatMul"]
    _outputs_equal(src, out)


def test_a_fusion_that_changes_the_rounding_is_refused_in_one_line(tmp_path, cli):
    src = mf.build("fp16", tmp_path / "src" / "model.onnx", mib=2)
    model = onnx.load(str(src))
    for t in model.graph.initializer:
        if t.name == "scale":  # a head size whose sqrt is not a power of two: x * (1/7) != x / 7
            t.CopyFrom(nh.from_array(np.array(7.0, np.float16), "scale"))
    onnx.save(model, str(src))
    # without the flag the conversion is exact; with it ORT would fuse the Div and round differently
    assert cli("convert", src, "-o", tmp_path / "plain", "-q").returncode == 0
    _outputs_equal(src, tmp_path / "plain" / "model.onnx")
    # The Div by the scalar is given Expand(7, Shape(x)) (ort/unfuse.unfuse_scales): the same quotients, no fusion.
    res = cli("convert", src, "-o", tmp_path / "out", "--unpack", "ort-cpu")
    assert res.returncode == 0, res.stderr
    assert "Expand(scalar, Shape(x))" in res.stdout
    _outputs_equal(src, tmp_path / "out" / "model.onnx")


@pytest.mark.parametrize("windows", [False, True])
def test_a_fusion_that_changes_the_rounding_and_is_not_undone_is_refused_in_one_line(tmp_path, monkeypatch, windows):
    """Also when the check optimizes the graph window by window (what bounds its child on large models): each
    window is the whole graph with the other windows' weights as inputs, so the fusion that depends on how many
    nodes read the shared fp16 scale (none in the original, all once converted) is still found; a graph cut in
    pieces fused it in the original's pieces too and let it through."""
    import weightshare
    from weightshare.errors import Unsupported
    from weightshare.formats.onnx.ort import cpu as ortcpu
    from weightshare.formats.onnx.ort import unfuse

    used: list[int] = []
    if windows:
        monkeypatch.setattr(ortcpu, "CHECK_SEGMENT_BYTES", 640 << 10)  # the model's 2 MiB: 3 chunks, 2 windows
        found = ortcpu._windows
        monkeypatch.setattr(ortcpu, "_windows", lambda probe: used.append(len(w := found(probe) or [])) or w or None)

    src = mf.build("fp16", tmp_path / "src" / "model.onnx", mib=2)
    model = onnx.load(str(src))
    for t in model.graph.initializer:
        if t.name == "scale":
            t.CopyFrom(nh.from_array(np.array(7.0, np.float16), "scale"))
    onnx.save(model, str(src))
    monkeypatch.setattr(unfuse, "unfuse_scales", lambda model: 0)  # our repair off, not onnxruntime's behaviour
    with pytest.raises(Unsupported) as e:
        weightshare.convert(src, tmp_path / "out", unpack=["ort-cpu"])
    line = str(e.value)
    assert "\n" not in line
    assert "--unpack ort-cpu: refused" in line and "MatMulScaleFusion" in line and "FusedMatMul" in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    if windows:
        assert used and used[0] >= 2
        monkeypatch.undo()  # the repair back on, windows kept: no window refuses what the whole graph accepts
        monkeypatch.setattr(ortcpu, "CHECK_SEGMENT_BYTES", 640 << 10)
        weightshare.convert(src, tmp_path / "fixed", unpack=["ort-cpu"])


def _graph(*ops: tuple[str, str, dict[str, float | int]]) -> onnx.GraphProto:
    g = onnx.GraphProto()
    for i, (domain, op, attrs) in enumerate(ops):
        n = onnx.helper.make_node(op, [], [f"o{i}"], name=f"/MatMulScaleFusion/{i}", domain=domain, **attrs)
        g.node.append(n)
    return g


def test_rounding_change_allows_no_fusion():
    original = _graph(("", "MatMul", {}), ("", "Div", {}), ("", "Cast", {"to": 1}))
    same = _graph(("", "MatMul", {}), ("", "Div", {}))  # Casts do not count
    assert rounding_change(original, same) is None
    # not even a power-of-two alpha: FusedMatMul took another GEMM path at batch 1 (a generated fp16 model)
    for attrs in ({"alpha": 0.125}, {"alpha": 1 / 7}, {"alpha": 0.125, "transB": 1}):
        said = rounding_change(original, _graph(("com.microsoft", "FusedMatMul", attrs)))
        assert said == "MatMulScaleFusion makes 1 com.microsoft.FusedMatMul of 1 Div, 1 MatMul"


def _conv_bn_fp16(path: Path) -> Path:
    """Conv + BatchNormalization + Relu x 3, converted with convert_float_to_float16(keep_io_types=True)."""
    import warnings

    from onnx import TensorProto as T
    from onnx import helper as h
    from onnxconverter_common import float16

    rng = np.random.default_rng(0)
    c, nodes, inits, x = 128, [], [], "x"
    for i in range(3):
        inits.append(nh.from_array((rng.standard_normal((c, c, 3, 3)) / 32).astype(np.float32), f"w{i}"))
        inits += [nh.from_array((rng.random(c) + 0.5).astype(np.float32), f"{n}{i}") for n in ("s", "v")]
        inits += [nh.from_array((rng.standard_normal(c) / 4).astype(np.float32), f"{n}{i}") for n in ("b", "m")]
        nodes += [
            h.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
            h.make_node("BatchNormalization", [f"c{i}", f"s{i}", f"b{i}", f"m{i}", f"v{i}"], [f"n{i}"]),
            h.make_node("Relu", [f"n{i}"], [f"r{i}"]),
        ]
        x = f"r{i}"
    io = [h.make_tensor_value_info(n, T.FLOAT, ["N", c, 8, 8]) for n in ("x", x)]
    model = h.make_model(h.make_graph(nodes, "g", io[:1], io[1:], inits), opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = float16.convert_float_to_float16(model, keep_io_types=True)
    path.parent.mkdir(parents=True)
    onnx.save(model, str(path), save_as_external_data=True, location="m.data", size_threshold=1024)
    return path


@pytest.mark.parametrize("windows", [False, True])
def test_constants_a_fusion_folds_in_fp16_are_refused_once_fp32(tmp_path, monkeypatch, windows):
    """Conv+BatchNormalization in an fp16 model: ORT fuses it in the original and in the converted graph alike
    (the same ops), but folds the weight and bias in fp16 in the one and in fp32 in the other (outputs 0.002
    apart; converted before). Refused in one line, also when the check runs window by window."""
    import weightshare
    from weightshare.errors import Unsupported
    from weightshare.formats.onnx.ort import cpu as ortcpu

    if windows:
        monkeypatch.setattr(ortcpu, "CHECK_SEGMENT_BYTES", 300 << 10)  # 3 weights of 288 KiB: 2 windows
    src = _conv_bn_fp16(tmp_path / "src" / "m.onnx")
    with pytest.raises(Unsupported) as e:
        weightshare.convert(src, tmp_path / "out", unpack=["ort-cpu"])
    assert "\n" not in str(e.value) and "ConvBnFusion" in str(e.value) and "fp16" in str(e.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
