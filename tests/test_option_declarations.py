"""Each conversion option is declared once: a ``ConvertOptions`` field and its ``Opt`` metadata.

Before: nothing but the package (and two tiny ONNX models for the driver's count).
Under test: what is derived from the declarations: `weightshare convert --help` / `merge --help`, the keyword
signatures and docstrings of the public functions, the generated TypedDicts mypy checks the keywords with; and the
driver, which checks a run's options once whatever the run (a batch, a zoo) and however it was started.
After: an option forgotten in any derived place fails here; `check_options` ran once per CLI run.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner

import weightshare
from weightshare import ConvertOptions, _option_keywords
from weightshare._samples import mlp_onnx
from weightshare.cli import app
from weightshare.options import Opt, keywords_of, render_keywords

PUBLIC = {
    "convert": weightshare.convert,
    "convert_folder": weightshare.convert_folder,
    "convert_many": weightshare.convert_many,
    "convert_zoo": weightshare.convert_zoo,
    "merge": weightshare.merge,
}


def _help(command: str) -> str:
    res = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    return res.output


def test_the_generated_keywords_are_current():
    source = (Path(_option_keywords.__file__)).read_text()
    assert source == render_keywords(), "run: python scripts/gen_option_keywords.py"


def test_every_field_is_declared_and_reaches_every_derived_place():
    helps = {command: _help(command) for command in ("convert", "merge")}
    hints = {
        "convert": typing.get_type_hints(_option_keywords.ConvertKeywords),
        "zoo": typing.get_type_hints(_option_keywords.ZooKeywords),
        "merge": typing.get_type_hints(_option_keywords.MergeKeywords),
    }
    signatures = {name: inspect.signature(f).parameters for name, f in PUBLIC.items()}
    seen = 0
    for f in dataclasses.fields(ConvertOptions):
        opts = f.metadata.get("options", ())
        assert opts and all(isinstance(o, Opt) for o in opts), f"{f.name}: no Opt declaration"
        for opt in opts:
            name = opt.keyword or f.name
            takers = ["convert", "convert_folder", "convert_many", "convert_zoo"] + (["merge"] if opt.merge else [])
            for public in takers:
                if public == "convert_zoo" and f.name == "shared_blob":
                    assert list(signatures[public])[2] == "shared_blob"  # its third argument
                    continue
                param = signatures[public].get(name)
                assert param is not None, f"{public}() has no keyword {name}"
                assert f"{name}:" in (PUBLIC[public].__doc__ or ""), f"{public}'s docstring does not document {name}"
            assert name in hints["convert"]
            assert (name in hints["merge"]) is opt.merge
            if opt.flag is not None:
                assert opt.flag in helps["convert"], f"`weightshare convert --help` does not show {opt.flag}"
                assert (opt.flag in helps["merge"]) is opt.merge, opt.flag
            seen += 1
    assert seen == len(keywords_of("convert"))


def test_a_keyword_that_is_no_option_is_refused(tmp_path):
    src = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=64)
    with pytest.raises(TypeError, match="unexpected keyword arguments: prepak"):
        weightshare.convert(src, tmp_path / "o", prepak=True)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="unexpected keyword arguments: prepack"):
        weightshare.merge([src], tmp_path / "m.mlpackage", prepack=True)  # type: ignore[call-arg]
    assert not (tmp_path / "o").exists()


@pytest.fixture()
def counted(monkeypatch):
    """Counts the runs of ``check_options`` (the real one runs; the driver is the one module that calls it)."""
    from weightshare import _convert_api

    calls = []
    real = _convert_api.check_options

    def counting(options):
        calls.append(options)
        return real(options)

    monkeypatch.setattr(_convert_api, "check_options", counting)
    return calls


def test_options_are_checked_once_per_cli_batch_and_zoo(tmp_path, counted):
    a = mlp_onnx(tmp_path / "a.onnx", layers=1, dim=64)
    b = mlp_onnx(tmp_path / "b.onnx", layers=1, dim=64, seed=1)
    runner = CliRunner()
    for extra in ([], ["--shared-blob", "zoo"]):
        counted.clear()
        res = runner.invoke(app, ["convert", str(a), str(b), "-o", str(tmp_path / f"out{len(extra)}"), *extra, "-q"])
        assert res.exit_code == 0, res.output
        assert len(counted) == 1, (extra, len(counted))
    counted.clear()
    weightshare.convert_zoo([a, b], tmp_path / "zoo2", "z")
    assert len(counted) == 1


def test_small_align_from_the_cli_and_the_api(tmp_path):
    """The option added by its declaration alone: `--small-align` / ``small_align`` reach ``AlignPolicy.small``."""
    src = mlp_onnx(tmp_path / "m.onnx", layers=2, dim=48)  # 9 KiB weights: w1 lies at 64 + 9 KiB by default
    res = CliRunner().invoke(app, ["convert", str(src), "-o", str(tmp_path / "cli"), "--small-align", "4096", "-q"])
    assert res.exit_code == 0, res.output
    by_api = weightshare.convert(src, tmp_path / "api", small_align=4096)
    for model in (tmp_path / "cli" / "m.onnx", Path(by_api.outputs[0])):
        moved = [p for p in weightshare.inspect(model, hash_payloads=False).payloads if p.location != "embedded"]
        assert len(moved) == 2 and all(p.offset % 4096 == 0 for p in moved), [(p.name, p.offset) for p in moved]
    default = weightshare.convert(src, tmp_path / "default")
    assert any(p.offset % 4096 for p in weightshare.inspect(default.outputs[0], hash_payloads=False).payloads)
    assert ConvertOptions.from_keywords({"small_align": 256}).align.small == 256
    with pytest.raises(weightshare.UsageError, match="power of two"):
        weightshare.convert(src, tmp_path / "bad", small_align=96)
