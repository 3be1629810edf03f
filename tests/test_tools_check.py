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
from onnx import TensorProto, helper, numpy_helper

from weightshare.findings import CODES, Code

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


def test_check_recurses_into_subfolders_and_treats_mlpackages_as_models(cli, tmp_path):
    tree = tmp_path / "modules"
    (tree / "a" / "b").mkdir(parents=True)
    _external_model(tree / "top.onnx", "top.bin")
    _external_model(tree / "a" / "b" / "deep.onnx", "deep.bin")
    F.mlp(tree / "a" / "net.mlpackage", hidden=64)
    res = cli("check", tree, "--json")
    assert res.returncode in (0, 1), res.stderr
    models = [Path(m).relative_to(tree).as_posix() for m in json.loads(res.stdout)["models"]]
    assert models == ["top.onnx", "a/net.mlpackage", "a/b/deep.onnx"], models
    empty = tmp_path / "empty" / "sub"
    empty.mkdir(parents=True)
    res = cli("check", tmp_path / "empty")
    assert res.returncode == 2 and "no models found" in res.stderr


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
    for code in Code:
        info = CODES[code]
        assert info.meaning and info.fix
        assert f"`{code.value}`" in text, f"docs/ci.md does not list {code.value}"
        assert f"| {info.severity.value} |" in text.split(f"`{code.value}`", 1)[1].splitlines()[0], code


def test_check_output_one_line_per_finding_with_severity_and_fix(cli, tmp_path):
    model = _external_model(tmp_path / "m.onnx", "gone.bin", write_data=False)
    res = cli("check", model)
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1
    assert lines[0].startswith(f"{model}: error: missing-external-file: ") and "(fix: " in lines[0]
    shutil.rmtree(tmp_path)
