"""The README and docs/ as a newcomer reads them: short, task first, every example runs, no figure kept by hand.

Before: 49,665 words in README + docs, figures copied by hand from benchmark runs (and stale: three test counts),
command examples never run. Under test:

- README: at most 150 lines, the quick start's two commands (and `.ci/run` running the second), the five jobs;
  README + docs/*.md at most 25,000 words; docs/ci.md opens with the CI recipe, which uses `--format github`.
- Every fenced block whose first line starts with `weightshare ` (or `$ weightshare `), every `run: weightshare`
  line of a yaml block and every python block, extracted from the markdown (no list kept here), runs in one
  scratch directory per document, in document order, on small generated stand-ins for the models the examples
  name (`model.onnx`, `models/`, `repo/`, `model.tflite`, ...). A command's exit code must be 0, or what a
  trailing `# exit N` says; its output must show the job done (the outputs exist, annotations are annotations,
  `verify` says ok, ...). A python block must assert something and exit 0. Measuring children are off
  (`WEIGHTSHARE_NO_MEASURE=1`): the static verdicts are the ones at stake here, and tests/test_check_measured*.py
  cover the measured ones.
- Figures: a number stands only inside a block scripts/make_docs_figures.py writes from committed output, or on
  the allow-lists below (a constant of a format or an option, a version, an exit code: not a measurement); each
  block equals what the script writes.
- Links between the documents resolve, anchors included.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
QUICK_START = [
    'pip install -e ".[test]" && weightshare demo',
    'pip install -e ".[test]" && python -m pytest tests -n 2',
]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.S | re.M)


def _figures_script():
    spec = importlib.util.spec_from_file_location("make_docs_figures", ROOT / "scripts" / "make_docs_figures.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# --- size and shape -----------------------------------------------------------------------------------------------


def test_readme_is_short_has_the_quick_start_and_the_five_jobs():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    blocks = FENCE.findall(text)
    assert blocks[0][1].splitlines() == QUICK_START, "the quick start is exactly two commands"
    ci = (ROOT / ".ci" / "run").read_text()
    assert QUICK_START[1].split(" && ", 1)[1] in ci and 'pip install -e ".[test]"' in ci, ".ci/run runs the README's"
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    jobs = ["Convert a model", "Convert a model folder", "Convert a zoo", "Gate in CI", "Load with sharing"]
    for n, job in enumerate(jobs, 1):
        assert any(h.startswith(f"## {n}. {job}") for h in headings), job
    assert "--format github" in text.split("## 4. Gate in CI", 1)[1].split("\n## ", 1)[0]


def test_readme_and_docs_stay_within_25000_words():
    counts = {_rel(p): len(p.read_text().split()) for p in DOCS}
    assert sum(counts.values()) <= 25_000, counts


def test_docs_ci_opens_with_the_recipe_using_format_github():
    text = (ROOT / "docs" / "ci.md").read_text()
    first = text.split("\n## ", 2)[1]
    assert first.startswith("The recipe"), first[:60]
    (yaml,) = [body for lang, body in FENCE.findall(first) if lang == "yaml"]
    assert re.search(r"run: weightshare check \S+ --format github", yaml)


# --- figures --------------------------------------------------------------------------------------------------------

# Numbers with a unit, a ratio or a percent that are constants (of a format, an option, a runtime's behaviour), not
# measurements: each may appear outside a figure block. Anything else measured-looking must come from a block.
ALLOWED = {
    "64 KiB": "the default --align",
    "1 MiB": "the default --align-threshold and --threshold",
    "4 MiB": "the chunk every payload streams in",
    "64 B": "the default --small-align",
    "1 KiB": "the default --inline-threshold",
    "16 KiB": "Apple's page size",
    "32 MiB": "ORT's segment budget for --prepack",
    "2 GiB": "the flatbuffers and protobuf limits",
    "600 s": "the default --blob-grace",
    "1.10x": "check's rule: four sessions may cost up to 1.10x one",
}
MEASURED = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:"
    r"\s?(?:B|KiB|MiB|GiB|TiB|KB|MB|GB|bytes)\b"
    r"|\s?(?:CPU |wall |system )?(?:ms|s|min|seconds|minutes|hours)\b"
    r"|x\b"
    r"|\s?%"
    r"|\s(?:tests|passed)\b"
    r")"
)


def _prose(text: str) -> str:
    """The text a reader takes as statements: without figure blocks, fenced code and inline code."""
    text = _figures_script().BLOCK.sub("", text)
    text = FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def test_every_figure_block_is_what_the_script_writes_from_committed_output():
    script = _figures_script()
    blocks = 0
    for doc in DOCS:
        text = doc.read_text()
        blocks += len(script.BLOCK.findall(text))
        assert script.write_blocks(text) == text, f"{_rel(doc)}: run python scripts/make_docs_figures.py --blocks"
    assert blocks >= 3


# Bare numbers (no unit) that may stand in prose: single digits (exit codes, list items, small counts) and these.
ALLOWED_NUMBERS = {
    "130": "exit code, interrupted",
    "143": "exit code, SIGTERM",
    "3.11": "the Python version required",
    "2.1.0": "the SARIF version",
    "16": "16-byte alignment (TFLite inline buffers)",
    "18": "iOS 18",
    "64": "64-byte records, the default --small-align",
    "112": "2**112, the fp16 exponent rebias",
    "692": "PEP 692",
    "12": "hex digits of the blob's digest",
    "600": "the default --blob-grace",
    "1024": "the default --inline-threshold",
    "65536": "the default --align; the number of fp16 values",
    "1..4": "functions merged by the benchmark",
}
NUMBER = re.compile(r"(?<![\w.-])\d[\d,.]*\d|(?<![\w.-])\d")


def hand_kept_figures(text: str) -> list[str]:
    """Numbers of `text` that stand outside figure blocks, code and both allow-lists."""
    prose = _prose(text)
    found = [m.group(0) for m in MEASURED.finditer(prose) if re.sub(r"\s+", " ", m.group(0)) not in ALLOWED]
    rest = MEASURED.sub(" ", prose)
    found += [n for n in NUMBER.findall(rest) if len(n) > 1 and n not in ALLOWED_NUMBERS]
    return found


def test_no_figure_outside_a_block_or_the_allow_lists():
    found = {_rel(doc): hand_kept_figures(doc.read_text()) for doc in DOCS}
    assert not any(found.values()), {doc: figures for doc, figures in found.items() if figures}


def test_the_figure_check_sees_a_hand_kept_figure():
    text = "4 sessions cost 1.03x one, 230 MiB, 5 minutes, 1027 tests, 12%, differs by 0.00098"
    assert hand_kept_figures(text) == ["1.03x", "230 MiB", "5 minutes", "1027 tests", "12%", "0.00098"]
    assert not hand_kept_figures("see `--threshold 2 MiB`, exit 2, and\n```\nweightshare bench model.onnx\n```\n")


def test_links_between_documents_resolve():
    def anchors(path: Path) -> set[str]:
        heads = [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
        return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}

    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", doc.read_text())):
            if target.startswith(("http", "mailto:")):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
                broken.append(f"{_rel(doc)}: {target}")
    assert not broken, broken


# --- examples -------------------------------------------------------------------------------------------------------


@dataclass
class Example:
    kind: str  # "command" or "python"
    text: str
    exit_code: int = 0


def examples(text: str) -> list[Example]:
    """The runnable examples of a document, in order."""
    found: list[Example] = []
    for lang, body in FENCE.findall(text):
        lines = [line for line in body.splitlines() if line.strip()]
        if lang == "python":
            found.append(Example("python", body))
        elif lang == "yaml":
            found += [_command(m) for m in re.findall(r"run: (weightshare .*)", body)]
        elif lines and re.match(r"(\$ )?weightshare ", lines[0]):
            for line in lines:
                assert re.match(r"(\$ )?weightshare ", line), f"a command block holds only commands: {line!r}"
                found.append(_command(line.removeprefix("$ ")))
    return found


def _command(line: str) -> Example:
    command, _, comment = line.partition(" #")
    wanted = re.search(r"\bexit (\d+)", comment)
    return Example("command", command.strip(), int(wanted[1]) if wanted else 0)


def _stand_ins(work: Path) -> None:
    """Small models under the names the examples use; each built in code, as the tests build theirs."""
    sys.path.insert(0, str(ROOT / "tests"))
    from weightshare._samples import mlp_onnx

    # 1024-wide fp16 layers: above check's default threshold, so what the docs say fails does fail.
    mlp_onnx(work / "model.onnx", layers=2, dim=1024)
    (work / "models").mkdir()
    mlp_onnx(work / "models" / "a.onnx", layers=2, dim=1024)
    mlp_onnx(work / "models" / "b.onnx", layers=2, dim=1024, weights="float32", seed=1)
    (work / "repo" / "onnx").mkdir(parents=True)
    mlp_onnx(work / "repo" / "onnx" / "model.onnx", layers=2, dim=256, external=True)
    (work / "repo" / "config.json").write_text('{"model_type": "mlp"}\n')
    (work / "repo" / "tokenizer.json").write_text("{}\n")


def _more_stand_ins(work: Path, text: str) -> None:
    """The other formats' stand-ins, built only for a document whose examples name them."""
    if "model.tflite" in text:
        import tflite_fixtures

        tflite_fixtures.sample_model(work / "model.tflite")
    if "model.pte" in text:
        import executorch_fixtures

        executorch_fixtures.portable_program(work / "model.pte")
    if ".mlpackage" in text:
        import coreml_fixtures

        coreml_fixtures.mlp(work / "a.mlpackage", hidden=256)
        coreml_fixtures.mlp(work / "b.mlpackage", hidden=256, seed=1)
    if "bundle.task" in text:
        import mediapipe_fixtures

        mediapipe_fixtures.single_model_task(work / "bundle.task", residue=1)


