"""Zoo mode (``--shared-blob``) removes only what the outputs record proves it wrote and is unchanged.

Before: a zoo OUT written by ``convert_zoo``; then what a user does to it (a file of their own named like an old
blob, the blob directory moved elsewhere and linked back, a converted model edited) and a re-run with other
models at ``--blob-grace 0``.
Under test: ``weightshare.convert_zoo`` (the CLI's code path, in-process).
After: the user's bytes (SHA-256) are unchanged wherever they lie; what weightshare wrote and no model needs any
more is gone, and OUT does not grow.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import weightshare
from weightshare._outputs_record import RECORD
from weightshare._samples import mlp_onnx
from weightshare.errors import UnsafePath


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def model(path: Path, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return mlp_onnx(path, layers=1, dim=32, weights="float32", seed=seed)


def files(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and p.name != RECORD}


def run(path: Path) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    i = sess.get_inputs()[0]
    x = np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 2 for d in i.shape]).astype(np.float32)
    return sess.run(None, {i.name: x})[0]


def test_a_users_file_named_like_an_old_blob_is_kept(tmp_path):
    a, b = model(tmp_path / "m" / "a.onnx", 1), model(tmp_path / "m" / "b.onnx", 2)
    out = tmp_path / "out"
    weightshare.convert_zoo([a, b], out, "zoo")
    mine = out / "zoo.0123456789ab.safetensors"
    mine.write_bytes(b"the user's own file, named like a blob")
    os.utime(mine, (time.time() - 7200,) * 2)  # older than any grace period
    before = digest(mine)
    report = weightshare.convert_zoo([a, b], out, "zoo", blob_grace=0)
    model(a, 3)
    weightshare.convert_zoo([a, b], out, "zoo", blob_grace=0)  # a new blob; the earlier one goes
    assert digest(mine) == before
    assert any(mine.name in n and "no record" in n for n in report.models[-1].notes)
    assert len([p for p in out.glob("zoo.*.safetensors") if p != mine]) == 1


def test_a_blob_directory_replaced_by_a_link_is_not_entered(tmp_path):
    a, b = model(tmp_path / "m" / "a.onnx", 1), model(tmp_path / "m" / "b.onnx", 2)
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    report = weightshare.convert_zoo([a, b], out, "blobs/zoo")
    old = Path(report.blob).name
    os.rename(out / "blobs", out / "inner")  # the user reorganises OUT and links the old name back
    (out / "blobs").symlink_to("inner", target_is_directory=True)
    (out / "inner" / "zoo.0123456789ab.safetensors").write_bytes(b"the user's own file")
    shutil.copytree(out / "inner", elsewhere)
    before = {p: digest(p) for d in (out / "inner", elsewhere) for p in d.iterdir()}
    model(a, 3)
    with pytest.raises(weightshare.UsageError, match="lies below a link or a file in the output directory"):
        weightshare.convert_zoo([a, b], out, "blobs/zoo", blob_grace=0)  # its blob would be written through it
    assert {p: digest(p) for p in before} == before
    assert old in {p.name for p in (out / "inner").iterdir()}
    (out / "blobs").unlink()  # now a link out of OUT: the blob is not written there, nothing is removed there
    (out / "blobs").symlink_to(elsewhere, target_is_directory=True)
    model(a, 4)
    with pytest.raises(UnsafePath):
        weightshare.convert_zoo([a, b], out, "blobs/zoo", blob_grace=0)
    assert {p: digest(p) for p in before} == before


def test_a_model_dropped_from_the_zoo_goes_only_while_unchanged(tmp_path):
    a, b, c = (model(tmp_path / "m" / f"{n}.onnx", s) for n, s in (("a", 1), ("b", 2), ("c", 3)))
    out = tmp_path / "out"
    weightshare.convert_zoo([a, b, c], out, "zoo")
    (out / "b.onnx").write_bytes(b"the user's edit")  # same inode, another ctime: no longer what was written
    report = weightshare.convert_zoo([a], out, "zoo", blob_grace=0)
    assert (out / "b.onnx").read_bytes() == b"the user's edit"
    assert "kept b.onnx: changed or replaced since weightshare wrote it" in report.models[-1].notes
    assert not (out / "c.onnx").exists()  # dropped and unchanged: gone
    assert np.array_equal(run(a), run(out / "a.onnx"))


def test_nothing_this_zoo_writes_is_removed_and_its_inputs_are_kept(tmp_path):
    """A model of the zoo named like the earlier run's portable twin or blob is this run's output, not stale."""
    a = model(tmp_path / "m" / "a.onnx", 1)
    out = tmp_path / "out"
    weightshare.convert_zoo([a], out, "zoo")
    twin = model(tmp_path / "n" / "b.onnx", 4)
    weightshare.convert_zoo([a, twin], out, "zoo", blob_grace=0)
    weightshare.convert_zoo([twin], out, "zoo", blob_grace=0)
    assert (out / "b.onnx").exists() and not (out / "a.onnx").exists()
    assert np.array_equal(run(twin), run(out / "b.onnx"))
    assert a.exists() and twin.exists()


def test_zoo_cleanup_still_works_and_out_does_not_grow(tmp_path):
    """After N re-runs at --blob-grace 0, every file weightshare wrote that no model in OUT needs is gone."""
    src = tmp_path / "m"
    out = tmp_path / "out"
    sizes = []
    for n in range(5):
        models = [model(src / f"m{i}.onnx", 10 * n + i) for i in range(1 + n % 3)]
        weightshare.convert_zoo(models, out, "zoo", blob_grace=0)
        fresh = tmp_path / f"fresh{n}"
        weightshare.convert_zoo(models, fresh, "zoo")
        assert files(out) == files(fresh)
        for m in models:
            assert np.array_equal(run(m), run(out / m.name))
        sizes.append(sum(p.stat().st_size for p in out.rglob("*") if p.is_file()))
        for m in models:
            m.unlink()
    assert max(sizes) <= max(sizes[:3]) + 1024


def test_a_shared_ptd_goes_only_when_no_program_beside_it_reads_it(tmp_path):
    """Two programs read one .ptd; the run that wrote it drops it (its program no longer reads it): it stays while
    the other program reads it, and goes with the last reader."""
    from executorch_fixtures import xnnpack_program

    from weightshare.formats.executorch import loader

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    a = xnnpack_program(src / "a.pte", dim=64, layers=2, seed=1, external=src / "foundation.ptd")
    b = xnnpack_program(src / "b.pte", dim=64, layers=2, seed=1, external=src / "foundation.ptd")
    weightshare.convert_many([a, b], out)
    shared = out / "foundation.ptd"
    before = digest(shared)
    xnnpack_program(a, dim=64, layers=2, seed=2)  # re-exported with its weights inside
    weightshare.convert(a, out, blob_grace=0)
    assert digest(shared) == before and loader.data_file_for(out / "b.pte", None) == shared
    xnnpack_program(b, dim=64, layers=2, seed=3)
    weightshare.convert(b, out, blob_grace=0)
    assert not shared.exists()  # no program beside it reads it any more: cleanup still works
    assert files(out) == {"a.pte", "b.pte"}
