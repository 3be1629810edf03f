"""Supported systems: on a system without fcntl (Windows) the package imports and refuses clearly what it cannot do.

Before: a small fp32 ONNX model.
Under test: a child interpreter in which ``import fcntl`` fails (a None in sys.modules, as on Windows): importing
every public module, `weightshare --version`, and `convert` / `inspect` through the CLI.
After: the imports work, --version prints, convert and inspect exit 2 with one line naming what is missing, and
convert leaves no output behind.
"""

from __future__ import annotations

import json
import subprocess
import sys

from weightshare._samples import mlp_onnx

CHILD = r"""
import io, json, sys
from contextlib import redirect_stderr, redirect_stdout
sys.modules["fcntl"] = None  # `import fcntl` raises ImportError, as on Windows
import weightshare, weightshare.api, weightshare.cli, weightshare.formats, weightshare.ort, weightshare.litert
from weightshare.cli import main

def run(*args):
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["weightshare", *args]
    with redirect_stdout(out), redirect_stderr(err):
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}

model, out = sys.argv[1], sys.argv[2]
got = {"version": run("--version"), "convert": run("convert", model, "-o", out), "inspect": run("inspect", model)}
print(json.dumps(got))
"""


def test_without_fcntl_the_package_imports_and_refuses_clearly(tmp_path):
    model = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=64, weights="float32")
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-c", CHILD, str(model), str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["version"]["code"] == 0 and got["version"]["out"].startswith("weightshare ")
    for command in ("convert", "inspect"):
        r = got[command]
        assert r["code"] == 2, r
        lines = r["err"].strip().splitlines()
        assert len(lines) == 1 and "needs POSIX file APIs" in lines[0] and "fcntl" in lines[0], r
        assert "Traceback" not in r["err"] and "internal error" not in r["err"]
    assert not out.exists()
