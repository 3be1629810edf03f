"""The cut checks' digest cache (``segments._digest_payload``) never vouches for bytes written after it read them:
the child cuts the staged blob back when a segment is dropped and writes other bytes at the same offsets."""

from __future__ import annotations

from types import SimpleNamespace

import onnx

from weightshare.formats.onnx.ort import segments
from weightshare.formats.onnx.ort.child import Sharer


def _tensor(location: str, offset: int, length: int) -> onnx.TensorProto:
    t = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[length // 4])
    t.data_location = onnx.TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def test_a_cut_off_blob_forgets_the_digests_of_what_was_past_the_cut(tmp_path):
    blob = tmp_path / "plain.safetensors"
    blob.write_bytes(b"\0" * 4096 + b"A" * 4096)  # the parent's bytes, then a segment's the child appended
    kept, appended = _tensor(blob.name, 0, 4096), _tensor(blob.name, 4096, 4096)
    segments.digested.clear()
    first_kept, first = segments._digest_payload(kept, tmp_path), segments._digest_payload(appended, tmp_path)
    sharer = SimpleNamespace(stage=str(tmp_path), target=SimpleNamespace(blob=blob.name))
    Sharer._cut_off(sharer, 4096)  # the segment dropped: its bytes cut off ...
    with open(blob, "ab") as f:
        f.write(b"B" * 4096)  # ... and another segment's written at the same offset
    assert segments._digest_payload(appended, tmp_path) != first  # a digest kept from before the cut: the "A"s'
    assert segments._digest_payload(kept, tmp_path) == first_kept  # what the cut did not touch stays cached
    assert any(k[1] == 0 for k in segments.digested)
    segments.digested.clear()
