"""The PSS figures read from ``/proc/self/smaps`` are those of reading it line by line.

Before: this process with a few sessions of a small model open (onnxruntime maps its library, the weight file and
arenas: hundreds of mappings), its smaps text read once.
Under test: ``_runtimes.memory._sum_text`` (``data_pss``, ``paid_pss``) and ``_runtimes.remainder._kinds_pss``
(the breakdown's PSS per mapping kind), which search each mapping's lines for the fields they want.
After: the same bytes as the line-by-line parse they replace (the reference below), field for field.
"""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("onnxruntime")

_CODE = re.compile(r"\.so(\.[0-9.]+)?$")


def _fields(text: str):
    """(permissions, path, field, kB) of every field line of smaps, with the mapping it belongs to, line by line."""
    perms, path = "", ""
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
            perms, path = parts[1], parts[5] if len(parts) > 5 else ""
        else:
            yield perms, path, parts[0], int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def _reference_sum(text: str, dirty_code: bool) -> int:
    total = 0
    for perms, path, field, kb in _fields(text):
        code = bool(path) and not path.startswith("[") and ("x" in perms or bool(_CODE.search(path)))
        if (field == "Pss:" and not code) or (dirty_code and field == "Private_Dirty:" and code):
            total += kb * 1024
    return total


def _reference_kinds(text: str, weight_files: set[str]) -> dict[str, int]:
    from weightshare._runtimes import remainder as r

    out = dict.fromkeys(r.KINDS, 0)
    for perms, path, field, kb in _fields(text):
        if field == "Pss:" and not r._is_code(perms, path):
            out[r._kind(os.path.realpath(path) if path.startswith("/") else path, weight_files)] += kb * 1024
    return out


def test_smaps_figures_are_those_of_the_line_by_line_parse(tmp_path):
    import model_forms as mf

    from weightshare._runtimes import remainder as r
    from weightshare._runtimes.memory import _sum_text
    from weightshare._runtimes.ort import new_session

    model = mf._save(mf._mlp(64, 4, 0), tmp_path / "m.onnx", external=True)
    sessions = [new_session(str(model), share=True, log_level=4, arena=False) for _ in range(3)]
    with open("/proc/self/smaps") as f:
        text = f.read()
    assert text.count("\nPss:") >= 100
    # a data file this process maps stands for the weight files (small external weights are read, not mapped)
    files = re.findall(r"^[0-9a-f]+-[0-9a-f]+ r[-w]-[ps] \S+ \S+ \S+ +(/\S+)$", text, re.M)
    weights = {os.path.realpath(f) for f in files if not _CODE.search(f)}
    for dirty in (False, True):
        assert _sum_text(text, dirty) == _reference_sum(text, dirty) > 0
    kinds = r._kinds_pss(text, weights)
    assert kinds == _reference_kinds(text, weights) and kinds["heap"] > 0, kinds
    del sessions
