"""What `inspect` says a runtime copies per session agrees with what the runtime does (PSS, measured).

Before: a Conv model (NCHWc-eligible weights) and a MatMul model, converted; a TFLite model with an inline
fp32 FULLY_CONNECTED weight. Under test: ``inventory(...).copied_under(setting)`` against the PSS growth from 1
to 3 sessions in a fresh child process, per runtime setting (ORT disable_prepacking / defaults, LiteRT no
delegate / XNNPACK / CompiledModel with an XNNPACK weight cache). After: where inspect predicts a copy, each extra
session grows by about that much;
where it predicts none, it grows by a small fraction of the weights. Generous bounds: the machine is shared.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from tflite_fixtures import OP, ModelBuilder, s

from weightshare._check import Gate, findings_for
from weightshare._dispatch import inventory
from weightshare.api import convert

MIB = 1 << 20

ORT_CHILD = r"""
import json, sys, numpy as np, onnxruntime as ort
def pss():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
keep, out = [], {}
for path in sys.argv[1:]:
    for setting in ("ort-disable-prepacking", "ort-default"):
        sizes = []
        for _ in range(3):
            so = ort.SessionOptions()
            if setting == "ort-disable-prepacking":
                so.add_session_config_entry("session.disable_prepacking", "1")
            sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            i = sess.get_inputs()[0]
            sess.run(None, {i.name: np.ones(i.shape, np.float32)})
            keep.append(sess)  # alive: freed heap would be reused by the next session and hide its cost
            sizes.append(pss())
        out[f"{path}|{setting}"] = (sizes[2] - sizes[0]) / 2
print(json.dumps(out))
"""

LITERT_CHILD = r"""
import json, sys, numpy as np
from ai_edge_litert.interpreter import Interpreter, OpResolverType
def pss():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
keep, out = [], {}
path = sys.argv[1]
for setting, resolver in (("litert-builtin", OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES),
                          ("litert-xnnpack", OpResolverType.AUTO)):
    sizes = []
    for _ in range(3):
        it = Interpreter(model_path=path, experimental_op_resolver_type=resolver)
        run = it.get_signature_runner("serving_default")
        run(x=np.ones((1, 1024), np.float32))
        keep.append((it, run))
        sizes.append(pss())
    out[setting] = (sizes[2] - sizes[0]) / 2
from ai_edge_litert.compiled_model import CompiledModel
from ai_edge_litert.cpu_options import CpuOptions
from ai_edge_litert.options import Options
def compiled():
    cm = CompiledModel.from_file(path, options=Options(cpu_options=CpuOptions(xnnpack_weight_cache_path=cache)))
    ins, outs = cm.create_input_buffers(0), cm.create_output_buffers(0)
    ins[0].write(np.ones((1, 1024), np.float32))
    cm.run_by_index(0, ins, outs)
    return cm, ins, outs
cache = sys.argv[2]
del_me = compiled()  # builds the cache file ahead of the measured instances, as a deployment would
sizes = []
for _ in range(3):
    keep.append(compiled())
    sizes.append(pss())
