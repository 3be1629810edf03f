"""``weightshare.litert.interpreter``: the Interpreter API, XNNPACK with the shared weight cache.

Outputs are compared bit for bit with LiteRT's default Interpreter (XNNPACK) on the *original* model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from ai_edge_litert.interpreter import Interpreter
from tflite_fixtures import ModelBuilder, float_graph, int8_graph, sample_model

from weightshare.api import convert
from weightshare.litert import interpreter
from weightshare.options import ConvertOptions


def _feeds(details: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, d in details.items():
        dt = np.dtype(d["dtype"])
        shape = [int(x) for x in d["shape"]]
        out[name] = (
            rng.standard_normal(shape).astype(dt) if dt.kind == "f" else rng.integers(-100, 100, shape).astype(dt)
        )
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("helper")
    src = sample_model(root / "m.tflite")
    convert(src, root / "out", ConvertOptions(prepack=True))
    mb = ModelBuilder()  # no SignatureDefs (as MediaPipe's models): only the primary subgraph API
    float_graph(mb, np.random.default_rng(3))
    int8_graph(mb, np.random.default_rng(4))
    nosig = mb.save(root / "nosig.tflite")
    convert(nosig, root / "out", ConvertOptions(prepack=True))
    return src, root / "out" / src.name, nosig, root / "out" / nosig.name


def test_signature_runners_match_the_default_interpreter(models):
    src, out, _n, _no = models
    ref = Interpreter(model_path=str(src))
    it = interpreter(out)
    assert it.weightshare_cache is not None and it.weightshare_cache.parent == out.parent
    assert it.get_signature_list() == ref.get_signature_list()
    for key in ref.get_signature_list():
        ra, rb = ref.get_signature_runner(key), it.get_signature_runner(key)
        da, db = ra.get_input_details(), rb.get_input_details()
        assert {n: (d["index"], str(d["dtype"]), d["quantization"]) for n, d in da.items()} == {
            n: (d["index"], str(d["dtype"]), d["quantization"]) for n, d in db.items()
        }
        for seed in range(2):
            feeds = _feeds(da, seed)
            oa, ob = ra(**feeds), rb(**feeds)
            assert oa.keys() == ob.keys()
            assert all(oa[n].dtype == ob[n].dtype and np.array_equal(oa[n], ob[n]) for n in oa)


def _primary(it, x: np.ndarray) -> np.ndarray:
    it.allocate_tensors()
    it.set_tensor(it.get_input_details()[0]["index"], x)
    it.invoke()
    return np.array(it.get_tensor(it.get_output_details()[0]["index"]))


def test_primary_subgraph_api_without_signature_defs(models):
    _s, _o, nosig, out = models
    ref = Interpreter(model_path=str(nosig))
    it = interpreter(out, num_threads=2)
    assert it.weightshare_cache is not None
    assert it.get_signature_list() == {} == ref.get_signature_list()
    assert [(d["name"], d["index"]) for d in it.get_input_details()] == [
        (d["name"], d["index"]) for d in ref.get_input_details()
    ]
    x = np.random.default_rng(5).standard_normal([1, 8, 8, 3]).astype(np.float32)
    assert np.array_equal(_primary(ref, x), _primary(it, x))
    assert np.array_equal(it.get_tensor(it.get_input_details()[0]["index"]), x)
    with pytest.raises(ValueError):
        it.get_signature_runner("serving_default")
    with pytest.raises(ValueError):
        it.get_tensor(3)  # an intermediate: CompiledModel does not expose it
    with pytest.raises(ValueError, match="type"):
        it.set_tensor(it.get_input_details()[0]["index"], x.astype(np.float64))


def test_without_a_cache_it_still_runs(models, tmp_path, caplog):
    src, _o, _n, _no = models
    plain = Path(convert(src, tmp_path).outputs[0])
    it = interpreter(plain)
    assert it.weightshare_cache is None
    ref = Interpreter(model_path=str(src))
    feeds = _feeds(ref.get_signature_runner("serving_default").get_input_details(), 1)
    a = ref.get_signature_runner("serving_default")(**feeds)
    b = it.get_signature_runner("serving_default")(**feeds)
    assert np.array_equal(a["y"], b["y"])


def test_weight_only_int8_after_unpack_and_prepack(tmp_path):
    """The documented recipe for weight-only int8: --unpack dequantize --prepack, then the helper: the bytes the
    default Interpreter gives on the original, with nothing unpacked per instance."""
    from test_tflite_dequantize import fc_model

    src = fc_model(tmp_path / "wo.tflite", "int8 per channel dim 0")
    convert(src, tmp_path / "out", ConvertOptions(prepack=True, unpack=frozenset({"dequantize"})))
    it = interpreter(tmp_path / "out" / src.name)
    assert it.weightshare_cache is not None
    ref = Interpreter(model_path=str(src)).get_signature_runner("serving_default")
    x = np.random.default_rng(0).standard_normal((2, 40)).astype(np.float32)
    a, b = ref(x=x)["y"], it.get_signature_runner("serving_default")(x=x)["y"]
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture(scope="module")
def converter_style(tmp_path_factory):
    """Models named as the converters name them: signature inputs are not the tensors' names (``x`` vs
    ``serving_default_x:0``; litert-torch's ``input_pos`` vs ``decode_input_pos:0``), and two signatures of one LM
    over one copy of the weights."""
    from tflite_fixtures import keras_style_model, two_signature_lm

    root = tmp_path_factory.mktemp("converter_style")
    out = {}
    for name, build in (("keras", keras_style_model), ("lm", two_signature_lm)):
        src = build(root / f"{name}.tflite")
        convert(src, root / "out", ConvertOptions(prepack=True))
        out[name] = (src, root / "out" / src.name)
    return out


def _in_range_feeds(details: dict, seed: int) -> dict[str, np.ndarray]:
    """Random values; token ids and positions (int32) inside the tables they index (the fixtures' sizes)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, d in details.items():
        shape = [int(x) for x in d["shape"]]
        if np.dtype(d["dtype"]).kind == "i":
            feeds[name] = rng.integers(0, 32 if name == "input_pos" else 2048, shape).astype(np.int32)
        else:
            feeds[name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


@pytest.mark.parametrize("name", ["keras", "lm"])
def test_signature_names_differ_from_tensor_names(converter_style, name):
    """Every signature of the converter-style models, by the signature's names, through the helper on the
    converted model: the bytes the default Interpreter gives on the original, at batch 1 and 3 (Keras)."""
    src, out = converter_style[name]
    ref = Interpreter(model_path=str(src))
    it = interpreter(out)
    assert it.weightshare_cache is not None
    assert it.get_signature_list() == ref.get_signature_list()
    for key in ref.get_signature_list():
        ra, rb = ref.get_signature_runner(key), it.get_signature_runner(key)
        assert {n: d["name"] for n, d in ra.get_input_details().items()} == {
            n: d["name"] for n, d in rb.get_input_details().items()
        }
        assert any(n != d["name"] for n, d in rb.get_input_details().items())  # the point of the fixture
        for seed in range(2):
            feeds = _in_range_feeds(ra.get_input_details(), seed)
            if name == "keras" and seed:
                feeds = {"x": np.random.default_rng(seed).standard_normal((3, 64)).astype(np.float32)}
            oa, ob = ra(**feeds), rb(**feeds)
            assert oa.keys() == ob.keys() == set(ref.get_signature_list()[key]["outputs"])
            assert all(oa[n].dtype == ob[n].dtype and np.array_equal(oa[n], ob[n]) for n in oa), key


def test_two_signature_lm_prefill_then_decode_chain(converter_style):
    """prefill, then 3 decode steps feeding the KV outputs back, through the helper and the default Interpreter."""
    src, out = converter_style["lm"]
    ref, it = Interpreter(model_path=str(src)), interpreter(out)
    rng = np.random.default_rng(7)
    feeds = {
        "tokens": rng.integers(0, 2048, (1, 8)).astype(np.int32),
        "input_pos": np.arange(8, dtype=np.int32),
        "kv_cache_k_0": np.zeros((1, 32, 128), np.float32),
        "kv_cache_v_0": np.zeros((1, 32, 128), np.float32),
    }
    state = {"a": dict(feeds), "b": dict(feeds)}
    for step, key in enumerate(["prefill", "decode", "decode", "decode"]):
        outs = {}
        for side, interp in (("a", ref), ("b", it)):
            outs[side] = interp.get_signature_runner(key)(**state[side])
        assert all(np.array_equal(outs["a"][n], outs["b"][n]) for n in outs["a"]), step
        token = np.argmax(outs["a"]["logits"][0, -1]).astype(np.int32).reshape(1, 1)
        for side in "ab":
            state[side] = {
                "tokens": token,
                "input_pos": np.array([8 + step], np.int32),
                "kv_cache_k_0": outs[side]["kv_cache_k_0"],
                "kv_cache_v_0": outs[side]["kv_cache_v_0"],
            }
