"""Every payload of a --prepack blob written in place of the staged one has a name of its own.

The final blob is the staged blob made final (``prepack.StagedBlob.write``): payloads found where they are, the ORT
child's appended ones adopted, and the rest copied in. Before: the staged rows were looked up by offset alone, so a
zero-length payload (an exporter's empty Resize ``roi``, stored first, where the next payload's row starts too)
missed its row and was copied in; a copied payload got no name (its tensor was never in the staged blob's plan),
and the header's payload record listed an alias ``""``. A copied payload that is no duplicate became a header
entry ``""`` with dtype ``""``, which no safetensors reader opens. After: rows are found by offset and length (the
empty payload keeps its place) and a copied payload is named like an adopted one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from prepack_samples import sample_input, upsample_onnx
from safetensors import safe_open

from weightshare._atomic import OutputTransaction
from weightshare._placement import AlignPolicy, PlannedTensor
from weightshare._safetensors import SafetensorsBlob, read_header_at
from weightshare._tensors import BytesSource, FileRange
from weightshare._write import BlobPayload, write_payloads
from weightshare.formats.onnx.ort.prepack import HEADER_SPARE, PACKED_ALIGN, StagedBlob
from weightshare.report import ConversionReport


def _names(blob: Path) -> tuple[list[str], list[str]]:
    """The header's tensor keys in file order (repeats kept: ``json.loads`` would fold them) and the aliases the
    payload record lists."""
    pairs: list[list[tuple[str, object]]] = []
    header = json.loads(read_header_at(blob)[1], object_pairs_hook=lambda kv: pairs.append(kv) or dict(kv))
    keys = [k for k, _ in pairs[-1] if k != "__metadata__"]
    record = json.loads(header["__metadata__"]["weightshare.payloads"])
    return keys, [a for entry in record.values() for a in entry["aliases"]]


def _assert_named(blob: Path) -> None:
    keys, aliases = _names(blob)
    names = keys + aliases
    assert all(names), f"a nameless entry in {blob.name}: keys {keys}, aliases {aliases}"
    assert len(set(names)) == len(names), f"a name twice in {blob.name}: {names}"
    with safe_open(str(blob), framework="numpy") as f:  # the reference reader opens every entry
        assert sorted(f.keys()) == sorted(keys)
        for k in keys:
            f.get_tensor(k)


@pytest.mark.slow  # two ORT children (convert, check's measuring one)
def test_an_empty_roi_stored_first_keeps_its_place_and_every_payload_has_one_name(cli, tmp_path):
    src = upsample_onnx(tmp_path / "fpn.onnx")
    out = tmp_path / "out"
    # --inline-threshold 0: the empty roi is an external, zero-length payload
    res = cli("convert", src, "-o", out, "-q", "--prepack", "--inline-threshold", "0")
    assert res.returncode == 0, res.stderr
    (blob,) = out.glob("*.safetensors")
    _assert_named(blob)
    keys, aliases = _names(blob)
    # no payload of this model repeats another: the roi was found where it is, not copied in as its own alias
    assert "roi" in keys and aliases == []

    check = cli("check", out / "fpn.onnx", "--json")
    errors = [f for f in json.loads(check.stdout)["findings"] if f["severity"] == "error"]
    assert check.returncode == 0 and not errors, check.stdout

    def session(path: Path, **entries: str) -> ort.InferenceSession:
        so = ort.SessionOptions()
        for k, v in entries.items():
            so.add_session_config_entry(k, v)
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    # the prepacked model at default options, the portable twin as it is run (without pre-packing): each
    # against the original under the same options
    off = {"session.disable_prepacking": "1"}
    pairs = [
        (session(out / "fpn.onnx"), session(src)),
        (session(out / "fpn.portable.onnx", **off), session(src, **off)),
    ]
    for batch in (1, 8):
        feeds = sample_input(src, batch)
        for converted, original in pairs:
            assert np.array_equal(converted.run(None, feeds)[0], original.run(None, feeds)[0])


def test_a_payload_copied_into_the_staged_blob_is_named(tmp_path):
    """The copy branch, which no input was seen to reach once the rows are found by offset and length: a packed
    buffer still in another file (an earlier model's, were the child to leave it there) is copied in, under its
    own name, and the blob opens in the safetensors reader with both payloads' bytes."""
    stage = tmp_path / "stage"
    stage.mkdir()
    weight = np.arange(64, dtype=np.float32)
    packed = np.random.default_rng(0).integers(0, 256, PACKED_ALIGN, dtype=np.uint8)
    (stage / "earlier.bin").write_bytes(b"\0" * 100 + packed.tobytes())  # off the blob's alignment there

    path = stage / "plain.safetensors"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    planned = PlannedTensor("w", "float32", (64,), weight.nbytes)
    blob = SafetensorsBlob(fd, [planned], AlignPolicy(), spare=HEADER_SPARE)
    report = ConversionReport(model="m.onnx", format="onnx")
    at = write_payloads(blob, [BlobPayload(planned, BytesSource(weight.tobytes()), 256)], report).offset(0)
    staged = StagedBlob(path, fd, blob)

    payloads = [
        BlobPayload(PlannedTensor("w", "float32", (64,), 256), FileRange(str(path), at, 256), 256),
        BlobPayload(
            PlannedTensor("ort.prepacked/w/MatMul+1/0", "uint8", (PACKED_ALIGN,), PACKED_ALIGN, min_align=PACKED_ALIGN),
            FileRange(str(stage / "earlier.bin"), 100, PACKED_ALIGN),
            PACKED_ALIGN,
        ),
    ]
    final = tmp_path / "m.safetensors"
    try:
        with OutputTransaction() as tx:
            done = staged.write(payloads, {}, final, tx, report)
            assert done is not None
    finally:
        staged.close()
    _assert_named(final)
    with safe_open(str(final), framework="numpy") as f:
        assert np.array_equal(f.get_tensor("w"), weight)
        assert np.array_equal(f.get_tensor("ort.prepacked/w/MatMul+1/0"), packed)
