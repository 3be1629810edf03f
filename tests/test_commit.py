"""One run, one commit: colliding outputs, outputs inside inputs, all-or-nothing runs, temporaries and signals."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import weightshare
from weightshare import _atomic as atomic
from weightshare._atomic import TMP_PREFIX, OutputTransaction, clean_stale_temporaries
from weightshare._outputs_record import RECORD
from weightshare._run import expand_inputs
from weightshare._samples import mlp_onnx


def run(model: Path, seed: int = 0) -> np.ndarray:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    shape = [d if isinstance(d, int) else 1 for d in sess.get_inputs()[0].shape]
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def tree(d: Path) -> dict[str, str]:
    """Every file under ``d`` (names relative to it) with its SHA-256; directories as 'dir'."""
    if not d.exists():
        return {}
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(d.rglob("*"))
    }


def one_line_error(res) -> str:
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr and "internal error" not in res.stderr, res.stderr
    return lines[0]


def locations(model: Path) -> set[str]:
    m = onnx.load(str(model), load_external_data=False)
    return {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}


def onnx_in(d: Path, name: str = "m.onnx", seed: int = 0) -> Path:
    """A small fp16 MLP (two 128x128 layers: payloads above the inline threshold) at ``d/name``."""
    d.mkdir(parents=True, exist_ok=True)
    return mlp_onnx(d / name, layers=2, dim=128, weights="float16", seed=seed)


# --- item 2: outputs of one run never collide ---------------------------------------------------------------


def test_same_file_name_in_two_input_directories_is_refused_before_writing(tmp_path, cli):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        mlp_onnx(tmp_path / d / "m.onnx", layers=1, dim=128, seed=ord(d))
    line = one_line_error(cli("convert", tmp_path / "a" / "m.onnx", tmp_path / "b" / "m.onnx", "-o", tmp_path / "out"))
    assert str(tmp_path / "a" / "m.onnx") in line and str(tmp_path / "b" / "m.onnx") in line
    assert not (tmp_path / "out").exists()


def test_onnx_and_tflite_with_one_stem_get_their_own_blobs(tmp_path, cli):
    from test_tflite_convert import assert_same_outputs, run_compiled
    from tflite_fixtures import sample_model

    src = tmp_path / "src"
    src.mkdir()
    onnx_model = mlp_onnx(src / "model.onnx", layers=2, dim=128, seed=1)
    tfl = sample_model(src / "model.tflite", fc_out=64)
    res = cli("convert", src, "--external", "-o", tmp_path / "out", "--json", "-q")
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out"
    (onnx_blob,) = locations(out / "model.onnx")
    tfl_groups = [b.decode() for b in _tflite_groups(out / "model.tflite")]
    assert len(tfl_groups) == 1 and tfl_groups[0] != onnx_blob  # the same default NAME, different content digests
    assert np.array_equal(run(onnx_model), run(out / "model.onnx"))
    assert_same_outputs(run_compiled(tfl), run_compiled(out / "model.tflite"))


def _tflite_groups(path: Path) -> list[bytes]:
    from test_tflite_convert import model_of

    return [g.name for g in model_of(path).externalBufferGroups]


# --- item 3: a run is all or nothing ----------------------------------------------------------------------------


def test_a_good_and_a_bad_model_leave_nothing(tmp_path, cli):
    src = tmp_path / "src"
    src.mkdir()
    mlp_onnx(src / "a_good.onnx", layers=2, dim=128, seed=1)
    (src / "b_bad.onnx").write_bytes(b"\x08\x07" + b"\xff" * 64)
    out = tmp_path / "out"
    line = one_line_error(cli("convert", src, "-o", out))
    assert "b_bad.onnx" in line
    assert not out.exists()  # not even the directory this run would have created
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(weightshare.WeightshareError, match="b_bad.onnx"):
        weightshare.api.convert_many(expand_inputs([src]), out)
    assert tree(out) == {"keep.txt": hashlib.sha256(b"mine").hexdigest()}


def two_models(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """(src, src/a.onnx, src/b.onnx, out): two small models and where they go."""
    src = tmp_path / "src"
    src.mkdir()
    a = mlp_onnx(src / "a.onnx", layers=2, dim=128, seed=1)
    return src, a, mlp_onnx(src / "b.onnx", layers=2, dim=128, seed=2), tmp_path / "out"


def test_a_rename_error_at_commit_undoes_the_renames_already_done(tmp_path, monkeypatch):
    src, a, b, out = two_models(tmp_path)
    weightshare.api.convert_many([a, b], out)  # an earlier a.onnx, b.onnx and their blobs, recorded
    before = tree(out)
    mlp_onnx(src / "a.onnx", layers=2, dim=128, seed=3)  # a changes: its new output would replace the old one
    mlp_onnx(src / "b.onnx", layers=2, dim=128, seed=4)
    replace = os.replace

    def failing(src_path, dst, *args, **kwargs):  # the disk refuses b's rename, after a's was done
        if Path(dst).name == "b.onnx":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(dst))
        return replace(src_path, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(weightshare.WeightshareError, match="cannot move output into place"):
        weightshare.api.convert_many([a, b], out)
    monkeypatch.undo()
    after = tree(out)
    assert after.pop(RECORD) != before.pop(RECORD)  # restamped: see below
    assert after == before  # old a.onnx back in place, no new blob, no temporary
    # a.onnx was put back through a link and a rename (a new ctime): the record names its new identity, so the
    # next run replaces it as weightshare's own
    weightshare.api.convert_many([a, b], out)
    assert np.array_equal(run(a), run(out / "a.onnx"))


def test_a_directory_at_an_output_path_stops_the_run_before_any_rename(tmp_path):
    src, a, b, out = two_models(tmp_path)
    weightshare.convert(a, out)  # an earlier a.onnx and its blob
    (out / "b.onnx").mkdir()  # a directory of the user's where b's output would go
    (out / "b.onnx" / "x").write_text("x")
    before = tree(out)
    mlp_onnx(src / "a.onnx", layers=2, dim=128, seed=3)
    with pytest.raises(weightshare.UsageError, match="b.onnx: exists, and no weightshare record says it wrote it"):
        weightshare.api.convert_many([a, b], out)
    assert tree(out) == before  # a.onnx not replaced, no new blob, no temporary


def test_blob_in_subdirectories_leaves_no_empty_directories_on_failure(tmp_path, cli):
    model = mlp_onnx(tmp_path / "m.onnx", layers=2, dim=128, seed=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "m.onnx").mkdir()
    (out / "m.onnx" / "x").write_text("x")
    one_line_error(cli("convert", model, "-o", out, "--blob", "sub/dir/w"))
    assert sorted(p.name for p in out.iterdir()) == ["m.onnx"]
    weightshare.convert(model, tmp_path / "ok", weightshare.ConvertOptions(blob_name="sub/dir/w"))
    assert np.array_equal(run(model), run(tmp_path / "ok" / "m.onnx"))
    (blob,) = (tmp_path / "ok" / "sub" / "dir").iterdir()
    assert locations(tmp_path / "ok" / "m.onnx") == {f"sub/dir/{blob.name}"}


# --- item 5 and the blob guard: no output onto or inside an input ---------------------------------------------


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    from coreml_fixtures import mlp

    d = tmp_path_factory.mktemp("pkgs")
    return mlp(d / "A.mlpackage", seed=1, hidden=64), mlp(d / "B.mlpackage", seed=2, hidden=64)


@pytest.mark.parametrize("case", ["merge_into_source", "merge_onto_source", "convert_onto_itself", "convert_into_data"])
def test_coreml_output_inside_an_input_is_refused(packages, tmp_path, cli, case):
    a, b = packages
    before = tree(a)
    calls = {
        "merge_into_source": lambda: weightshare.api.merge([a, b], a / "inner.mlpackage"),
        "merge_onto_source": lambda: weightshare.api.merge([a, b], a),
        "convert_onto_itself": lambda: weightshare.convert(a, a),
        "convert_into_data": lambda: weightshare.convert(a, a / "Data"),
    }
    with pytest.raises(weightshare.errors.UsageError, match="input"):
        calls[case]()
    assert tree(a) == before


def test_coreml_output_inside_an_input_cli(packages, cli):
    a, b = packages
    before = tree(a)
    assert "inside the input" in one_line_error(cli("merge", a, b, "-o", a / "inner.mlpackage"))
    assert tree(a) == before


def test_onnx_output_onto_its_input_is_refused(tmp_path, cli):
    model = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=128)
    before = model.read_bytes()
    assert "overwrite the input" in one_line_error(cli("convert", model, "-o", tmp_path))
    assert model.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["m.onnx"]


def test_blob_named_like_the_model_never_overwrites_it(tmp_path, cli):
    model = onnx_in(tmp_path / "src", seed=1)
    out = tmp_path / "out"
    res = cli("convert", model, "-o", out, "--blob", "m.onnx", "--json")
    assert res.returncode == 0, res.stderr
    (blob,) = locations(out / "m.onnx")
    assert blob != "m.onnx" and blob.endswith(".safetensors") and (out / blob).is_file()
    assert np.array_equal(run(model), run(out / "m.onnx"))


@pytest.mark.parametrize(
    "name", [".", "./", "sub/..", ".weightshare-tmp-1-x", "sub/.weightshare-tmp-1-x", ".safetensors", "../w"]
)
def test_blob_names_that_are_directories_temporaries_or_outside_are_refused(tmp_path, name):
    model = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=128)
    out = tmp_path / "out"
    with pytest.raises(weightshare.WeightshareError, match="blob"):
        weightshare.convert(model, out, weightshare.ConvertOptions(blob_name=name))
    with pytest.raises(weightshare.WeightshareError, match="blob"):
        weightshare.api.convert_zoo([model], out, name)
    assert not out.exists()


def test_blob_name_of_a_temporary_is_refused_by_the_cli(tmp_path, cli):
    model = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=128)
    assert TMP_PREFIX in one_line_error(cli("convert", model, "-o", tmp_path / "out", "--blob", TMP_PREFIX + "1-x"))
    assert not (tmp_path / "out").exists()


# --- item 8: relative paths, zoo mode ----------------------------------------------------------------------------


def test_readme_zoo_example_with_relative_paths_from_a_cwd(tmp_path, cli):
    (tmp_path / "DIR").mkdir()
    a = mlp_onnx(tmp_path / "DIR" / "a.onnx", layers=2, dim=128, seed=1)
    b = mlp_onnx(tmp_path / "DIR" / "b.onnx", layers=2, dim=128, seed=1)
    # the README's example verbatim; it used to wait forever on its own lock (relative vs absolute OUTDIR)
    res = subprocess.run(
        [sys.executable, "-m", "weightshare", "convert", "DIR/", "-o", "OUTDIR", "--shared-blob", "zoo.safetensors"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    out = tmp_path / "OUTDIR"
    (blob,) = out.glob("zoo.*.safetensors")
    assert locations(out / "a.onnx") == locations(out / "b.onnx") == {blob.name}
    assert np.array_equal(run(a), run(out / "a.onnx")) and np.array_equal(run(b), run(out / "b.onnx"))
    res = subprocess.run(
        [sys.executable, "-m", "weightshare", "convert", "DIR/a.onnx", "-o", "plain"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr


def test_zoo_rerun_drops_models_no_longer_listed(tmp_path):
    src, a, b, out = two_models(tmp_path)
    weightshare.api.convert_zoo([a, b], out, "zoo")
    weightshare.api.convert_zoo([a], out, "zoo", blob_grace=0)  # a dropped model waits the grace period too
    assert not (out / "b.onnx").exists() and (out / "a.onnx").exists()
    assert np.array_equal(run(a), run(out / "a.onnx"))


# --- old blobs: removed only when unreferenced for the grace period ---------------------------------------------


def test_old_blobs_are_collected_after_the_grace_period_only(tmp_path):
    out = tmp_path / "out"
    versions = [onnx_in(tmp_path / f"v{i}", seed=i) for i in range(4)]
    blobs = []
    for v in versions[:3]:
        report = weightshare.convert(v, out, weightshare.ConvertOptions(blob_grace_s=0))
        blobs.append(Path(report.outputs[1]).name)
    # with a grace period of 0 a blob goes at the commit that leaves it unreferenced: OUT holds only the last run's
    assert sorted(p.name for p in out.glob("*.safetensors")) == blobs[2:]
    weightshare.convert(versions[3], out)  # default grace: 10 minutes
    assert len(list(out.glob("*.safetensors"))) == 2  # v2's, inside its grace period, and v3's
    # a blob of the same NAME that another model in OUTDIR references is never collected
    other = onnx_in(tmp_path / "o", "other.onnx", seed=9)
    weightshare.convert(other, out, weightshare.ConvertOptions(blob_name="m.weights", blob_grace_s=0))
    time.sleep(0.01)
    weightshare.convert(versions[0], out, weightshare.ConvertOptions(blob_grace_s=0))
    assert np.array_equal(run(other), run(out / "other.onnx"))
    assert np.array_equal(run(versions[0]), run(out / "m.onnx"))


# --- item 9: temporaries ----------------------------------------------------------------------------------------

HOLDER = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_locked_temporary_of_a_pid_that_looks_dead_is_kept(tmp_path, cli):
    """Another container's conversion: its PID does not exist here, but it holds the flock."""
    out = tmp_path / "out"
    out.mkdir()
    pid = 4_000_000  # above pid_max (2^22): no such process here
    guard = out / f"{TMP_PREFIX}{pid}-abcd12345678.guard"  # its transaction's guard: what it holds
    tmp = out / f"{TMP_PREFIX}{pid}-abcd12345678-0000abcd-m.onnx"
    tmp.write_bytes(b"half")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(guard)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        model = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=128)
        assert cli("convert", model, "-o", out).returncode == 0
        assert tmp.exists()  # live work of another process: kept
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert clean_stale_temporaries(out) == [tmp, guard] and not tmp.exists()  # lock released: stale now


