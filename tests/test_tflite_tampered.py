"""Re-converting a TFLite --external output checks the digests (BLAKE3, or SHA-256 in older blobs) its blob records:
a modified payload is refused
(exit 2, one line naming the tensor, nothing written)."""

from __future__ import annotations

from ai_edge_litert import schema_py_generated as s
from tflite_fixtures import sample_model

from weightshare.api import convert
from weightshare.options import ConvertOptions


def _external_output(tmp_path):
    src = sample_model(tmp_path / "m.tflite", fc_out=64)
    report = convert(src, tmp_path / "v1", ConvertOptions(external=True))
    model = next(p for p in report.outputs if p.endswith(".tflite"))
    blob = next(p for p in report.outputs if not p.endswith(".tflite"))
    m = s.ModelT.InitFromPackedBuf(open(model, "rb").read(), 0)
    ext = max(m.externalBuffers, key=lambda e: e.length)
    name = next(t.name.decode() for g in m.subgraphs for t in g.tensors if t.externalBuffer == ext.id)
    return model, blob, ext, name


def test_untouched_external_output_reconverts(tmp_path):
    model, _, _, _ = _external_output(tmp_path)
    assert convert(model, tmp_path / "v2").tensors_moved > 0


def test_modified_external_payload_is_refused(tmp_path, cli):
    model, blob, ext, name = _external_output(tmp_path)
    with open(blob, "r+b") as f:
        f.seek(ext.offset + ext.length // 2)
        byte = f.read(1)
        f.seek(ext.offset + ext.length // 2)
        f.write(bytes([byte[0] ^ 0x10]))
    res = cli("convert", model, "-o", tmp_path / "v2")
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and repr(name) in lines[0] and "digest weightshare recorded" in lines[0], lines
    assert not (tmp_path / "v2").exists() or not any((tmp_path / "v2").iterdir())