def _outdir(args: list[str]) -> Path | None:
    for flag in ("-o", "--output"):
        if flag in args:
            return Path(args[args.index(flag) + 1])
    return None


def _shows_the_job_done(args: list[str], res: subprocess.CompletedProcess, work: Path, wanted: int) -> str:
    """Empty when the output shows the command did its job; else what is missing."""
    command, out = args[0], res.stdout
    github = "--format" in args and args[args.index("--format") + 1] == "github"
    if github and not all(line.startswith("::") for line in out.splitlines()):
        return "--format github printed something other than annotations"
    models = [a for a in args[1:] if (work / a).exists() and not a.startswith("-")]
    if command == "convert":
        outdir = work / _outdir(args)  # type: ignore[operator]
        written = [p for p in outdir.rglob("*") if p.suffix in (".onnx", ".tflite", ".pte", ".task", ".mlpackage")]
        if not written:
            return f"no model written in {outdir}"
        if github:
            return "" if "::notice" in out else "no ::notice per model converted"
        return "" if all(Path(m).name in out or (work / m).is_dir() for m in models) else "the report names no model"
    if command == "merge":
        merged = work / _outdir(args)  # type: ignore[operator]
        return "" if (merged / "Manifest.json").is_file() else f"{merged} is no package"
    if command == "check":
        if github:
            return "" if (wanted == 0) == ("::error" not in out) else "annotations disagree with the exit code"
        return "" if ("ok:" in out) == (wanted == 0) else "no ok line, or one where findings fail the gate"
    if command == "verify":
        return "" if (out.startswith("ok") or "::notice" in out) else "verify did not say ok"
    if command == "inspect":
        return "" if all(Path(m).name in out for m in models) else "inspect does not name the model"
    if command == "bench":
        return "" if "converted" in out else "bench shows no converted row"
    return f"no output check for `weightshare {command}`: add one"