def test_an_interrupt_between_creating_and_locking_a_temporary_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(fd, op):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.fcntl, "flock", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with OutputTransaction() as tx:
            tx.new_file(tmp_path / "m.onnx")
    with pytest.raises(KeyboardInterrupt):
        with OutputTransaction() as tx:
            tx.new_dir(tmp_path / "p.mlpackage")
    assert os.listdir(tmp_path) == []


# --- item 10: smaller --------------------------------------------------------------------------------------------


def test_a_fifo_as_the_model_is_refused_without_blocking(tmp_path, cli):
    fifo = tmp_path / "m.onnx"
    os.mkfifo(fifo)
    res = subprocess.run(
        [sys.executable, "-m", "weightshare", "convert", str(fifo), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    line = one_line_error(res)
    assert str(fifo) in line and "regular file" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("what", ["empty_dir", "glob"])
def test_no_models_is_an_error(tmp_path, cli, what):
    (tmp_path / "empty").mkdir()
    arg = tmp_path / "empty" if what == "empty_dir" else str(tmp_path / "*.onnx")
    assert "no models" in one_line_error(cli("convert", arg, "-o", tmp_path / "out"))
    with pytest.raises(weightshare.errors.UsageError, match="no models"):
        weightshare.api.convert_zoo([arg], tmp_path / "out", "z")
    assert not (tmp_path / "out").exists()


def test_a_model_named_like_its_own_blob_is_refused(tmp_path):
    """The 'blob would overwrite the model file' guard: only a model input named like a blob can reach it."""
    model = onnx_in(tmp_path / "src", seed=1)
    first = weightshare.convert(model, tmp_path / "probe", weightshare.ConvertOptions(blob_name="x"))
    blob_name = Path(first.outputs[1]).name  # x.<digest12>.safetensors: the digest depends on the content only
    renamed = tmp_path / "src2" / blob_name
    renamed.parent.mkdir()
    renamed.write_bytes(model.read_bytes())
    out = tmp_path / "out"
    with pytest.raises(weightshare.errors.UsageError, match="would overwrite the model file"):
        weightshare.convert(renamed, out, weightshare.ConvertOptions(blob_name="x"))
    assert not out.exists()
