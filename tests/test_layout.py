"""The layout: option conflicts refused by the API (the CLI only forwards), one byte formatter for every figure.

Before: small fixture models built in tmp_path.
Under test: ``api``'s option-conflict checks through the public functions and the CLI, ``cli._render.size``.
After: nothing is written for a refused conversion.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import weightshare
from weightshare import ConvertOptions, UsageError
from weightshare._samples import mlp_onnx
from weightshare.cli._render import size, size_mib


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
        weightshare.convert([folder, model], tmp_path / "out")


@pytest.mark.parametrize(
    "nbytes,text", [(17, "17 B"), (3584, "3.5 KiB"), (56 << 20, "56.0 MiB"), (2048 << 20, "2.0 GiB"), (0, "0 B")]
)
def test_one_byte_formatter(nbytes, text):
    assert size(nbytes) == text
    assert size_mib(nbytes / (1 << 20)) == text


# Shared code: everything in weightshare/ but the formats' folders and the modules runtime- or format-specific by
# name: the public loaders (ort.py, litert.py, _litert_interpreter.py, genai.py, executorch.py), the runtimes'
# measuring code (_runtimes/, _loader_probes.py), the ONNX Runtime demo and the sample-model builders (_demo.py,
# _samples.py).
PACKAGE = Path(weightshare.__file__).parent
NOT_SHARED = (
    "formats/",
    "_runtimes/",
    "_loader_probes.py",
    "ort.py",
    "litert.py",
    "_litert_interpreter.py",
    "genai.py",
    "executorch.py",
    "_demo.py",
    "_samples.py",
)  # runtime loaders by name


def _shared_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if not p.relative_to(PACKAGE).as_posix().startswith(NOT_SHARED)]


def _format_words() -> list[str]:
    from weightshare import formats

    return sorted({w.lower() for f in formats.registered() for w in (f.name, *f.suffixes)} | {"litert", "core ml"})


def _literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String literals that are code (docstrings and --help texts, examples and panel titles are documentation) and
    imported module paths."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            skip.add(id(body[0].value))
        # help texts, a command's examples (epilog) and the help panels' titles are documentation
        if isinstance(node, ast.keyword) and node.arg in ("help", "epilog", "rich_help_panel", "panel"):
            skip.update(id(n) for n in ast.walk(node.value))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_shared_modules_name_no_format():
    words = _format_words()
    assert {"onnx", ".onnx", "tflite", ".tflite", "coreml", ".mlpackage"} <= set(words)
    hits = [
        f"{path.relative_to(PACKAGE)}:{line}: {text[:80]!r}"
        for path in _shared_modules()
        for line, text in _literals(ast.parse(path.read_text()))
        if any(w in text.lower() for w in words)
    ]
    assert not hits, "format facts outside weightshare/formats/:\n" + "\n".join(hits)


def test_the_walk_sees_a_format_name_where_there_is_one(tmp_path):
    # the walk itself can fail: a literal in code is found, the same words in a docstring or a --help text are not
    tree = ast.parse('"""ONNX docs."""\nimport typer\nx = typer.Option(1, help="ONNX help")\nif fmt == "onnx": pass\n')
    assert [t for _, t in _literals(tree) if "onnx" in t.lower()] == ["onnx"]


def test_no_module_over_500_lines_outside_the_formats():
    long = {
        p.relative_to(PACKAGE).as_posix(): n for p in _shared_modules() if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


def test_no_tracked_file_over_2_mib():
    """Fixtures are generated in code: a model or a tool's temporary committed by accident (a quantizer's 415 MiB
    external data once was) is caught here."""
    root = Path(weightshare.__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    big = {
        name: size
        for name in listed.stdout.decode().split("\0")
        if name and (size := (root / name).stat().st_size) > 2 << 20
    }
    assert not big, big


def test_format_only_options_are_declared_by_the_formats_and_read_only_there():
    """Format.options: each format-only ConvertOptions field is declared by a format and read by no shared module."""
    import dataclasses

    from weightshare import formats
    from weightshare.options import Unpack

    fields = {f.name for f in dataclasses.fields(ConvertOptions)}
    declared = {name for fmt in formats.registered() for name in fmt.options.fields}
    assert declared == {"external", "ort_child_timeout_s", "ort_child_memory_mib", "ort_max_growth"}
    assert declared <= fields
    reads = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}: .{node.attr}"
        for path in _shared_modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in declared
    ]
    assert not reads, "format-only options read outside their formats:\n" + "\n".join(reads)
    # Unpack's members and the CLI's --unpack help are the built-in formats' declarations
    assert [u.value for u in Unpack] == [v for fmt in formats.registered() for v in fmt.options.unpack]


def test_no_reference_to_documents_outside_the_repository():
    """Code, tests, scripts and docs cite what a reader can open: no issue numbers, no sections of design notes
    that live elsewhere (the reasons are written where they apply)."""
    import re

    root = Path(weightshare.__file__).resolve().parent.parent
    pattern = re.compile(r"\b[Ii]ssue \d+|\bDESIGN\.md\b|\bSTYLE\.md\b")
    files = [p for d in ("weightshare", "tests", "scripts", "docs") for p in (root / d).rglob("*") if p.is_file()]
    files = [p for p in files + [root / "README.md"] if p.suffix in (".py", ".md") and p != Path(__file__).resolve()]
    found = [
        f"{p.relative_to(root)}:{n}"
        for p in files
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found
