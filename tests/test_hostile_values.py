"""Hostile values get one line and exit 2.

Before: a small ONNX model; number options given nan, inf or a negative value; a model file whose name is not
UTF-8 (byte 0xff); commands that fail while --json is given.
Under test: ``weightshare convert / inspect / check / verify / merge`` (CLI).
After: each is one line on stderr naming the problem, exit 2, no OUTDIR, never "internal error"; with --json
stdout holds one JSON document ``{"ok": false, "error": ...}``.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from weightshare._samples import mlp_onnx


@pytest.fixture
def model(tmp_path):
    return mlp_onnx(tmp_path / "m.onnx", layers=1, dim=16, weights="float32", seed=1)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "internal error" not in lines[0] and "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize(
    "option,value",
    [
        ("--ort-child-timeout", "nan"),
        ("--ort-child-timeout", "inf"),
        ("--ort-max-growth", "nan"),
        ("--ort-max-growth", "-2"),
        ("--blob-grace", "nan"),
        ("--blob-grace", "-1"),
    ],
)
def test_non_finite_or_negative_numbers_are_refused(tmp_path, cli, model, option, value):
    out = tmp_path / "out"
    res = cli("convert", model, "-o", out, "--prepack", option, value)
    assert res.returncode == 2, res.stdout + res.stderr
    assert option in one_line(res.stderr)
    assert not out.exists()


def test_a_negative_seed_is_refused(tmp_path, cli, model):
    res = cli("verify", model, model, "--seed", "-1")
    assert res.returncode == 2 and "--seed" in one_line(res.stderr)


def test_a_name_that_is_not_utf8_is_bad_input(tmp_path, cli, model):
    odd = tmp_path / os.fsdecode(b"m\xff-weights.onnx")
    shutil.copyfile(model, odd)
    for args in (("convert", odd, "-o", tmp_path / "out"), ("inspect", odd), ("verify", model, odd)):
        res = cli(*args)
        assert res.returncode == 2, (args[0], res.stdout + res.stderr)
        line = one_line(res.stderr)
        assert "UTF-8" in line and "\\xff" in line, line
    res = cli("check", odd)
    assert res.returncode == 2 and "UTF-8" in res.stdout + res.stderr
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copyfile(model, folder / "model.onnx")
    (folder / os.fsdecode(b"notes-\xfe.txt")).write_text("x")
    res = cli("convert", folder, "-o", tmp_path / "out2")
    assert res.returncode == 2 and "UTF-8" in one_line(res.stderr)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


@pytest.mark.parametrize(
    "args",
    [
        ("convert", "{missing}", "-o", "{out}"),
        ("convert", "{model}", "-o", "{out}", "--blob-grace", "inf"),
        ("convert", "{model}", "-o", "{out}", "--blob-grace", "many"),  # click's own usage error
        ("inspect", "{missing}"),
        ("verify", "{missing}", "{model}"),
        ("merge", "{missing}", "-o", "{out}"),
    ],
)
def test_json_failures_are_json(tmp_path, cli, model, args):
    names = {"model": model, "missing": tmp_path / "missing.onnx", "out": tmp_path / "out"}
    res = cli(*(a.format(**names) for a in args), "--json")
    assert res.returncode == 2, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and doc["error"] and doc["exit_code"] == 2
    # the envelope every --json document has, valid against the command's shipped schema
    import jsonschema

    from weightshare._contract import schema_path

    assert doc["command"] == args[0] and doc["schema"] == 2
    jsonschema.validate(doc, json.loads(schema_path(args[0]).read_text()), cls=jsonschema.Draft202012Validator)