def _run_examples(doc: Path, work: Path) -> None:
    text = doc.read_text()
    _stand_ins(work)
    _more_stand_ins(work, text)
    env = {**os.environ, "WEIGHTSHARE_NO_MEASURE": "1", "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    found = examples(text)
    assert found, f"{_rel(doc)} has no example"
    for ex in found:
        if ex.kind == "python":
            assert "assert " in ex.text, f"{_rel(doc)}: a python example asserts what it shows:\n{ex.text}"
            res = subprocess.run([sys.executable, "-c", ex.text], cwd=work, env=env, capture_output=True, text=True)
            assert res.returncode == 0, f"{_rel(doc)}:\n{ex.text}\n{res.stderr[-2000:]}"
            continue
        args = shlex.split(ex.text)[1:]
        res = subprocess.run(
            [sys.executable, "-m", "weightshare", *args], cwd=work, env=env, capture_output=True, text=True
        )
        assert res.returncode == ex.exit_code, f"{_rel(doc)}: `{ex.text}` exit {res.returncode}\n{res.stderr[-2000:]}"
        problem = _shows_the_job_done(args, res, work, ex.exit_code)
        assert not problem, f"{_rel(doc)}: `{ex.text}`: {problem}\n{res.stdout[-2000:]}"


def _has_examples(text: str) -> bool:
    return bool(re.search(r"^```(python)?\n(\$ )?weightshare |^```python\n|run: weightshare ", text, re.M))


@pytest.mark.slow  # 1-15 s per document: each command is a fresh process, as a reader runs it
@pytest.mark.parametrize("doc", [d for d in DOCS if _has_examples(d.read_text())], ids=_rel)
def test_every_example_of_the_document_runs_and_does_its_job(doc, tmp_path):
    _run_examples(doc, tmp_path)


def test_the_example_runner_sees_a_wrong_exit_code_and_a_missing_output(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("```\nweightshare check model.onnx\n```\n")  # exits 1: the doc claims 0
    (tmp_path / "a").mkdir()
    with pytest.raises(AssertionError, match="exit 1"):
        _run_examples(doc, tmp_path / "a")
    silent = subprocess.CompletedProcess([], 0, stdout="nothing here\n", stderr="")
    work = tmp_path / "a"
    assert _shows_the_job_done(["inspect", "models/a.onnx"], silent, work, 0) == "inspect does not name the model"
    assert _shows_the_job_done(["check", "out/", "--format", "github"], silent, work, 0).startswith("--format github")
