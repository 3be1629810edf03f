"""weightshare.ort.session checks once per blob: a per-user verdict cache that a changed blob or an edited cache
cannot fool, a load path that imports neither onnx nor protobuf, and a wire reader that finds every external file."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh
from prepack_samples import mixed_onnx, sample_input

import weightshare.ort as wort
from weightshare._safetensors import read_safetensors_metadata
from weightshare.api import convert
from weightshare.errors import InvalidModel, WeightshareError
from weightshare.formats.onnx.graph import external_tensors
from weightshare.formats.onnx.ort import verdict as ort_verdict
from weightshare.formats.onnx.ort.prepack import OPTIMIZED_PREFIX, PACKED_PREFIX
from weightshare.formats.onnx.ort.prepack_record import portable_of
from weightshare.formats.onnx.ort.probe import WireError, external_locations, fd_identity, nchwc_convs
from weightshare.options import ConvertOptions


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("verdict")
    (d / "src").mkdir()
    src = mixed_onnx(d / "src" / "m.onnx", conv_layers=1, channels=16, dim=64)
    convert(src, d / "out", ConvertOptions(prepack=True))
    return src, d / "out"


@pytest.fixture
def fresh(converted, tmp_path, monkeypatch):
    """A private copy of the --prepack output, an empty verdict cache, and a counter of full verifications."""
    src, out = converted
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(wort, "_verified", set())
    monkeypatch.setattr(wort, "_warned", set())
    hashed: list[str] = []
    real = wort._hash_packed_payloads

    def counting(path, info, size):
        hashed.append(path)
        return real(path, info, size)

    monkeypatch.setattr(wort, "_hash_packed_payloads", counting)
    return src, copy / "m.onnx", hashed


def _blob(model: Path) -> Path:
    return next(model.parent.glob("*.safetensors"))


def _check(model: Path) -> str | None:
    info, blob = wort.prepack_info(model)  # type: ignore[misc]
    wort._verified.clear()  # what a new process starts with
    return wort.check_packed_payloads(blob, info)


def _flip_keeping_times(blob: Path, prefix: str) -> None:
    """Flip one byte of a packed payload in place, then set atime/mtime back to what they were."""
    before = os.stat(blob)
    start, header, _meta = read_safetensors_metadata(str(blob))
    name = next(n for n in header if n.startswith(prefix))
    begin, end = header[name]["data_offsets"]
    pos = start + (begin + end) // 2 + 3
    with open(blob, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x40]))
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(blob)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def _entries(tmp_path: Path) -> list[Path]:
    d = tmp_path / "cache" / "weightshare" / "ort-verified"
    return sorted(p for p in d.iterdir() if p.name != "key")


@pytest.mark.slow
def test_a_verified_blob_is_hashed_once_then_read_from_the_cache(fresh, tmp_path):
    _src, model, hashed = fresh
    assert _check(model) is None and len(hashed) == 1
    d = tmp_path / "cache" / "weightshare" / "ort-verified"
    assert (os.stat(d).st_mode & 0o777) == 0o700
    assert [oct(os.stat(p).st_mode & 0o777) for p in d.iterdir()] == ["0o600", "0o600"]
    assert _check(model) is None and _check(model) is None
    assert len(hashed) == 1  # the next "processes" read the header only


@pytest.mark.parametrize("prefix", [PACKED_PREFIX, OPTIMIZED_PREFIX])
def test_a_blob_modified_in_place_with_its_size_and_mtime_kept_is_verified_again(fresh, prefix, caplog):
    src, model, hashed = fresh
    assert _check(model) is None
    _flip_keeping_times(_blob(model), prefix)
    why = _check(model)
    assert why is not None and "does not match its recorded" in why and len(hashed) == 2
    with caplog.at_level(logging.WARNING, logger="weightshare.ort"):
        sess = wort.session(model)
    said = [r.getMessage() for r in caplog.records if r.name == "weightshare.ort"]
    assert len(said) == 1 and "does not match its recorded" in said[0]
    info, _ = wort.prepack_info(model)  # type: ignore[misc]
    assert portable_of(info, model.name) in said[0]
    assert sess.run(None, sample_input(src, 2))[0].shape[0] == 2


def _edit(entry: Path, change) -> None:
    text = entry.read_bytes()
    body, _, mac = text.rpartition(b"\n")
    entry.write_bytes(change(body, mac))


@pytest.mark.parametrize(
    "tamper",
    [
        "mac",  # an edited MAC
        "truncated",
        "mode",  # readable by others: not ours alone
        "symlink",  # the entry replaced by a symlink to a valid-looking file
        "key",  # the key replaced: every MAC is wrong
        "dir-mode",  # the cache directory opened to others
    ],
)
def test_a_tampered_cache_is_ignored_and_the_blob_verified_again(fresh, tmp_path, tamper):
    _src, model, hashed = fresh
    assert _check(model) is None
    (entry,) = _entries(tmp_path)
    d = entry.parent
    if tamper == "mac":
        _edit(entry, lambda body, mac: body + b"\n" + (b"0" * len(mac)))
    elif tamper == "truncated":
        entry.write_bytes(entry.read_bytes()[:-5])
    elif tamper == "mode":
        os.chmod(entry, 0o644)
    elif tamper == "symlink":
        other = tmp_path / "elsewhere"
        shutil.copy(entry, other)
        entry.unlink()
        entry.symlink_to(other)
    elif tamper == "key":
        (d / "key").write_bytes(os.urandom(32))
    elif tamper == "dir-mode":
        os.chmod(d, 0o755)
    assert _check(model) is None and len(hashed) == 2


@pytest.mark.slow
def test_a_forged_entry_for_a_modified_blob_does_not_make_it_pass(fresh, tmp_path):
    """An entry written without the key, claiming the flipped blob is intact, is ignored."""
    _src, model, hashed = fresh
    assert _check(model) is None
    blob = _blob(model)
    _flip_keeping_times(blob, PACKED_PREFIX)
    fd = os.open(blob, os.O_RDONLY)
    try:
        identity, digest = fd_identity(fd), ort_verdict.header_sha256(fd)
    finally:
        os.close(fd)
    name, body = ort_verdict._entry(identity, digest)  # type: ignore[arg-type]
    forged = tmp_path / "cache" / "weightshare" / "ort-verified" / name
    forged.write_bytes(body + b"\n" + b"f" * 64)
    os.chmod(forged, 0o600)
    why = _check(model)
    assert why is not None and "does not match its recorded" in why


def test_a_cached_verdict_does_not_hide_a_cpu_mismatch(fresh, monkeypatch, caplog):
    src, model, _hashed = fresh
    assert _check(model) is None
    here = wort.this_machine()
    monkeypatch.setattr(wort, "_machine", {**here, "cpu_features": [*here["cpu_features"], "avx512f_not_here"]})
    with caplog.at_level(logging.WARNING, logger="weightshare.ort"):
        wort.session(model)
    said = [r.getMessage() for r in caplog.records if r.name == "weightshare.ort"]
    assert len(said) == 1 and "cpu_features" in said[0] and "not using its pre-packed weights" in said[0]


def test_an_unusable_cache_directory_only_costs_the_hash(fresh, tmp_path, monkeypatch):
    _src, model, hashed = fresh
    (tmp_path / "cache").write_text("a file where the cache directory would go")
    assert _check(model) is None and _check(model) is None and len(hashed) == 2


_PROBE = """
import json, sys
import weightshare.ort as wort
path, src = sys.argv[1:]
import numpy as np
x = {k: v for k, v in np.load(src).items()}
s = wort.session(path)
s.run(None, x)
print(json.dumps([m for m in ("onnx", "google.protobuf", "ml_dtypes") if m in sys.modules]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("which", ["prepacked", "plain"])
def test_the_helper_imports_neither_onnx_nor_protobuf(converted, tmp_path, which):
    src, out = converted
    model = out / "m.onnx"
    if which == "plain":
        convert(src, tmp_path / "plain")
        model = tmp_path / "plain" / "m.onnx"
    inputs = tmp_path / "x.npz"
    np.savez(inputs, **sample_input(src, 2))
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for _ in range(2):  # a miss, then a hit
        res = subprocess.run(
            [sys.executable, "-c", _PROBE, str(model), str(inputs)], capture_output=True, text=True, env=env
        )
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout.splitlines()[-1]) == []


def _external(t: onnx.TensorProto, location: str) -> None:
    t.data_location = T.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(len(t.raw_data)))):
        t.external_data.add(key=k, value=v)
    t.ClearField("raw_data")


