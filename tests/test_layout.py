"""The layout: option conflicts refused by the API (the CLI only forwards), one byte formatter for every figure.

Before: small fixture models built in tmp_path.
Under test: ``api``'s option-conflict checks through the public functions and the CLI, ``cli._render.size``.
After: nothing is written for a refused conversion.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import weightshare
from weightshare import ConvertOptions, UsageError
from weightshare.cli._render import size, size_mib
from weightshare.samples import mlp_onnx


@pytest.fixture()
def model(tmp_path):
    (tmp_path / "in").mkdir()
    return mlp_onnx(tmp_path / "in" / "m.onnx", layers=1, dim=64)


def test_ort_cpu_and_keep_packed_are_refused_by_the_api(model, tmp_path):
    with pytest.raises(UsageError, match="--unpack ort-cpu and --keep-packed exclude each other"):
        weightshare.convert(model, tmp_path / "out", unpack=("ort-cpu",), keep_packed=True)
    with pytest.raises(UsageError, match="exclude each other"):
        weightshare.convert_many(
            [model], tmp_path / "out", ConvertOptions(unpack=frozenset({"ort-cpu"}), keep_packed=True)
        )
    assert not (tmp_path / "out").exists()


def test_blob_and_shared_blob_are_refused_by_the_api(model, tmp_path):
    with pytest.raises(UsageError, match="--blob and --shared-blob exclude each other"):
        weightshare.convert_zoo([model], tmp_path / "zoo", "shared", ConvertOptions(blob_name="mine"))
    assert not (tmp_path / "zoo").exists()


def test_the_cli_reports_the_api_refusal_as_one_line(model, tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightshare",
            "convert",
            str(model),
            "-o",
            str(tmp_path / "out"),
            "--blob",
            "a",
            "--shared-blob",
            "b",
        ],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == "weightshare: error: --blob and --shared-blob exclude each other"
    assert not (tmp_path / "out").exists()


def test_a_model_folder_beside_other_inputs_is_refused(model, tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    mlp_onnx(folder / "model.onnx", layers=1, dim=64)
    (folder / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="a model folder is converted on its own"):
        weightshare.api._convert_inputs([folder, model], tmp_path / "out", ConvertOptions())


@pytest.mark.parametrize(
    "nbytes,text", [(17, "17 B"), (3584, "3.5 KiB"), (56 << 20, "56.0 MiB"), (2048 << 20, "2.0 GiB"), (0, "0 B")]
)
def test_one_byte_formatter(nbytes, text):
    assert size(nbytes) == text
    assert size_mib(nbytes / (1 << 20)) == text