out["litert-compiled-cache"] = (sizes[2] - sizes[0]) / 2
print(json.dumps(out))
"""


def _save(nodes, x_shape, y, inits, path):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def conv_model(path, channels=256, layers=2):
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((rng.standard_normal((channels, channels, 3, 3)) * 0.02).astype(np.float32), f"w{i}")
        for i in range(layers)
    ]
    nodes = [
        helper.make_node("Conv", ["x" if i == 0 else f"c{i - 1}", f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1])
        for i in range(layers)
    ]
    return _save(nodes, [1, channels, 4, 4], f"c{layers - 1}", inits, path)


def matmul_model(path, dim=1024, layers=2):
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array((rng.standard_normal((dim, dim)) * 0.02).astype(np.float32), f"w{i}")
        for i in range(layers)
    ]
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"m{i - 1}", f"w{i}"], [f"m{i}"]) for i in range(layers)]
    return _save(nodes, [4, dim], f"m{layers - 1}", inits, path)


def fc_tflite(path):
    mb = ModelBuilder()
    g = mb.subgraph("main")
    x = g.input("x", [1, 1024])
    w = g.const("fc_w", (np.random.default_rng(2).standard_normal((2048, 1024)) * 0.02).astype(np.float32))
    y = g.tensor("y", [1, 2048], "float32")
    g.op(OP.FULLY_CONNECTED, [x, w, -1], [y], s.BuiltinOptions.FullyConnectedOptions, s.FullyConnectedOptionsT())
    g.outputs = [y]
    mb.signature("serving_default", g)
    return mb.save(path)


def _agrees(predicted: int, measured: float, weights: int) -> bool:
    if predicted == 0:
        return measured < 0.25 * weights
    return 0.6 * predicted <= measured <= 1.6 * predicted + 2 * MIB


@pytest.mark.slow
def test_onnx_copies_per_setting_match_measured_pss(tmp_path):
    paths = []
    for name, make in (("conv", conv_model), ("mm", matmul_model)):
        make(tmp_path / f"{name}.onnx")
        convert(tmp_path / f"{name}.onnx", tmp_path / name)
        paths.append(tmp_path / name / f"{name}.onnx")
    res = subprocess.run([sys.executable, "-c", ORT_CHILD, *map(str, paths)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    measured = json.loads(res.stdout)
    for path in paths:
        inv = inventory(path)
        weights = inv.external_bytes
        for setting in inv.settings:
            predicted, got = inv.copied_under(setting), measured[f"{path}|{setting}"]
            assert _agrees(predicted, got, weights), (path.name, setting, predicted, got)
    conv, mm = (inventory(p) for p in paths)
    # the facts themselves, so a rule change cannot make both sides agree on nothing
    assert conv.copied_under("ort-disable-prepacking") == 2 * conv.external_bytes  # NCHWc: copied either way
    assert mm.copied_under("ort-disable-prepacking") == 0 and mm.copied_under("ort-default") == mm.external_bytes
    codes = {f.code.value: f for f in findings_for(conv)}
    assert codes["ort-nchwc-copy-per-session"].severity == "error"
    assert "ORT_ENABLE_EXTENDED" in codes["ort-nchwc-copy-per-session"].fix
    codes = {f.code.value: f for f in findings_for(mm, Gate(("ort-disable-prepacking",)))}
    assert codes["ort-prepack-copy-per-session"].severity == "warning"
    # with no target the model is held to ORT's defaults (a plain InferenceSession), where MLAS packs it
    assert {f.code.value: f for f in findings_for(mm)}["ort-prepack-copy-per-session"].severity == "error"
    assert "disable_prepacking" in codes["ort-prepack-copy-per-session"].fix


@pytest.mark.slow
def test_tflite_inline_weights_are_shared_without_delegate_and_packed_by_xnnpack(tmp_path):
    src = fc_tflite(tmp_path / "fc.tflite")
    res = subprocess.run(
        [sys.executable, "-c", LITERT_CHILD, str(src), str(tmp_path / "fc.xnnpack_cache")],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    measured = json.loads(res.stdout)
    inv = inventory(src)
    weights = 2048 * 1024 * 4
    assert [p.location for p in inv.payloads if p.nbytes == weights] == ["embedded"]
    assert inv.copied_under("litert-builtin") == 0 and inv.copied_under("litert-xnnpack") == weights
    assert inv.copied_under("litert-compiled-cache") == 0
    for setting in ("litert-builtin", "litert-xnnpack", "litert-compiled-cache"):
        assert _agrees(inv.copied_under(setting), measured[setting], weights), (setting, measured)
    codes = {f.code.value for f in findings_for(inv)}
    assert "embedded-weights" not in codes  # inline TFLite data is mapped, not copied (the old contradiction)
    assert {"inline-unaligned", "xnnpack-pack-copy-per-interpreter"} <= codes


def test_prepacked_entries_mean_no_default_option_copy(tmp_path):
    """A tensor carrying ORT's `prepacked_*` external-data entry (what --prepack writes) is mapped at default
    options: inspect must not count a per-session pre-pack for it."""
    matmul_model(tmp_path / "mm.onnx", dim=128, layers=1)
    convert(tmp_path / "mm.onnx", tmp_path / "out")
    path = tmp_path / "out" / "mm.onnx"
    assert inventory(path).copied_under("ort-default") == 128 * 128 * 4
    model = onnx.load(str(path), load_external_data=False)
    entry = model.graph.initializer[0].external_data.add()
    entry.key, entry.value = "prepacked_0", "MatMul+0123|0;65536;0"
    onnx.save(model, str(path))
    inv = inventory(path)
    assert inv.copied_under("ort-default") == 0 and "ort-prepack-copy-per-session" not in {
        f.code.value for f in findings_for(inv)
    }