def test_the_wire_reader_finds_every_external_file_protobuf_finds():
    """Initializers, a Constant's tensor attribute, an If branch's initializer, a sparse initializer's values and
    a function's Constant: the same locations as walking the parsed model."""
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)

    def ext(name: str, loc: str) -> onnx.TensorProto:
        t = nh.from_array(arr, name)
        _external(t, loc)
        return t

    branch = h.make_graph(
        [h.make_node("Identity", ["b_w"], ["b_y"])],
        "then",
        [],
        [h.make_tensor_value_info("b_y", T.FLOAT, [2, 3])],
        [ext("b_w", "branch.bin")],
    )
    other = h.make_graph(
        [h.make_node("Identity", ["w"], ["o_y"])], "else", [], [h.make_tensor_value_info("o_y", T.FLOAT, [2, 3])]
    )
    sparse = h.make_sparse_tensor(ext("s_v", "sparse.bin"), nh.from_array(np.array([0, 1], np.int64), "s_i"), [2, 3])
    fn = h.make_function(
        "local",
        "F",
        ["a"],
        ["b"],
        [h.make_node("Constant", [], ["c"], value=ext("c", "function.bin")), h.make_node("Add", ["a", "c"], ["b"])],
        [h.make_opsetid("", 17)],
    )
    graph = h.make_graph(
        [
            h.make_node("Constant", [], ["k"], value=ext("k", "attr.bin")),
            h.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=other),
            h.make_node("F", ["k"], ["z"], domain="local"),
        ],
        "g",
        [h.make_tensor_value_info("cond", T.BOOL, [])],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 3]), h.make_tensor_value_info("z", T.FLOAT, [2, 3])],
        [ext("w", "main.bin"), nh.from_array(arr, "inline")],
        sparse_initializer=[sparse],
    )
    model = h.make_model(graph, functions=[fn], opset_imports=[h.make_opsetid("", 17), h.make_opsetid("local", 1)])
    data = model.SerializeToString()
    expected = {next(e.value for e in t.external_data if e.key == "location") for t in external_tensors(model)}
    assert expected == {"main.bin", "attr.bin", "branch.bin", "sparse.bin", "function.bin"}
    assert set(external_locations(data)) == expected
    for cut in (1, len(data) // 2, len(data) - 1):
        with pytest.raises(WireError):
            external_locations(data[:cut] + b"\x0a\xff\xff\x03")  # a field whose length runs past the end


def test_the_wire_reader_counts_the_convs_ort_would_reorder():
    w4 = nh.from_array(np.ones((4, 4, 3, 3), np.float32), "w4")
    w4h = nh.from_array(np.ones((4, 4, 3, 3), np.float16), "w4h")
    graph = h.make_graph(
        [
            h.make_node("Conv", ["x", "w4"], ["a"]),
            h.make_node("Conv", ["x", "w4h"], ["b"]),
            h.make_node("Conv", ["x", "dynamic"], ["c"]),
            h.make_node("Conv", ["x", "w4"], ["d"], domain="com.other"),
        ],
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 4, 8, 8]), h.make_tensor_value_info("dynamic", T.FLOAT, None)],
        [h.make_tensor_value_info(n, T.FLOAT, None) for n in "abcd"],
        [w4, w4h],
    )
    assert nchwc_convs(h.make_model(graph).SerializeToString()) == 1


