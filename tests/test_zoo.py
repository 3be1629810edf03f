"""Zoo mode: many models, one deduplicated blob."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh
from safetensors import safe_open

import weightshare
from weightshare._safetensors import read_safetensors_metadata
from weightshare.api import convert_zoo

DIM = 256


def weights(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((DIM, DIM)) / 16).astype(np.float16) for _ in range(n)]


def mlp(path: Path, ws: list[np.ndarray], fp16: bool, batch: int) -> Path:
    """x[batch, DIM] through MatMuls; fp16 weights behind Cast, or the same values stored as fp32."""
    nodes, inits, x = [], [], "x"
    for i, w in enumerate(ws):
        name = f"w{i}"
        inits.append(nh.from_array(w if fp16 else w.astype(np.float32), name))
        if fp16:
            nodes.append(h.make_node("Cast", [name], [f"{name}_f"], to=T.FLOAT))
            name = f"{name}_f"
        y = "y" if i == len(ws) - 1 else f"h{i}"
        nodes.append(h.make_node("MatMul", [x, name], [y]))
        x = y
    g = h.make_graph(
        nodes,
        "mlp",
        [h.make_tensor_value_info("x", T.FLOAT, [batch, DIM])],
        [h.make_tensor_value_info("y", T.FLOAT, [batch, DIM])],
        inits,
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    path.write_bytes(m.SerializeToString())
    return path


def run(path: Path, batch: int) -> np.ndarray:
    x = np.random.default_rng(batch).standard_normal((batch, DIM)).astype(np.float32)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def make_zoo(d: Path) -> dict[str, tuple[Path, int]]:
    shared = weights(0, 3)
    return {
        "a_fp16_b1": (mlp(d / "a_fp16_b1.onnx", shared, fp16=True, batch=1), 1),
        "b_fp32_b4": (mlp(d / "b_fp32_b4.onnx", shared, fp16=False, batch=4), 4),
        "c_extra_b8": (mlp(d / "c_extra_b8.onnx", shared + weights(1, 1), fp16=True, batch=8), 8),
    }


def test_three_models_share_one_blob(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    zoo = make_zoo(src)
    report = convert_zoo([p for p, _ in zoo.values()], tmp_path / "out", "zoo.safetensors")
    blob = Path(report.blob)
    assert blob.parent == tmp_path / "out" and blob.name.startswith("zoo.") and blob.name.endswith(".safetensors")

    for name, (path, batch) in zoo.items():
        out = tmp_path / "out" / path.name
        onnx.checker.check_model(str(out), full_check=True)
        assert np.array_equal(run(path, batch), run(out, batch)), name
        locations = {
            e.value
            for t in onnx.load(str(out), load_external_data=False).graph.initializer
            for e in t.external_data
            if e.key == "location"
        }
        assert locations == {blob.name}

    # 4 distinct fp32 payloads (3 shared + 1 extra) of DIM*DIM*4 bytes, whatever the models stored them as
    unique = 4 * DIM * DIM * 4
    assert report.bytes_written == unique
    assert report.bytes_out == (3 + 3 + 4) * DIM * DIM * 4
    data_start, header, meta = read_safetensors_metadata(str(blob))
    payload = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if not k.startswith("__pad"))
    padding = sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k.startswith("__pad"))
    assert payload == unique
    assert all(v["shape"][0] < 65536 for k, v in header.items() if k.startswith("__pad"))
    assert blob.stat().st_size == data_start + payload + padding
    with safe_open(str(blob), "np") as f:
        for key in f.keys():
            if not key.startswith("__pad"):
                assert blake3.blake3(f.get_tensor(key).tobytes()).hexdigest() == meta[key]["blake3"]
    assert [m.deduplicated for m in report.models] == [0, 3, 3]


@pytest.mark.slow
def test_rerun_with_a_model_added_rebuilds_a_complete_outdir(tmp_path, cli):
    src = tmp_path / "src"
    src.mkdir()
    zoo = make_zoo(src)
    out = tmp_path / "out"
    first = [str(p) for p, _ in list(zoo.values())[:2]]
    assert cli("convert", *first, "-o", out, "--shared-blob", "zoo.safetensors").returncode == 0
    res = cli("convert", src, "-o", out, "--shared-blob", "zoo.safetensors", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    report = doc["reports"][0]["zoo"]
    assert len(doc["reports"]) == 3 and report["dedupe_ratio"] == 2.5
    # a folder given alone keeps its tree (here only models, so nothing else is copied); the run's one blob
    assert all(r["zoo"] == report and r["folder"]["copied"] == [] for r in doc["reports"])
    blob = Path(report["blob"]).name
    # the first run's blob stays for the grace period: readers that opened an old model still find it
    blobs = sorted(p.name for p in out.glob("zoo.*.safetensors"))
    assert len(blobs) == 2 and blob in blobs
    assert sorted(p.name for p in out.iterdir() if p.name not in blobs) == [
        ".weightshare-folder.json",
        ".weightshare-zoo.json",  # the first run's: dropped with its blob, kept for the grace period too
        "a_fp16_b1.onnx",
        "b_fp32_b4.onnx",
        "c_extra_b8.onnx",
    ]
    for path, batch in zoo.values():
        assert np.array_equal(run(path, batch), run(out / path.name, batch))


def test_zoo_refuses_a_foreign_nonempty_outdir(tmp_path, cli):
    src = tmp_path / "src"
    src.mkdir()
    make_zoo(src)
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    res = cli("convert", *sorted(src.glob("*.onnx")), "-o", out, "--shared-blob", "zoo.safetensors")
    assert res.returncode == 2 and "not empty" in res.stderr
    assert (out / "precious.txt").read_text() == "keep me"
    # a model folder given alone keeps its tree beside what OUT holds, as a plain folder run does
    assert cli("convert", src, "-o", out, "--shared-blob", "zoo.safetensors", "--blob-grace", "0").returncode == 0
    assert (out / "precious.txt").read_text() == "keep me"


def test_single_model_api_still_writes_its_own_blob(tmp_path):
    path, _ = make_zoo(tmp_path)["a_fp16_b1"]
    report = weightshare.convert(path, tmp_path / "one")
    blob = Path(report.outputs[1])
    assert blob.name.startswith("a_fp16_b1.weights.") and blob.suffix == ".safetensors"


def test_onnx_and_tflite_external_share_one_blob(tmp_path):
    """ONNX models and a TFLite --external model in one zoo: one blob, each model gives equal outputs."""
    from test_tflite_convert import assert_same_outputs, run_compiled
    from tflite_fixtures import sample_model

    src = tmp_path / "src"
    src.mkdir()
    zoo = make_zoo(src)
    tfl = sample_model(src / "t.tflite", fc_out=64)
    models = [p for p, _ in zoo.values()] + [tfl]
    report = convert_zoo(models, tmp_path / "out", "zoo.safetensors", weightshare.ConvertOptions(external=True))
    out = tmp_path / "out"
    assert [Path(m.model).name for m in report.models] == [p.name for p in models]
    for name, (path, batch) in zoo.items():
        assert np.array_equal(run(path, batch), run(out / path.name, batch)), name
    assert_same_outputs(run_compiled(tfl), run_compiled(out / "t.tflite"))
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        ["a_fp16_b1.onnx", "b_fp32_b4.onnx", "c_extra_b8.onnx", "t.tflite", Path(report.blob).name]
    )
    with safe_open(report.blob, "np") as f:
        names = list(f.keys())
    assert any(n.startswith("t/") for n in names) and any(n.startswith("a_fp16_b1/") for n in names)
