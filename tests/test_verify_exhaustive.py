"""`verify` and `check` cannot be fooled by a blob that was rewritten to look consistent.

Before: a model whose embedding (1000 rows) is read by a Gather on random ids, converted (plain and --prepack).
Under test: the CLI (child processes) on four adversarial edits: an embedding row overwritten with its checksum
re-recorded in the header; another conversion's blob renamed to this blob's name; a tampered portable model; a
prepacked_N entry pointing at another tensor's packed copy. After: each makes `check` or `verify` exit 1, by
construction (a digest of the header in the blob's name, a byte-for-byte comparison with the original's payloads),
not by the luck of a random input reading row 999.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from weightshare._checksum import digest_of, split_digest
from weightshare._recorded import recorded_records
from weightshare._verify import first_difference


def _model(path: Path, row999: float = 0.0) -> Path:
    """y = (E[ids] @ Wf) @ B, E 1000 x 64 fp32, W fp16 behind a Cast; ``row999`` added to E's last row only."""
    rng = np.random.default_rng(0)
    e = rng.standard_normal((1000, 64)).astype(np.float32)
    e[999] += row999
    w = rng.standard_normal((64, 64)).astype(np.float16)
    b = rng.standard_normal((64, 64)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["e"]),
        helper.make_node("Cast", ["W"], ["Wf"], to=T.FLOAT),
        helper.make_node("MatMul", ["e", "Wf"], ["h"]),
        helper.make_node("MatMul", ["h", "B"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", T.INT64, ["n"])],
        [helper.make_tensor_value_info("y", T.FLOAT, ["n", 64])],
        [numpy_helper.from_array(e, "E"), numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _blob(out: Path) -> Path:
    (blob,) = out.glob("*.safetensors")
    return blob


def _rerecord(blob: Path, tensor: str) -> None:
    """Re-hash ``tensor``'s payload and write that digest into the header in place of the old one (same length)."""
    (offset, length, old) = next((o, n, d) for k, o, n, d in recorded_records(str(blob)) if k == tensor)
    new = digest_of([blob.read_bytes()[offset : offset + length]], split_digest(old)[0])
    data = blob.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].replace(split_digest(old)[1].encode(), split_digest(new)[1].encode())
    blob.write_bytes(data[:8] + header + data[8 + n :])


def _overwrite_row(blob: Path, row: int = 999) -> None:
    offset = next(o for k, o, _n, _d in recorded_records(str(blob)) if k == "E")
    data = bytearray(blob.read_bytes())
    data[offset + row * 256 : offset + (row + 1) * 256] = np.full(64, 3e7, np.float32).tobytes()
    blob.write_bytes(bytes(data))


def _codes(res) -> list[str]:
    return [f["code"] for f in json.loads(res.stdout)["findings"]]


@pytest.fixture
def plain(cli, tmp_path):
    src = _model(tmp_path / "m.onnx")
    assert cli("convert", src, "-o", tmp_path / "out", "-q").returncode == 0
    return src, tmp_path / "out" / "m.onnx"


@pytest.mark.slow
def test_payload_overwritten_and_checksum_rerecorded_fails_check_and_verify(cli, plain):
    src, out = plain
    blob = _blob(out.parent)
    _overwrite_row(blob)
    _rerecord(blob, "E")
    res = cli("check", out, "--json")
    assert res.returncode == 1 and "blob-digest-mismatch" in _codes(res), res.stdout
    res = cli("verify", src, out)
    assert res.returncode == 1 and "header hashes to" in res.stdout, res.stdout
    # The adversary also renames the blob after its new header and points the model at it: consistent in
    # itself, so `check` passes; `verify` compares every payload with the original's and fails anyway.
    text = blob.read_bytes()
    n = int.from_bytes(text[:8], "little")
    digest = hashlib.sha256(text[8 : 8 + n].rstrip(b" ")).hexdigest()[:12]
    renamed = blob.with_name(f"m.weights.{digest}.safetensors")
    blob.rename(renamed)
    out.write_bytes(out.read_bytes().replace(blob.name.encode(), renamed.name.encode()))
    assert cli("check", out).returncode == 0
    res = cli("verify", src, out)
    assert res.returncode == 1 and "tensor 'E'" in res.stdout and "differs from the original's payload" in res.stdout
    assert f"at byte {999 * 256}" in res.stdout, res.stdout


@pytest.mark.slow
def test_foreign_blob_under_this_blobs_name_fails_check_and_verify(cli, plain, tmp_path):
    src, out = plain
    other = _model(tmp_path / "other" / "m.onnx", row999=1.0)  # same structure, one row differs
    assert cli("convert", other, "-o", tmp_path / "other" / "out", "-q").returncode == 0
    shutil.copyfile(_blob(tmp_path / "other" / "out"), _blob(out.parent))
    res = cli("check", out, "--json")
    assert res.returncode == 1 and "blob-digest-mismatch" in _codes(res), res.stdout
    res = cli("verify", src, out)
    assert res.returncode == 1 and "differs from the original's payload" in res.stdout, res.stdout


@pytest.mark.slow
def test_tampered_portable_model_and_bad_prepacked_entry(cli, tmp_path):
    pytest.importorskip("onnxruntime")
    src = _model(tmp_path / "m.onnx")
    out = tmp_path / "pp"
    assert cli("convert", src, "-o", out, "--prepack", "-q").returncode == 0
    assert cli("verify", src, out / "m.onnx").returncode == 0
    portable = out / "m.portable.onnx"
    good = portable.read_bytes()
    model = onnx.load(str(portable), load_external_data=False)
    entry = next(e for e in model.graph.initializer[0].external_data if e.key == "offset")
    entry.value = str(int(entry.value) + 256)  # E read one row further on: still inside the blob, still aligned
    onnx.save(model, str(portable))
    res = cli("verify", src, out / "m.onnx")
    assert res.returncode == 1 and "m.portable.onnx: tensor 'E'" in res.stdout, res.stdout
    portable.write_bytes(good)
    # Wf's packed entry pointed at B's packed copy: ORT would map (or refuse) another weight's packed bytes.
    prepacked = out / "m.onnx"
    model = onnx.load(str(prepacked), load_external_data=False)
    wf, b = (next(t for t in model.graph.initializer if t.name == n) for n in ("Wf", "B"))
    entry = next(e for e in wf.external_data if e.key == "prepacked_0")
    other = next(e for e in b.external_data if e.key == "prepacked_0")
    entry.value = entry.value.split("|")[0] + "|" + other.value.split("|", 1)[1]
    onnx.save(model, str(prepacked))
    res = cli("check", out, "--json")
    assert res.returncode == 1 and _codes(res).count("bad-prepacked-entry") == 1, res.stdout


def test_first_difference_streams_sources_of_different_chunking():
    class Chunks:
        def __init__(self, data: bytes, size: int):
            self.data, self.size, self.nbytes = data, size, len(data)

        def chunks(self, _chunk_size: int = 0):
            for i in range(0, len(self.data), self.size):
                yield memoryview(self.data[i : i + self.size])

    data = bytes(range(256)) * 40
    assert first_difference(Chunks(data, 7), Chunks(data, 1000)) is None
    changed = bytearray(data)
    changed[5000] ^= 1
    assert first_difference(Chunks(data, 7), Chunks(bytes(changed), 999)) == 5000
    assert first_difference(Chunks(data, 7), Chunks(data[:100], 999)) == 100


@pytest.mark.slow
def test_a_malformed_prepack_record_fails_check(cli, tmp_path):
    """The blob's weightshare.ort_prepack record names a portable model outside OUTDIR, and the adversary renames
    the blob after its new header and re-points both models, so every digest agrees: `check` still fails, on the
    record itself (the validation weightshare.ort.session applies before it opens anything it names)."""
    pytest.importorskip("onnxruntime")
    src = _model(tmp_path / "m.onnx")
    out = tmp_path / "pp"
    assert cli("convert", src, "-o", out, "--prepack", "-q").returncode == 0
    assert cli("check", out / "m.onnx").returncode == 0
    blob = _blob(out)
    data = blob.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n]
    assert header.count(b"m.portable.onnx") >= 1
    header = header.replace(b"m.portable.onnx", b"../victim1.onnx")  # same length: offsets unchanged
    blob.write_bytes(data[:8] + header + data[8 + n :])
    digest = hashlib.sha256(header.rstrip(b" ")).hexdigest()[:12]
    renamed = blob.with_name(f"m.weights.{digest}.safetensors")
    blob.rename(renamed)
    for model in (out / "m.onnx", out / "m.portable.onnx"):
        model.write_bytes(model.read_bytes().replace(blob.name.encode(), renamed.name.encode()))
    res = cli("check", out / "m.onnx", "--json")
    assert res.returncode == 1 and _codes(res) == ["bad-prepack-record"], res.stdout
    assert "../victim1.onnx" in json.loads(res.stdout)["findings"][0]["message"]
