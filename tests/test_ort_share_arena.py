"""`weightshare.ort.session(..., share_arena=True)`: the sessions of a process share one CPU activation arena.

Before: ``share_arena`` was passed on to ``InferenceSession`` and refused (TypeError). Under test: sessions of a
converted model opened with it, next to one opened without. After: their options carry
``session.use_env_allocators=1`` (ORT's environment allocator, registered once however many sessions ask), and
their outputs are those of a plain session, at batch 1 and 8. Its memory effect is measured in
scripts/bench_share_arena.py (docs/guide.md), not asserted here.
"""

from __future__ import annotations

import numpy as np
import pytest
from model_forms import build, feeds

ort = pytest.importorskip("onnxruntime")


def test_sessions_sharing_one_arena_compute_what_a_plain_session_does(cli, tmp_path):
    import weightshare.ort as wort

    src = build("fp32", tmp_path / "m.onnx", mib=1)
    assert cli("convert", src, "-o", tmp_path / "out", "-q").returncode == 0
    model = tmp_path / "out" / "m.onnx"
    shared = [wort.session(model, share_arena=True) for _ in range(3)]
    plain = wort.session(model)
    for s in shared:
        assert s.get_session_options().get_session_config_entry("session.use_env_allocators") == "1"
    with pytest.raises(Exception, match="use_env_allocators"):  # not set: ORT raises for a key it does not hold
        plain.get_session_options().get_session_config_entry("session.use_env_allocators")
    for batch in (1, 8):
        f = feeds(src, batch=batch)
        want = plain.run(None, f)
        for s in shared:
            assert all(np.array_equal(a, b) for a, b in zip(want, s.run(None, f), strict=True))
