"""The machine contract: every command's `--json` is one body (schema 2), validated against the JSON Schema it ships.

Before: models built in code (an ONNX MLP, two Core ML packages for merge).
Under test: `weightshare CMD ... --json` for every command, run as a user would, in a child process.
After: each document validates against `weightshare/schemas/CMD.schema.json`; its top-level keys are exactly the
envelope (`schema` 2, `command`, `ok`, `exit_code`, `error`), `reports` (one record per model) and `findings`, plus
`gate` and `summary` for check, and nothing else; `ok` and `exit_code` agree with the process; `convert` has the same
top-level keys for one model, a batch, a folder and a zoo; a usage error is the same document for every command,
with its one line on stderr and exit 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import coreml_fixtures as F
import jsonschema
import pytest
from test_cli_output import ANNOTATION

from weightshare._contract import COMMANDS, ENVELOPE, schema_path
from weightshare._samples import mlp_onnx
from weightshare.cli._bench import bench_notices, demo_notices

# What a --json document may hold at its top level, written out here (not read from _contract): the body is one
# shape for every command, check alone adding its verdict over all models.
BODY = ["schema", "command", "ok", "exit_code", "error", "reports", "findings"]
TOP_LEVEL = {command: BODY + (["gate", "summary"] if command == "check" else []) for command in COMMANDS}


def _valid(res, command: str) -> dict:
    doc = json.loads(res.stdout)
    schema = json.loads(schema_path(command).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    assert doc["schema"] == 2
    assert doc["command"] == command and doc["exit_code"] == res.returncode and doc["ok"] is (res.returncode == 0)
    failed_early = doc["error"] is not None and not doc["reports"]  # a usage error: no gate to report either
    assert list(doc) == (BODY if failed_early else TOP_LEVEL[command]), f"{command}: top-level keys {list(doc)}"
    assert isinstance(doc["reports"], list) and isinstance(doc["findings"], list)
    if doc["error"] is None:  # a result: one record per model, each naming its model
        assert doc["reports"] and all(isinstance(r.get("model"), str) for r in doc["reports"])
    return doc


def test_every_command_ships_a_schema_of_the_one_body():
    envelopes = set()
    for command in COMMANDS:
        schema = json.loads(schema_path(command).read_text())
        assert schema["properties"]["command"] == {"const": command}
        assert schema["properties"]["schema"] == {"const": 2}
        assert schema["additionalProperties"] is False and list(schema["properties"]) == TOP_LEVEL[command]
        assert schema["required"] == BODY  # check's gate and summary: required beside a result (allOf)
        own = ("command", "exit_code")  # exit code 1: check's and verify's only
        envelopes.add(json.dumps({k: v for k, v in schema["properties"].items() if k in ENVELOPE and k not in own}))
        envelopes.add(json.dumps(schema["properties"]["findings"]))
    assert len(envelopes) == 2  # the envelope and the findings: the same in every command's schema
    packaged = {p.name for p in schema_path("convert").parent.glob("*.schema.json")}
    assert packaged == {f"{c}.schema.json" for c in COMMANDS}


def _usage_error(res, command: str) -> dict:
    assert res.returncode == 2, res.stdout + res.stderr
    doc = _valid(res, command)
    assert doc == {
        "schema": 2,
        "command": command,
        "ok": False,
        "exit_code": 2,
        "error": doc["error"],
        "reports": [],
        "findings": [],
    }
    assert isinstance(doc["error"], str) and doc["error"]
    (line,) = res.stderr.splitlines()  # the same one line a text run prints
    assert line.startswith(f"weightshare: error: {doc['error']}"), (line, doc["error"])
    return doc


# Per command: a command line missing its argument, and one with an option it does not have.
USAGE = {
    "convert": [["convert"], ["convert", "a.onnx", "-o", "out", "--no-such-option"]],
    "merge": [["merge"], ["merge", "a.mlpackage", "b.mlpackage", "-o", "m.mlpackage", "--no-such-option"]],
    "inspect": [["inspect"], ["inspect", "a.onnx", "--no-such-option"]],
    "check": [["check"], ["check", "a.onnx", "--no-such-option"], ["check", "a.onnx", "--target", "nope"]],
    "verify": [["verify"], ["verify", "a.onnx", "b.onnx", "--no-such-option"]],
    "bench": [["bench"], ["bench", "a.onnx", "--sessions", "0"]],
    "demo": [["demo", "--no-such-option"], ["demo", "--sessions", "0"]],
}


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_a_usage_error_is_the_same_document_for_every_command(command, cli, tmp_path):
    """`--json` after or before the command: the same document, its one line on stderr, exit 2."""
    for args in USAGE[command]:
        after = _usage_error(cli(*args, "--json", cwd=tmp_path), command)
        before = _usage_error(cli("--json", *args, cwd=tmp_path), command)
        as_format = _usage_error(cli(*args, "--format", "json", cwd=tmp_path), command)
        assert after == before == as_format


@pytest.mark.parametrize("command", ["convert", "inspect", "verify", "bench"])
def test_a_missing_model_is_the_usage_error_document(command, cli, tmp_path):
    args = {"convert": ["-o", "out"], "verify": ["b.onnx"], "inspect": [], "bench": []}[command]
    doc = _usage_error(cli(command, "missing.onnx", *args, "--json", cwd=tmp_path), command)
    assert doc["error"] == "no such file: missing.onnx"


@pytest.mark.slow
def test_check_says_a_missing_model_on_stderr_too_and_checks_the_rest(models, cli, tmp_path):
    """check goes on past a model it cannot read (its record, its unreadable-model finding): exit 2, `error` the
    line stderr shows, in every output format."""
    _, a, _, _ = models
    res = cli("check", "missing.onnx", a, "--json", "--no-measure", cwd=tmp_path)
    doc = _valid(res, "check")
    assert res.returncode == 2 and doc["error"] == "no such file: missing.onnx"
    assert res.stderr.splitlines() == ["weightshare: error: no such file: missing.onnx"]
    assert [r["model"] for r in doc["reports"]] == [str(a), "missing.onnx"]
    unreadable = [f["file"] for f in doc["findings"] if f["code"] == "unreadable-model"]
    assert unreadable == ["missing.onnx"] and doc["summary"]["models"] == 2
    for form in ("github", "sarif", "text"):
        res = cli("check", "missing.onnx", a, "--format", form, "--no-measure", cwd=tmp_path)
        assert res.returncode == 2 and "weightshare: error: no such file: missing.onnx" in res.stderr.splitlines()


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


@pytest.mark.slow
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
    assert len({tuple(r) for doc in docs.values() for r in doc["reports"]}) == 1  # one record shape too
    assert docs["folder"]["reports"][0]["folder"]["copied"]
    (zoo,) = {json.dumps(r["zoo"]) for r in docs["zoo"]["reports"]}  # the run's one blob, in each record
    assert json.loads(zoo)["blob"]
    assert all(r["folder"] is None and r["zoo"] is None for r in docs["one"]["reports"] + docs["batch"]["reports"])


@pytest.mark.slow
def test_inspect_check_verify_bench(models, cli):
    d, a, _, _ = models
    (inv,) = _valid(cli("inspect", a, "--json", "--no-measure"), "inspect")["reports"]
    assert inv["model"] == str(a) and inv["payloads"]
    big = mlp_onnx(d / "big.onnx", layers=1, dim=1024)  # 4 MiB embedded: copied per session, over the threshold
    failing = _valid(cli("check", big, "--json", "--no-measure"), "check")
    assert failing["exit_code"] == 1 and failing["findings"] and failing["error"] is None
    assert [r["model"] for r in failing["reports"]] == [str(big)] and failing["summary"]["models"] == 1
    out = d / "verified"
    assert cli("convert", a, "-o", out, "-q").returncode == 0
    assert _valid(cli("check", out, "--json", "--no-measure"), "check")["ok"]
    (verified,) = _valid(cli("verify", a, out / a.name, "--json"), "verify")["reports"]
    assert verified["passed"] and verified["model"] == str(out / a.name) and verified["original"] == str(a)
    measured = cli("-v", "bench", a, "--sessions", "1", "--json")
    (bench,) = _valid(measured, "bench")["reports"]
    assert f"converting {a.name} ..." in measured.stderr.splitlines()  # -v: each stage on stderr, stdout JSON only
    assert bench["rows"]
    notices = bench_notices(bench)  # `bench --format github` renders this same result
    assert notices and all(ANNOTATION.match(line) for line in notices), notices


@pytest.mark.slow
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
    assert result["model"] == result["report"]["model"]
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


@pytest.mark.slow
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
