"""ExecuTorch programs and the files they read: the loader's digests bound to content, a ``.pte`` converted with
the ``.ptd`` files it reads, and the loader refusing a program whose named data is missing.

Before: programs and data files as executorch 1.5.1's exporter writes them (tests/executorch_fixtures.py; a
program with external constants is a ``.pte`` naming keys that a ``.ptd`` holds as NamedData). Under test:
``weightshare convert`` and the loader's checks that run before ExecuTorch sees a file. ExecuTorch's runtime is not
a test dependency (1.5 GB with torch): the loader's binding and presence checks are tested where they run, before
``executorch.runtime`` is imported.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from executorch_fixtures import xnnpack_program

from weightshare.formats.executorch import flatbuf, loader


def _program(path: Path) -> flatbuf.Program:
    with open(path, "rb") as f:
        return flatbuf.read_program(f.fileno(), str(path))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same_keys_other_weights(tmp_path: Path, like: Path, dim: int) -> bytes:
    """A program of ``like``'s size and keys whose weights are other bytes (a re-export over the same file)."""
    other = xnnpack_program(tmp_path / "other.pte", dim=dim, layers=1, seed=7)
    raw = bytearray(other.read_bytes())
    for nd_a, nd_b in zip(_program(like).named_data, _program(other).named_data):
        raw = bytearray(raw.replace(nd_b.key.encode(), nd_a.key.encode()))
    assert len(raw) == like.stat().st_size
    return bytes(raw)


def _rewrite_keeping_size_and_mtime(path: Path, data: bytes) -> None:
    before = os.stat(path)
    with open(path, "r+b") as f:  # in place: same inode
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


def _weights_digests(path: Path) -> dict[str, str]:
    prog, raw = _program(path), path.read_bytes()
    out = {}
    for nd in prog.named_data:
        seg = prog.segments[nd.segment]
        out[nd.key] = hashlib.sha256(raw[seg.file_offset : seg.file_offset + seg.nbytes]).hexdigest()
    return out


def _loader_digests(path: Path) -> dict[str, str]:
    return {key: loader._digest(source, ident) for key, source, ident in loader._file_keys(path)}


def test_a_program_rewritten_in_place_with_size_and_mtime_kept_is_hashed_again(tmp_path):
    a = xnnpack_program(tmp_path / "a.pte", dim=48, layers=1, seed=3)
    keys = sorted(nd.key for nd in _program(a).named_data)
    assert loader.bind_keys([a]) == []  # first load: the keys bound to these bytes
    new = _same_keys_other_weights(tmp_path, a, 48)
    _rewrite_keeping_size_and_mtime(a, new)
    assert a.read_bytes() == new
    # the new weights' digests, not the remembered ones: the keys are now bound to other bytes, so the program
    # loads with XNNPACK's cache off (packed from the new bytes), never with the earlier version's packed weights
    assert _loader_digests(a) == _weights_digests(a)
    assert sorted(loader.bind_keys([a])) == keys


def test_the_digest_is_remembered_by_ctime_too(tmp_path, monkeypatch):
    # a digest remembered at once (no racy window): only the ctime in the key tells the rewrite apart
    monkeypatch.setattr(loader, "RACY_NS", 0, raising=False)
    a = xnnpack_program(tmp_path / "a.pte", dim=40, layers=1, seed=4)
    keys = sorted(nd.key for nd in _program(a).named_data)
    c1 = os.stat(a).st_ctime_ns
    assert loader.bind_keys([a]) == []
    assert any(k[1] == os.stat(a).st_ino for k in loader._digests)  # remembered
    probe, deadline = tmp_path / "probe", time.monotonic() + 5
    probe.write_bytes(b"")
    while os.stat(probe).st_ctime_ns <= c1:  # wait for the kernel's coarse clock to pass a's ctime
        assert time.monotonic() < deadline
        os.utime(probe)
    new = _same_keys_other_weights(tmp_path, a, 40)
    _rewrite_keeping_size_and_mtime(a, new)
    assert os.stat(a).st_ctime_ns > c1
    assert _loader_digests(a) == _weights_digests(a)
    assert sorted(loader.bind_keys([a])) == keys


def test_a_file_changed_within_the_racy_window_is_not_remembered(tmp_path):
    a = xnnpack_program(tmp_path / "a.pte", dim=32, layers=1, seed=5)
    assert loader.bind_keys([a]) == []
    assert not any(k[1] == os.stat(a).st_ino for k in loader._digests)  # ctime too recent: hashed at every load
