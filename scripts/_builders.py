"""Imported first by the benches that build models: the builders live in tests/ (model_forms, prepack_samples,
genai_model: test fixtures, not part of the package), so tests/ goes on sys.path and on PYTHONPATH, for the
bench and for the `python -c` children it starts."""

import os
import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))