def test_a_model_that_is_not_protobuf_is_invalid_model(tmp_path):
    bad = tmp_path / "m.onnx"
    bad.write_bytes(b"\x0a\xff\xff\xff\x0f not a model")
    with pytest.raises(InvalidModel, match="does not parse"):
        wort.session(bad)


def test_an_external_tensor_without_a_location_is_refused(tmp_path):
    t = nh.from_array(np.ones(4, np.float32), "w")
    t.data_location = T.EXTERNAL
    t.ClearField("raw_data")
    g = h.make_graph(
        [h.make_node("Identity", ["w"], ["y"])], "g", [], [h.make_tensor_value_info("y", T.FLOAT, [4])], [t]
    )
    model = tmp_path / "m.onnx"
    model.write_bytes(h.make_model(g).SerializeToString())
    assert external_locations(model.read_bytes()) == [""]
    with pytest.raises(WeightshareError, match="empty or invalid path"):
        wort.session(model)


def test_a_verdict_written_under_the_former_rule_is_not_read(tmp_path, monkeypatch):
    """The former rule hashed none of a --shared-blob zoo's packed payloads: its "intact" vouches for nothing
    they hold, so an entry it wrote is a miss and the blob is hashed again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    identity, header = (1, 2, 3, 4, 5), "ab" * 32
    monkeypatch.setattr(ort_verdict, "_FORMAT", "weightshare-ort-verdict/1")
    ort_verdict.remember_intact(identity, header)
    assert ort_verdict.is_intact(identity, header)  # the cache works: the former rule reads its own entry
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert not ort_verdict.is_intact(identity, header)
    ort_verdict.remember_intact(identity, header)
    assert ort_verdict.is_intact(identity, header)
