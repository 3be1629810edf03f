"""`weightshare check` over folders, and the codes of broken references (data, not message text).

Before: a folder tree with models at several depths and a Core ML package; models whose external data file is
missing under a name containing '..' (not a path component), or escapes the model directory.
Under test: the CLI (child processes). After: every model is found, the package is one model, each problem has
its own code, and docs/ci.md documents every code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import coreml_fixtures as F
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from weightshare._findings import all_codes

DOCS = Path(__file__).resolve().parent.parent / "docs" / "ci.md"


def _external_model(path: Path, location: str, write_data: bool = True) -> Path:
    """y = x + W with W (4 KiB) in external data at ``location``."""
    w = np.arange(1024, dtype=np.float32)
    t = numpy_helper.from_array(w, "W")
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(w.nbytes))):
        e = t.external_data.add()
        e.key, e.value = k, v
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024])],
        [t],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    if write_data:
        (path.parent / location).write_bytes(w.tobytes())
    return path


@pytest.mark.slow
def test_check_recurses_into_subfolders_and_treats_mlpackages_as_models(cli, tmp_path):
    tree = tmp_path / "modules"
    (tree / "a" / "b").mkdir(parents=True)
    _external_model(tree / "top.onnx", "top.bin")
    _external_model(tree / "a" / "b" / "deep.onnx", "deep.bin")
    F.mlp(tree / "a" / "net.mlpackage", hidden=64)
    res = cli("check", tree, "--json")
    assert res.returncode in (0, 1), res.stderr
    models = [Path(m["model"]).relative_to(tree).as_posix() for m in json.loads(res.stdout)["reports"]]
    assert models == ["top.onnx", "a/net.mlpackage", "a/b/deep.onnx"], models
    empty = tmp_path / "empty" / "sub"
    empty.mkdir(parents=True)
    res = cli("check", tmp_path / "empty")
    assert res.returncode == 2 and "no models found" in res.stderr


@pytest.mark.slow
def test_missing_file_with_dots_in_its_name_is_missing_not_outside(cli, tmp_path):
    model = _external_model(tmp_path / "m.onnx", "weights..bin", write_data=False)
    res = cli("check", model, "--json")
    assert res.returncode == 1
    findings = json.loads(res.stdout)["findings"]
    assert [(f["code"], f["tensor"]) for f in findings] == [("missing-external-file", "W")], findings
    outside = tmp_path / "inner"
    outside.mkdir()
    _external_model(outside / "m.onnx", "../m.data", write_data=False)
    (tmp_path / "m.data").write_bytes(bytes(4096))
    findings = json.loads(cli("check", outside / "m.onnx", "--json").stdout)["findings"]
    assert [f["code"] for f in findings] == ["blob-outside-model-dir"], findings
    short = tmp_path / "short"
    short.mkdir()
    _external_model(short / "m.onnx", "m.bin")
    (short / "m.bin").write_bytes(bytes(100))  # exists, but too short for W
    findings = json.loads(cli("check", short / "m.onnx", "--json").stdout)["findings"]
    assert [f["code"] for f in findings] == ["bad-external-data"], findings


def test_every_finding_code_has_a_meaning_a_fix_and_a_row_in_docs_ci():
    text = DOCS.read_text()
    for code, info in all_codes().items():
        assert info.meaning and info.fix
        rows = [line for line in text.splitlines() if line.startswith(f"| `{code.value}` |")]
        assert rows, f"docs/ci.md has no table row for {code.value}"
        assert f"| {info.severity.value} |" in rows[0], code


def test_check_output_one_line_per_finding_with_severity_and_fix(cli, tmp_path):
    model = _external_model(tmp_path / "m.onnx", "gone.bin", write_data=False)
    res = cli("check", model)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 2
    assert lines[0].startswith(f"{model}: error: missing-external-file: ") and "fix" not in lines[0]
    assert lines[1].startswith("fix: missing-external-file: ")  # each code's fix once, after its findings
    shutil.rmtree(tmp_path)


def _documented_example() -> dict:
    text = DOCS.read_text().split("<!-- check-json-example -->", 1)[1]
    return json.loads(text.split("```json", 1)[1].split("```", 1)[0])


@pytest.mark.slow
def test_check_json_has_one_shape_and_a_schema_and_a_corrupt_file_is_one_finding(cli, tmp_path):
    """`check good.onnx truncated.onnx`: both reported, exit 2; the document is docs/ci.md's example, and has the
    same top-level keys as the document of one model."""
    models = tmp_path / "models"
    models.mkdir()
    _external_model(models / "good.onnx", "good.bin")
    data = (models / "good.onnx").read_bytes()
    (models / "truncated.onnx").write_bytes(data[: len(data) // 2])
    both = cli("check", "models/good.onnx", "models/truncated.onnx", "--json", "--no-measure", cwd=tmp_path)
    assert both.returncode == 2, both.stderr
    doc = json.loads(both.stdout)
    assert doc == _documented_example()
    assert [m["model"] for m in doc["reports"]] == ["models/good.onnx", "models/truncated.onnx"]
    one = cli("check", "models/good.onnx", "--json", cwd=tmp_path)
    assert one.returncode == 0 and json.loads(one.stdout).keys() == doc.keys() and doc["schema"] == 2
    text = cli("check", "models/truncated.onnx", "models/good.onnx", cwd=tmp_path)  # order does not matter
    assert text.returncode == 2 and "unreadable-model" in text.stderr and not text.stdout.strip()


def test_check_format_github_prints_workflow_annotations(cli, tmp_path):
    model = _external_model(tmp_path / "m.onnx", "gone.bin", write_data=False)
    res = cli("check", model, "--format", "github")
    assert res.returncode == 1
    (line,) = res.stdout.strip().splitlines()
    assert line.startswith(f"::error file={model},title=weightshare missing-external-file::"), line


@pytest.mark.slow
def test_genai_like_original_with_duplicates_and_unaligned_tensors_passes_with_warnings_when_sharing(cli, tmp_path):
    """Like an onnxruntime-genai export: big MatMul weights page aligned in one external file, six identical
    4 KiB LayerNorm vectors stored six times at odd offsets. 20 KiB mapped twice is no reason to fail a gate."""
    rng = np.random.default_rng(0)
    data, tensors, nodes, x = bytearray(), [], [], "x"
    gamma = rng.standard_normal(1024).astype(np.float32)

    def external(name: str, arr: np.ndarray, align: int) -> None:
        data.extend(bytes(-len(data) % align or (4 if align == 4 else 0)))  # align 4: 4 bytes off the 64
        t = numpy_helper.from_array(arr, name)
        t.ClearField("raw_data")
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", "model.onnx.data"), ("offset", str(len(data))), ("length", str(arr.nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        data.extend(arr.tobytes())
        tensors.append(t)

    for i in range(6):
        external(f"ln{i}.weight", gamma, 4)  # 4-byte aligned: below the 64 B weightshare asks for
        nodes.append(helper.make_node("Mul", [x, f"ln{i}.weight"], [f"n{i}"]))
        x = f"n{i}"
    for i in range(2):
        external(f"w{i}", rng.standard_normal((1024, 1024)).astype(np.float32), 64 << 10)
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]))
        x = f"m{i}"
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 1024])],
        tensors,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "model.onnx"))
    (tmp_path / "model.onnx.data").write_bytes(bytes(data))
    res = cli("check", tmp_path / "model.onnx", "--json", "--target", "ort-disable-prepacking")
    found = {f["code"]: f["severity"] for f in json.loads(res.stdout)["findings"]}
    assert res.returncode == 0, res.stdout
    assert found["duplicate-payloads"] == "warning" and found["unaligned"] == "warning", found
    assert found["copied-per-session"] == "warning"  # 8 MiB per session measured, but only at ORT defaults
    # with no options the model is held to ORT's defaults (a plain InferenceSession), where MLAS packs the MatMuls
    res = cli("check", tmp_path / "model.onnx")
    assert res.returncode == 1 and "error: copied-per-session: one more session under ort-default" in res.stdout
