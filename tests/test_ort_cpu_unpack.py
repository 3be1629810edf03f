"""--unpack ort-cpu: the fp16 -> fp32 Casts ONNX Runtime's CPU provider inserts per session, made once in the file.

Models come from onnxconverter_common's fp16 converter (keep_io_types=True), as users' models do: fp16 weights feed
MatMul/Conv/Add directly, with Casts only at the model's inputs and outputs.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh
from onnxconverter_common import float16

import weightshare
from weightshare._dispatch import inventory
from weightshare._runtimes.ort import measure_sessions
from weightshare.formats.onnx.ort.cpu import ort_cpu_cast_bytes
from weightshare.options import ConvertOptions

ORT_CPU = ConvertOptions(unpack=frozenset({"ort-cpu"}))
DISABLE_PREPACKING = {"session.disable_prepacking": "1"}


def _model(nodes, inits, x_shape, y_name, y_shape) -> onnx.ModelProto:
    g = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, x_shape)],
        [h.make_tensor_value_info(y_name, T.FLOAT, y_shape)],
        inits,
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def mlp_fp32(d: int = 64, layers: int = 3, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits += [
            nh.from_array((rng.standard_normal((d, d)) / d**0.5).astype(np.float32), f"w{i}"),
            nh.from_array((rng.standard_normal(d) / 8).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            h.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
            h.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            h.make_node("Relu", [f"a{i}"], [f"r{i}"]),
        ]
        x = f"r{i}"
    return _model(nodes, inits, ["N", d], x, ["N", d])


def cnn_fp32(c: int = 8, seed: int = 0) -> onnx.ModelProto:
    """Conv + Relu twice, then Reshape and MatMul + Add: the 'small CNN (Conv + MatMul)' of the issue."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: (rng.standard_normal(s) / 8).astype(np.float32)
    inits = [
        nh.from_array(f32(c, 3, 3, 3), "cw0"),
        nh.from_array(f32(c), "cb0"),
        nh.from_array(f32(c, c, 3, 3), "cw1"),
        nh.from_array(f32(c), "cb1"),
        nh.from_array(np.array([0, -1], np.int64), "shape"),
        nh.from_array(f32(c * 64, 10), "fw"),
        nh.from_array(f32(10), "fb"),
    ]
    nodes = [
        h.make_node("Conv", ["x", "cw0", "cb0"], ["c0"], pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c0"], ["r0"]),
        h.make_node("Conv", ["r0", "cw1", "cb1"], ["c1"], pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["c1"], ["r1"]),
        h.make_node("Reshape", ["r1", "shape"], ["f"]),
        h.make_node("MatMul", ["f", "fw"], ["mm"]),
        h.make_node("Add", ["mm", "fb"], ["y"]),
    ]
    return _model(nodes, inits, ["N", 3, 8, 8], "y", ["N", 10])


def attention_fp32(d: int = 32, vocab: int = 50, seed: int = 0) -> onnx.ModelProto:
    """Gather + LayerNorm + self-attention: fp16 Softmax has no CPU kernel, so ORT expands its function body."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: (rng.standard_normal(s) / 8).astype(np.float32)
    inits = [
        nh.from_array(f32(vocab, d), "emb"),
        nh.from_array(np.ones(d, np.float32), "g"),
        nh.from_array(np.zeros(d, np.float32), "beta"),
        nh.from_array(f32(d, d), "wq"),
        nh.from_array(f32(d, d), "wk"),
        nh.from_array(f32(d, d), "wv"),
        nh.from_array(f32(d), "bo"),
    ]
    nodes = [
        h.make_node("Gather", ["emb", "x"], ["e"]),
        h.make_node("LayerNormalization", ["e", "g", "beta"], ["ln"]),
        h.make_node("MatMul", ["ln", "wq"], ["q"]),
        h.make_node("MatMul", ["ln", "wk"], ["k"]),
        h.make_node("MatMul", ["ln", "wv"], ["v"]),
        h.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        h.make_node("MatMul", ["q", "kt"], ["s"]),
        h.make_node("Softmax", ["s"], ["p"], axis=-1),
        h.make_node("MatMul", ["p", "v"], ["o"]),
        h.make_node("Add", ["o", "bo"], ["y"]),
    ]
    m = _model(nodes, inits, ["B", "S"], "y", ["B", "S", d])
    m.graph.input[0].type.tensor_type.elem_type = T.INT64
    return m


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    with warnings.catch_warnings():  # it warns about every weight it rounds to the fp16 range
        warnings.simplefilter("ignore")
        return float16.convert_float_to_float16(model, keep_io_types=True)


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, path)
    return path


def outputs(path, x: np.ndarray, config: dict | None = None) -> np.ndarray:
    so = ort.SessionOptions()
    for k, v in (config or {}).items():
        so.add_session_config_entry(k, v)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def model_out(report) -> Path:
    return Path(next(p for p in report.outputs if p.endswith(".onnx")))


def blob_out(report) -> Path:
    return Path(next(p for p in report.outputs if not p.endswith(".onnx")))


CASES = {
    "mlp": (lambda: to_fp16(mlp_fp32()), (5, 64)),
    "cnn": (lambda: to_fp16(cnn_fp32()), (2, 3, 8, 8)),
    "attention": (lambda: to_fp16(attention_fp32()), (2, 7)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_outputs_bit_identical_and_no_cast_left(tmp_path, name):
    build, x_shape = CASES[name]
    src = save(build(), tmp_path / f"{name}.onnx")
    # ORT CPU casts every fp16 weight of these models per session (but the attention's Gather and LayerNorm run fp16)
    n_weights = sum(1 for t in onnx.load(src).graph.initializer if t.data_type == T.FLOAT16) - 3 * (name == "attention")
    assert ort_cpu_cast_bytes(src)[0] == n_weights

    report = weightshare.convert(src, tmp_path / "out", ORT_CPU)
    out = model_out(report)
    assert report.unpacked == n_weights and report.ops_removed == n_weights
    assert any("onnxruntime" in n and "CPU-specific" in n for n in report.notes)
    assert ort_cpu_cast_bytes(out) == (0, 0)  # nothing left for ORT to copy per session

    rng = np.random.default_rng(1)
    x = rng.integers(0, 50, x_shape) if name == "attention" else rng.standard_normal(x_shape).astype(np.float32)
    for config in (None, DISABLE_PREPACKING):  # default options, and the sharing configuration
        want, got = outputs(src, x, config), outputs(out, x, config)
        assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes())

    meta = _blob_metadata(blob_out(report))
    assert meta["weightshare.onnxruntime"] == ort.__version__ and meta["weightshare.unpack"] == "ort-cpu"


def _blob_metadata(path: Path) -> dict:
    import json

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))["__metadata__"]


def test_cast_bytes_counts_fp32_copy(tmp_path):
    src = save(to_fp16(mlp_fp32(d=64, layers=2)), tmp_path / "m.onnx")
    assert ort_cpu_cast_bytes(src) == (4, (64 * 64 + 64) * 2 * 4)
    fp32 = save(mlp_fp32(d=64, layers=2), tmp_path / "f.onnx")
    assert ort_cpu_cast_bytes(fp32) == (0, 0)


@pytest.mark.slow
def test_sessions_share_the_fp32_weights(tmp_path):
    """4 sessions (disable_prepacking) of the converted model cost about one; the original pays a fp32 copy each."""
    d, layers = 1024, 4
    src = save(to_fp16(mlp_fp32(d=d, layers=layers)), tmp_path / "big.onnx")
    out = model_out(weightshare.convert(src, tmp_path / "out", ORT_CPU))
    fp32_mib = d * d * 4 * layers / (1 << 20)  # 16 MiB
    growth = {}
    for label, path in (("original", src), ("converted", out)):
        one, four = measure_sessions(str(path), [1, 4])
        growth[label] = four["pss_mib"] - one["pss_mib"]
        if label == "converted":
            assert four["pss_mib"] <= 1.1 * one["pss_mib"], (one, four)
    assert growth["original"] > 0.75 * 3 * fp32_mib, growth  # the cost exists, so the next line can fail
    assert growth["converted"] < 0.15 * 3 * fp32_mib, growth


def _fingerprint(report) -> str:
    """Model file and payload bytes, with the blob's name and offsets left out (other work changes those)."""
    model = onnx.load(model_out(report), load_external_data=False)
    digest = hashlib.sha256()
    tensors = [t for t in model.graph.initializer if t.data_location == T.EXTERNAL]
    for t in tensors:
        info = {e.key: e.value for e in t.external_data}
        with open(model_out(report).parent / info["location"], "rb") as f:
            f.seek(int(info["offset"]))
            digest.update(f.read(int(info["length"])))
        del t.external_data[:]
        t.external_data.add(key="length", value=info["length"])
    digest.update(model.SerializeToString())
    return digest.hexdigest()


def handmade_fp16(seed: int = 3) -> onnx.ModelProto:
    """The shape of a converter-made fp16 MLP, built with onnx alone so its bytes never depend on the converter."""
    rng = np.random.default_rng(seed)
    w = nh.from_array((rng.standard_normal((64, 64)) / 8).astype(np.float16), "w")
    b = nh.from_array((rng.standard_normal(64) / 8).astype(np.float16), "b")
    nodes = [
        h.make_node("Cast", ["x"], ["x16"], to=T.FLOAT16),
        h.make_node("MatMul", ["x16", "w"], ["m"]),
        h.make_node("Add", ["m", "b"], ["a"]),
        h.make_node("Cast", ["a"], ["y"], to=T.FLOAT),
    ]
    return _model(nodes, [w, b], ["N", 64], "y", ["N", 64])


# Computed with the code before --unpack ort-cpu existed (commit cc54cfd): without the flag nothing changes.
GOLDEN_NO_FLAG = "d557665d6a69ff67f664d09354f6ea0c7a7fce319c1fc683f0e0759420da87c9"


def test_without_flag_output_is_unchanged(tmp_path):
    src = save(handmade_fp16(), tmp_path / "h.onnx")
    report = weightshare.convert(src, tmp_path / "out")
    assert _fingerprint(report) == GOLDEN_NO_FLAG
    assert not any("ort-cpu" in n for n in report.notes)
    assert "weightshare.onnxruntime" not in _blob_metadata(blob_out(report))


def test_model_without_fp16_is_left_as_it_is(tmp_path):
    src = save(mlp_fp32(d=64, layers=1), tmp_path / "f.onnx")
    plain = weightshare.convert(src, tmp_path / "plain")
    flagged = weightshare.convert(src, tmp_path / "flagged", ORT_CPU)
    assert _fingerprint(flagged) == _fingerprint(plain)
    assert any("inserts no Cast" in n for n in flagged.notes)


@pytest.mark.slow
def test_weight_with_signalling_nans_stays_fp16_and_outputs_match(tmp_path):
    """ORT's own Cast quiets a signalling NaN in SIMD blocks and keeps it in the scalar tail, so no fixed fp32
    payload matches it everywhere: such a weight keeps ORT's Cast (it stays fp16) and the outputs stay exact."""
    m = handmade_fp16()
    w = nh.to_array(m.graph.initializer[0]).copy()
    w.view(np.uint16)[0, :4] = [0x7C01, 0xFC01, 0x7E00, 0x7D55]  # signalling and quiet NaNs
    m.graph.initializer[0].CopyFrom(nh.from_array(w, "w"))
    src = save(m, tmp_path / "n.onnx")
    report = weightshare.convert(src, tmp_path / "out", ORT_CPU)
    converted = onnx.load(model_out(report), load_external_data=False)
    w_out = next(t for t in converted.graph.initializer if list(t.dims) == [64, 64])
    assert w_out.data_type == T.FLOAT16
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    assert outputs(model_out(report), x).tobytes() == outputs(src, x).tobytes()


@pytest.mark.slow
def test_unloadable_model_fails_in_one_line(tmp_path, cli):
    m = handmade_fp16()
    m.graph.node[1].domain = "no.such.domain"
    m.opset_import.append(h.make_opsetid("no.such.domain", 1))
    src = save(m, tmp_path / "bad.onnx")
    res = cli("convert", src, "-o", tmp_path / "out", "--unpack", "ort-cpu", "-q")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.onnx" in lines[0] and "onnxruntime" in lines[0], res.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_flag_conflicts_with_keep_packed(tmp_path, cli):
    src = save(handmade_fp16(), tmp_path / "h.onnx")
    res = cli("convert", src, "-o", tmp_path / "out", "--unpack", "ort-cpu", "--keep-packed", "-q")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_subgraph_model_is_left_as_it_is_with_a_note(tmp_path):
    then = h.make_graph(
        [h.make_node("MatMul", ["x16", "w"], ["t"])], "then", [], [h.make_tensor_value_info("t", T.FLOAT16, None)]
    )
    other = h.make_graph(
        [h.make_node("Identity", ["x16"], ["e"])], "else", [], [h.make_tensor_value_info("e", T.FLOAT16, None)]
    )
    m = handmade_fp16()
    m.graph.input.append(h.make_tensor_value_info("cond", T.BOOL, []))
    m.graph.node.insert(1, h.make_node("If", ["cond"], ["x16b"], then_branch=then, else_branch=other))
    m.graph.node[2].input[0] = "x16b"
    src = save(m, tmp_path / "s.onnx")
    report = weightshare.convert(src, tmp_path / "out", ORT_CPU)
    assert any("left as it is" in n and "subgraphs" in n for n in report.notes), report.notes
    assert report.unpacked == 0


@pytest.mark.slow
def test_inspect_reports_the_per_session_cast_and_suggests_the_flag(tmp_path, cli):
    src = save(to_fp16(mlp_fp32(d=64, layers=2)), tmp_path / "m.onnx")
    notes = inventory(src).notes
    assert any("casts 4 fp16 initializers" in n and "--unpack ort-cpu" in n for n in notes), notes
    out = model_out(weightshare.convert(src, tmp_path / "out", ORT_CPU))
    assert not any("--unpack ort-cpu" in n for n in inventory(out).notes)


def test_probe_model_holds_no_weight_bytes(tmp_path):
    """The probe stand-in keeps big payloads out: they map a sparse file of zeros, so the probe is flat in size."""
    from weightshare.formats.onnx.convert import load_skeleton
    from weightshare.formats.onnx.ort.cpu import ZEROS, write_probe_model
    from weightshare.formats.onnx.scan import scan_model

    src = save(to_fp16(mlp_fp32(d=512, layers=2)), tmp_path / "m.onnx")  # 2 x 512 KiB fp16 weights
    skeleton, refs = scan_model(src)
    (tmp_path / "probe").mkdir()
    probe = write_probe_model(load_skeleton(skeleton, src), refs, tmp_path / "probe")
    assert probe.stat().st_size < 16 << 10
    zeros = tmp_path / "probe" / ZEROS
    assert zeros.stat().st_size == 512 * 512 * 2 and zeros.stat().st_blocks * 512 < zeros.stat().st_size  # a hole


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_ort_cpu_with_prepack_shares_at_default_options(tmp_path, cli, name):
    """--unpack ort-cpu --prepack: ORT's inserted Casts done once, then its packed copies stored: plain default
    sessions of OUT/MODEL.onnx compute the original's bits, and check finds nothing copied per session."""
    import json

    build, x_shape = CASES[name]
    src = save(build(), tmp_path / f"{name}.onnx")
    res = cli("convert", src, "-o", tmp_path / "out", "--unpack", "ort-cpu", "--prepack", "--json", "-q")
    assert res.returncode == 0, res.stderr
    (report,) = json.loads(res.stdout)["reports"]
    notes = " ".join(report["notes"])
    assert "--unpack ort-cpu" in notes and "--prepack" in notes
    prepacked, portable = (tmp_path / "out" / src.name), (tmp_path / "out" / f"{name}.portable.onnx")
    assert ort_cpu_cast_bytes(prepacked) == (0, 0) and ort_cpu_cast_bytes(portable) == (0, 0)
    x = np.random.default_rng(1).standard_normal(x_shape).astype(np.float32)
    want, got = outputs(src, x), outputs(prepacked, x)  # both at ORT's default session options
    assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes())
    want, got = outputs(src, x, DISABLE_PREPACKING), outputs(portable, x, DISABLE_PREPACKING)
    assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes())
    check = cli("check", prepacked, "--json")
    codes = {f["code"] for f in json.loads(check.stdout)["findings"]}
    assert not codes & {"unpacked-per-session", "ort-prepack-copy-per-session", "ort-nchwc-copy-per-session"}, codes
