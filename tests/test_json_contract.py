"""The machine contract: every command's `--json` is one envelope, validated against the JSON Schema it ships.

Before: models built in code (an ONNX MLP, two Core ML packages for merge).
Under test: `weightshare CMD ... --json` for every command, run as a user would, in a child process.
After: each document validates against `weightshare/schemas/CMD.schema.json`; `schema`, `command`, `ok` and
`exit_code` agree with the process; `convert` has the same top-level keys for one model, a batch, a folder and a
zoo (the shape does not depend on how many models there were).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import coreml_fixtures as F
import jsonschema
import pytest
from test_cli_output import ANNOTATION

from weightshare._contract import COMMANDS, schema_path
from weightshare._samples import mlp_onnx
from weightshare.cli._bench import bench_notices, demo_notices


def _valid(res, command: str) -> dict:
    doc = json.loads(res.stdout)
    schema = json.loads(schema_path(command).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    assert doc["command"] == command and doc["exit_code"] == res.returncode and doc["ok"] is (res.returncode == 0)
    return doc


def test_every_command_ships_a_schema():
    for command in COMMANDS:
        schema = json.loads(schema_path(command).read_text())
        assert schema["properties"]["command"] == {"const": command}
    packaged = {p.name for p in schema_path("convert").parent.glob("*.schema.json")}
    assert packaged == {f"{c}.schema.json" for c in COMMANDS}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("contract")
    a = mlp_onnx(d / "a.onnx", layers=1, dim=256)
    b = mlp_onnx(d / "b.onnx", layers=2, dim=128, seed=1)
    folder = d / "repo"
    folder.mkdir()
    shutil.copy(a, folder / "model.onnx")
    (folder / "config.json").write_text("{}")
    return d, a, b, folder


def test_convert_has_one_shape_for_one_model_a_batch_a_folder_and_a_zoo(models, cli):
    d, a, b, folder = models
    runs = {
        "one": cli("convert", a, "-o", d / "one", "--json"),
        "batch": cli("convert", a, b, "-o", d / "batch", "--json"),
        "folder": cli("convert", folder, "-o", d / "folder", "--json"),
        "zoo": cli("convert", a, b, "-o", d / "zoo", "--shared-blob", "zoo", "--json"),
    }
    docs = {kind: _valid(res, "convert") for kind, res in runs.items()}
    assert len({tuple(doc) for doc in docs.values()}) == 1, {k: list(v) for k, v in docs.items()}
    assert [len(doc["reports"]) for doc in docs.values()] == [1, 2, 1, 2]
    assert docs["folder"]["folder"]["copied"] and docs["zoo"]["zoo"]["blob"]
    assert docs["one"]["folder"] is None and docs["one"]["zoo"] is None
    assert docs["batch"]["total"]["models"] == 2


def test_inspect_check_verify_bench(models, cli):
    d, a, _, _ = models
    _valid(cli("inspect", a, "--json", "--no-measure"), "inspect")
    big = mlp_onnx(d / "big.onnx", layers=1, dim=1024)  # 4 MiB embedded: copied per session, over the threshold
    failing = _valid(cli("check", big, "--json", "--no-measure"), "check")
    assert failing["exit_code"] == 1 and failing["findings"]
    out = d / "verified"
    assert cli("convert", a, "-o", out, "-q").returncode == 0
    assert _valid(cli("check", out, "--json", "--no-measure"), "check")["ok"]
    assert _valid(cli("verify", a, out / a.name, "--json"), "verify")["passed"]
    measured = cli("-v", "bench", a, "--sessions", "1", "--json")
    (bench,) = _valid(measured, "bench")["reports"]
    assert f"converting {a.name} ..." in measured.stderr.splitlines()  # -v: each stage on stderr, stdout JSON only
    assert bench["rows"]
    notices = bench_notices(bench)  # `bench --format github` renders this same result
    assert notices and all(ANNOTATION.match(line) for line in notices), notices


def test_merge(cli, tmp_path):
    first, second = (
        F.mlp(tmp_path / "a.mlpackage", seed=0, hidden=64),
        F.mlp(tmp_path / "b.mlpackage", seed=1, hidden=64),
    )
    res = cli("merge", first, second, "--name", "f_a", "--name", "f_b", "-o", tmp_path / "mf.mlpackage", "--json")
    (report,) = _valid(res, "merge")["reports"]
    assert Path(report["outputs"][0]).name == "mf.mlpackage"


@pytest.mark.slow
def test_demo(cli, tmp_path):
    res = cli("demo", "--dir", tmp_path / "d", "--layers", "1", "--sessions", "2", "--json")
    (result,) = _valid(res, "demo")["reports"]
    assert result["prepacked_outputs_equal"] is True
    assert all(ANNOTATION.match(line) for line in demo_notices(result, 2))  # `demo --format github`


# What GitHub code scanning reads of a SARIF 2.1.0 upload (its documented required properties), as a schema.
SARIF_SUBSET = {
    "type": "object",
    "required": ["version", "runs"],
    "properties": {
        "version": {"const": "2.1.0"},
        "runs": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["tool", "results"],
                "properties": {
                    "tool": {
                        "type": "object",
                        "required": ["driver"],
                        "properties": {"driver": {"type": "object", "required": ["name", "rules"]}},
                    },
                    "results": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["ruleId", "message", "locations", "level"],
                            "properties": {
                                "level": {"enum": ["error", "warning", "note", "none"]},
                                "message": {"type": "object", "required": ["text"]},
                                "locations": {
                                    "type": "array",
                                    "minItems": 1,
                                    "items": {
                                        "type": "object",
                                        "required": ["physicalLocation"],
                                        "properties": {
                                            "physicalLocation": {
                                                "type": "object",
                                                "required": ["artifactLocation"],
                                                "properties": {
                                                    "artifactLocation": {"type": "object", "required": ["uri"]}
                                                },
                                            }
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def test_check_format_sarif_is_a_sarif_log_with_one_result_per_finding(models, cli):
    d, a, _, _ = models
    big = mlp_onnx(d / "sarif.onnx", layers=1, dim=1024)
    as_json = json.loads(cli("check", big, a, "--json", "--no-measure").stdout)
    res = cli("check", big, a, "--format", "sarif", "--no-measure")
    assert res.returncode == as_json["exit_code"] == 1
    log = json.loads(res.stdout)
    jsonschema.validate(log, SARIF_SUBSET)
    (run,) = log["runs"]
    rules = run["tool"]["driver"]["rules"]
    assert [r["ruleId"] for r in run["results"]] == [f["code"] for f in as_json["findings"]]
    for result in run["results"]:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
        assert rules[result["ruleIndex"]]["help"]["text"].startswith("fix: ")
    assert {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in run["results"]} <= {
        str(big),
        str(a),
    }
