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

import numpy as np
import pytest
from executorch_fixtures import data_file, external_program, xnnpack_program

from weightshare._outputs_record import RECORD  # the outputs record: bookkeeping beside the outputs
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


# ---------------------------------------------------------------- a .pte and the .ptd files it reads


def _ptd_bytes(path: Path) -> dict[str, tuple[int, str]]:
    """key -> (offset, SHA-256 of its bytes) of a data file."""
    with open(path, "rb") as f:
        data = flatbuf.read_data_file(f.fileno(), str(path))
    raw = path.read_bytes()
    out = {}
    for nd in data.named_data:
        seg = data.segments[nd.segment]
        out[nd.key] = (seg.file_offset, hashlib.sha256(raw[seg.file_offset : seg.file_offset + seg.nbytes]).hexdigest())
    return out


def _digests(tensors: dict[str, np.ndarray]) -> dict[str, str]:
    return {k: hashlib.sha256(a.tobytes()).hexdigest() for k, a in tensors.items()}


def _one_line_refusal(res, out: Path) -> str:  # type: ignore[no-untyped-def]
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not out.exists() or not any(out.iterdir())  # nothing written
    return str(res.stderr)


def test_convert_pte_carries_the_ptd_its_external_constants_are_in(tmp_path, cli):
    rng = np.random.default_rng(2)
    tensors = {"0.weight": rng.standard_normal((256, 256), np.float32), "0.bias": rng.standard_normal(256, np.float32)}
    data_file(tmp_path / "_default_external_constant.ptd", tensors)  # the exporter's name for it
    data_file(tmp_path / "unrelated.ptd", {"x": np.ones(8, np.float32)})
    prog = external_program(tmp_path / "model.pte", list(tensors), [t.shape for t in tensors.values()])
    assert _program(prog).segment_base == prog.stat().st_size  # no extended header, as the exporter writes it
    res = cli("convert", prog, "-o", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name != RECORD) == [
        "_default_external_constant.ptd",
        "model.pte",
    ]
    got = _ptd_bytes(tmp_path / "out" / "_default_external_constant.ptd")
    assert {k: d for k, (_, d) in got.items()} == _digests(tensors)
    assert got["0.weight"][0] % 64 == 0 and got["0.bias"][0] % 64 == 0
    assert (tmp_path / "out" / "model.pte").read_bytes()[: prog.stat().st_size] == prog.read_bytes()


def test_one_ptd_read_by_several_programs_is_written_once(tmp_path, monkeypatch):
    from weightshare import _atomic, api

    a = xnnpack_program(tmp_path / "a.pte", dim=64, layers=2, seed=1, external=tmp_path / "foundation.ptd")
    b = xnnpack_program(tmp_path / "b.pte", dim=64, layers=2, seed=1, external=tmp_path / "foundation.ptd")
    assert _program(a).named_data == []
    want = {k: d for k, (_, d) in _ptd_bytes(tmp_path / "foundation.ptd").items()}
    staged: list[str] = []
    new_file = _atomic.OutputTransaction.new_file

    def counting(self, final, *args, **kwargs):  # type: ignore[no-untyped-def]
        staged.append(Path(final).name)
        return new_file(self, final, *args, **kwargs)

    monkeypatch.setattr(_atomic.OutputTransaction, "new_file", counting)
    for i, inputs in enumerate(([a, b], [a, tmp_path / "foundation.ptd", b], [tmp_path / "foundation.ptd", a, b])):
        staged.clear()
        out = tmp_path / f"out{i}"
        api.convert_many(inputs, out)
        assert sorted(staged) == ["a.pte", "b.pte", "foundation.ptd"], (inputs, staged)
        assert sorted(p.name for p in out.iterdir() if p.name != RECORD) == ["a.pte", "b.pte", "foundation.ptd"]
        assert {k: d for k, (_, d) in _ptd_bytes(out / "foundation.ptd").items()} == want
    assert loader.data_file_for(a, None) == tmp_path / "foundation.ptd"  # where the loader finds it


def test_a_ptd_named_on_the_command_line_is_searched_too(tmp_path, cli):
    (tmp_path / "programs").mkdir()
    (tmp_path / "data").mkdir()
    a = xnnpack_program(tmp_path / "programs" / "a.pte", dim=32, layers=1, external=tmp_path / "data" / "w.ptd")
    want = {k: d for k, (_, d) in _ptd_bytes(tmp_path / "data" / "w.ptd").items()}
    alone = cli("convert", a, "-o", tmp_path / "out1")
    line = _one_line_refusal(alone, tmp_path / "out1")
    first = next(iter(want))
    assert "a.pte" in line and first in line and "and 1 more" in line, line
    res = cli("convert", a, tmp_path / "data" / "w.ptd", "-o", tmp_path / "out2")
    assert res.returncode == 0, res.stderr
    assert {k: d for k, (_, d) in _ptd_bytes(tmp_path / "out2" / "w.ptd").items()} == want


def test_a_key_found_nowhere_or_in_two_ptd_files_is_one_line(tmp_path, cli):
    a = xnnpack_program(tmp_path / "a.pte", dim=32, layers=1, external=tmp_path / "w.ptd", missing=1)
    last = [nd.key for nd in _program(xnnpack_program(tmp_path / "ref.pte", dim=32, layers=1)).named_data][-1]
    (tmp_path / "ref.pte").unlink()
    line = _one_line_refusal(cli("convert", a, "-o", tmp_path / "out"), tmp_path / "out")
    assert f"'{last}'" in line and "more" not in line, line
    (tmp_path / "b").mkdir()
    b = xnnpack_program(tmp_path / "b" / "b.pte", dim=32, layers=1, external=tmp_path / "b" / "w.ptd")
    (tmp_path / "b" / "copy.ptd").write_bytes((tmp_path / "b" / "w.ptd").read_bytes())
    before = hashlib.sha256((tmp_path / "b" / "w.ptd").read_bytes()).hexdigest()
    line = _one_line_refusal(cli("convert", b, "-o", tmp_path / "out2"), tmp_path / "out2")
    assert "copy.ptd" in line and "w.ptd" in line and "both" in line, line
    assert hashlib.sha256((tmp_path / "b" / "copy.ptd").read_bytes()).hexdigest() == before


def test_the_loader_refuses_a_program_whose_named_data_is_missing_before_executorch_runs_it(tmp_path):
    import weightshare.executorch as we
    from weightshare.errors import InvalidModel

    a = xnnpack_program(tmp_path / "a.pte", dim=32, layers=1, external=tmp_path / "w.ptd")
    keys = list(_ptd_bytes(tmp_path / "w.ptd"))
    (tmp_path / "w.ptd").unlink()
    with pytest.raises(InvalidModel) as e:  # said before the runtime is imported (it is not a test dependency)
        we.program(a)
    assert keys[0] in e.value.line() and "\n" not in e.value.line()
    other = data_file(tmp_path / "other.ptd", {"x": np.ones(8, np.float32)})
    with pytest.raises(InvalidModel):
        we.program(a, other)
