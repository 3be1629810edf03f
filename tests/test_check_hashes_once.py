"""check hashes each byte range of a blob once, though a --prepack output's two models read the same blob.

Before: a small fp32 model converted with ``--prepack`` (the packed model and its portable twin, one blob); a copy
of that output with one byte of a packed copy flipped.
Under test: ``_check.check`` (measuring off: only the reading of the files), each blob range's reads counted.
After: no range is read twice (each was, once per model); the flipped byte still fails both models, and a file
rewritten between two reads is hashed again.
"""

from __future__ import annotations

import collections
import shutil
from pathlib import Path

import model_forms as mf
import pytest

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def prepacked(tmp_path_factory):
    from conftest import run_cli

    d = tmp_path_factory.mktemp("hashed")
    src = mf.build("fp32", d / "src" / "m.onnx", mib=2)
    assert run_cli("convert", src, "-o", d / "out", "-q", "--prepack").returncode == 0
    return d / "out"


def _counted(monkeypatch) -> collections.Counter:
    from weightshare import _tensors

    reads: collections.Counter = collections.Counter()
    chunks = _tensors.FileRange.chunks

    def counted(self, *a, **k):
        reads[(Path(self.path).name, self.offset, self.length)] += 1
        return chunks(self, *a, **k)

    monkeypatch.setattr(_tensors.FileRange, "chunks", counted)
    return reads


def _models(out: Path) -> list[str]:
    return sorted(str(p) for p in out.glob("*.onnx"))


def test_a_blob_two_models_read_is_hashed_once(prepacked, monkeypatch):
    from weightshare._check import Gate, check

    reads = _counted(monkeypatch)
    models = _models(prepacked)
    assert len(models) == 2  # the packed model and its portable twin
    check(models, Gate(measure=False))
    blob = {k: n for k, n in reads.items() if k[0].endswith(".safetensors")}
    assert blob and sum(k[2] for k in blob) >= 2 << 20
    assert max(blob.values()) == 1, sorted(k for k, n in blob.items() if n > 1)[:5]


def test_a_flipped_byte_still_fails_both_models(prepacked, tmp_path):
    from weightshare._check import Gate, check
    from weightshare._findings import Code

    out = tmp_path / "out"
    shutil.copytree(prepacked, out)
    blob = next(out.glob("*.safetensors"))
    data = bytearray(blob.read_bytes())
    data[-100] ^= 0xFF  # in the last payload: a packed copy
    blob.write_bytes(bytes(data))
    _invs, findings = check(_models(out), Gate(measure=False))
    failed = {Path(f.file).name for f in findings if f.code == Code.CHECKSUM_MISMATCH}
    assert failed == {Path(m).name for m in _models(out)}, [(f.code, f.file) for f in findings]


def test_a_file_rewritten_between_reads_is_hashed_again(prepacked, tmp_path, monkeypatch):
    import os

    from weightshare._checksum import digests_kept
    from weightshare._recorded import record_problem, recorded_records

    out = tmp_path / "out"
    shutil.copytree(prepacked, out)
    blob = next(out.glob("*.safetensors"))
    _key, begin, length, digest = sorted(recorded_records(str(blob)), key=lambda r: r[1])[-1]
    reads = _counted(monkeypatch)
    with digests_kept():
        assert record_problem(str(blob), begin, length, digest, blob.stat().st_size) is None
        assert record_problem(str(blob), begin, length, digest, blob.stat().st_size) is None
        assert sum(reads.values()) == 1
        data = bytearray(blob.read_bytes())
        data[begin] ^= 0xFF
        blob.write_bytes(bytes(data))  # rewritten in place: its change time moves
        st = blob.stat()
        os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
        assert record_problem(str(blob), begin, length, digest, blob.stat().st_size)
        assert sum(reads.values()) == 2
