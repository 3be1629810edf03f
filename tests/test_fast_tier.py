"""The fast tier (``pytest -m "not slow"``) still runs convert, inspect, check and verify once per format.

Before: nothing (the test files are parsed with ``ast``, not imported).
Under test: every ``tests/test_*.py``: its tests marked ``@pytest.mark.covers(FORMAT, COMMAND, ...)`` (the commands
that test runs end to end on a model of FORMAT: ``check`` with its runtime measurement on where the format measures,
``ONNX`` and ``TFLite``; ``Core ML`` says why it is not measured), and which of them are marked slow, on the function
or by the module's ``pytestmark``.
After: nothing written.

A test marked slow no longer counts: marking the last fast test of a pair slow fails here, naming the pair. A
parametrized test counts when the function and its module are not marked slow (a ``pytest.param(..., marks=slow)``
case leaves the others in the fast tier).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from weightshare import formats

TESTS = Path(__file__).resolve().parent
COMMANDS = ("convert", "inspect", "check", "verify")


def _is_mark(node: ast.expr, name: str) -> bool:
    """``pytest.mark.NAME`` or ``pytest.mark.NAME(...)``."""
    if isinstance(node, ast.Call):
        node = node.func
    return (
        isinstance(node, ast.Attribute)
        and node.attr == name
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
    )


def _module_slow(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if any(_is_mark(v, "slow") for v in values):
                return True
    return False


def covering_tests(root: Path = TESTS) -> dict[tuple[str, str], list[tuple[str, bool]]]:
    """(format, command) -> [(``file::test``, marked slow)] for every test marked ``covers``."""
    found: dict[tuple[str, str], list[tuple[str, bool]]] = {}
    for path in sorted(root.glob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module_slow = _module_slow(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            slow = module_slow or any(_is_mark(d, "slow") for d in node.decorator_list)
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and _is_mark(d, "covers"):
                    fmt, *commands = [a.value for a in d.args if isinstance(a, ast.Constant)]
                    for command in commands:
                        found.setdefault((fmt, command), []).append((f"{path.name}::{node.name}", slow))
    return found


def test_the_fast_tier_runs_every_command_on_every_format():
    covered = covering_tests()
    unknown = sorted({k for k in covered if k[0] not in formats._BUILTIN or k[1] not in COMMANDS})
    assert not unknown, f"covers marks naming no built-in format or command: {unknown}"
    missing = [
        f"{fmt} {command}: "
        + (
            ", ".join(name for name, _ in covered[(fmt, command)]) + " (all marked slow)"
            if (fmt, command) in covered
            else "no test"
        )
        for fmt in formats._BUILTIN
        for command in COMMANDS
        if not any(not slow for _name, slow in covered.get((fmt, command), []))
    ]
    assert not missing, "the fast tier runs no test of:\n" + "\n".join(missing)


def test_a_slow_mark_takes_a_test_out_of_the_fast_tier(tmp_path):
    """The reading above sees a slow mark on the function and on the module."""
    (tmp_path / "test_a.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.slow\n@pytest.mark.covers('onnx', 'convert')\ndef test_x():\n    pass\n\n"
        "@pytest.mark.covers('onnx', 'inspect', 'check')\ndef test_y():\n    pass\n"
    )
    (tmp_path / "test_b.py").write_text(
        "import pytest\n\npytestmark = [pytest.mark.slow]\n\n"
        "@pytest.mark.covers('tflite', 'verify')\ndef test_z():\n    pass\n"
    )
    assert covering_tests(tmp_path) == {
        ("onnx", "convert"): [("test_a.py::test_x", True)],
        ("onnx", "inspect"): [("test_a.py::test_y", False)],
        ("onnx", "check"): [("test_a.py::test_y", False)],
        ("tflite", "verify"): [("test_b.py::test_z", True)],
    }


@pytest.mark.parametrize("marker", ["slow", "covers"])
def test_the_markers_are_registered(pytestconfig, marker):
    assert any(line.split(":")[0].split("(")[0] == marker for line in pytestconfig.getini("markers"))
