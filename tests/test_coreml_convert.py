"""`weightshare convert X.mlpackage`: coremltools still reads the output, and every weight is the same bytes.

Before: packages built by coremltools (iOS15..iOS18 opsets, nested blocks, constexpr ops, sub-byte dtypes).
Under test: convert_file through weightshare.api.convert.
After: ct.models.MLModel loads the spec, the milproto loader reads the program, every BlobFileValue
decodes through coremltools' blob reader to the source's elements, the spec is otherwise unchanged,
large payloads sit at 64 KiB, and every other file is byte-identical.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import coreml_fixtures as F
import pytest

import weightshare.api as api
from weightshare._placement import AlignPolicy
from weightshare.formats.coreml.milblob import WeightFile
from weightshare.options import ConvertOptions

KINDS = [
    "iOS15",
    "iOS16",
    "nested",
    "int4",
    "int8",
    "lut3",
    "lut6",
    "sparse",
    "lut2-16",
    "int8-16",
    "sparse-16",
    "odd-int4",
    "odd-lut3",
    "odd-lut6",
]


@pytest.fixture(scope="session")
def packages(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("coreml_src")
    built = {
        "iOS15": F.mlp(d / "m15.mlpackage", "iOS15"),
        "iOS16": F.mlp(d / "m16.mlpackage", "iOS16"),
        "nested": F.nested(d / "nested.mlpackage"),
    }
    for kind in KINDS[3:]:
        if kind.startswith("odd-"):
            built[kind] = F.odd_subbyte(d / f"{kind}.mlpackage", kind[4:])
        else:
            built[kind] = F.compressed(d / f"c_{kind}.mlpackage", kind)
    return built


def _strip_blobs(spec):
    spec = copy.deepcopy(spec)
    for bfv in F.blob_values(spec):
        bfv.offset = 0
    return spec


def _load_program(pkg: Path):
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

    spec = F.load_spec(pkg)
    return milproto_load(spec, spec.specificationVersion, str(pkg / "Data/com.apple.CoreML/weights"))


@pytest.mark.covers("coreml", "convert")
@pytest.mark.parametrize("kind", KINDS)
def test_convert_keeps_program_and_weight_bytes(packages, kind, tmp_path):
    import coremltools as ct

    src = packages[kind]
    report = api.convert(src, tmp_path)
    out = tmp_path / src.name
    assert report.outputs == [str(out)] and report.tensors_moved > 0

    ct.models.MLModel(str(out), skip_model_load=True)  # the spec loads
    prog = _load_program(out)  # coremltools' MIL loader reads every op and weight
    assert list(prog.functions) == list(_load_program(src).functions)

    src_spec, out_spec = F.load_spec(src), F.load_spec(out)
    assert _strip_blobs(src_spec) == _strip_blobs(out_spec)  # nothing but blob offsets changed
    src_vals, out_vals = F.blob_values(src_spec), F.blob_values(out_spec)
    assert len(src_vals) == len(out_vals) > 0
    for a, b in zip(src_vals, out_vals):
        assert b.fileName == "@model_path/weights/weight.bin"
        assert F.decode_blob(out, b) == F.decode_blob(src, a)


@pytest.mark.parametrize("kind", ["iOS16", "odd-lut3", "odd-int4"])
def test_weight_file_layout(packages, kind, tmp_path):
    src = packages[kind]
    api.convert(src, tmp_path)
    weight_bin = tmp_path / src.name / "Data/com.apple.CoreML/weights/weight.bin"
    wf = WeightFile(weight_bin)
    offsets = F.walk_records(weight_bin)  # GetAllOffsets reaches every record
    assert wf.count == len(offsets)
    assert {v.offset for v in F.blob_values(F.load_spec(tmp_path / src.name))} == set(offsets)
    src_wf = WeightFile(src / "Data/com.apple.CoreML/weights/weight.bin")
    src_pad = sorted(src_wf.record(o).padding_bits for o in F.walk_records(src_wf.path))
    assert sorted(wf.record(o).padding_bits for o in offsets) == src_pad
    if kind.startswith("odd"):
        assert any(src_pad), "fixture should exercise sub-byte padding bits"
    for off in offsets:
        rec = wf.record(off)
        assert off % 64 == 0
        assert rec.data_offset % (64 << 10 if rec.nbytes >= 1 << 20 else 64) == 0
    if kind == "iOS16":
        assert any(wf.record(o).nbytes >= 1 << 20 for o in offsets), "fixture should have a >= 1 MiB payload"


def test_other_files_and_manifest_are_preserved(packages, tmp_path):
    import shutil

    src = tmp_path / "src" / "extra.mlpackage"
    shutil.copytree(packages["iOS16"], src)
    (src / "Data/com.apple.CoreML/notes.txt").write_bytes(b"keep me\x00\xff")
    (src / "Data/com.apple.CoreML/weights/unused.bin").write_bytes(b"\x01" * 100)
    api.convert(src, tmp_path / "out")
    out = tmp_path / "out" / src.name
    for rel in ["Manifest.json", "Data/com.apple.CoreML/notes.txt", "Data/com.apple.CoreML/weights/unused.bin"]:
        assert (out / rel).read_bytes() == (src / rel).read_bytes(), rel
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    assert (out / "Data/com.apple.CoreML/weights/weight.bin").stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_convert_is_deterministic_and_dedupes(packages, tmp_path):
    src = packages["nested"]  # the nested fixture repeats no payload, but the walk visits many values
    a = api.convert(src, tmp_path / "a")
    api.convert(src, tmp_path / "b")
    for rel in ["Data/com.apple.CoreML/model.mlmodel", "Data/com.apple.CoreML/weights/weight.bin"]:
        assert (tmp_path / "a" / src.name / rel).read_bytes() == (tmp_path / "b" / src.name / rel).read_bytes()
    assert a.bytes_written + a.deduplicated_bytes == a.bytes_in


def test_identical_payloads_stored_once(tmp_path):
    """Two consts with the same fp16 bytes (coremltools' own dedupe pass turned off) become one blob."""
    import coremltools as ct
    from coremltools.converters.mil.mil import Builder as mb

    w = F.weights(5, (256, 256))

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 256))], opset_version=ct.target.iOS16)
    def prog(x):
        a = mb.linear(x=x, weight=w)
        b = mb.linear(x=mb.relu(x=a), weight=w.copy())
        return mb.add(x=a, y=b, name="out")

    pipeline = ct.PassPipeline.DEFAULT
    pipeline.remove_passes(["common::const_deduplication"])
    model = ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.iOS16,
        skip_model_load=True,
        pass_pipeline=pipeline,
    )
    src = tmp_path / "twice.mlpackage"
    model.save(str(src))
    src_bin = WeightFile(src / "Data/com.apple.CoreML/weights/weight.bin")
    src_vals = F.blob_values(F.load_spec(src))
    big = [i for i, v in enumerate(src_vals) if src_bin.record(v.offset).nbytes == 256 * 256 * 2]
    assert len({src_vals[i].offset for i in big}) == 2, "fixture should store the weight twice"

    report = api.convert(src, tmp_path / "out")
    out = tmp_path / "out" / src.name
    out_vals = F.blob_values(F.load_spec(out))
    assert report.deduplicated >= 1 and report.deduplicated_bytes >= 256 * 256 * 2  # also the two zero biases
    assert len({out_vals[i].offset for i in big}) == 1
    assert all(F.decode_blob(out, out_vals[i]) == F.decode_blob(src, src_vals[i]) for i in big)
    assert report.blob_bytes < src_bin.size


def test_small_alignment_option(packages, tmp_path):
    src = packages["iOS16"]
    api.convert(src, tmp_path, ConvertOptions(align=AlignPolicy(large=64)))
    out_bin = tmp_path / src.name / "Data/com.apple.CoreML/weights/weight.bin"
    src_bin = src / "Data/com.apple.CoreML/weights/weight.bin"
    assert out_bin.stat().st_size <= src_bin.stat().st_size  # coremltools' own 64-byte layout, no larger


def test_small_payloads_fill_the_alignment_gap(tmp_path):
    """A 1 MiB weight needs a 64 KiB-aligned offset; small payloads go into the gap before it, so the file
    grows by less than one small payload over coremltools' own 64-byte layout instead of by ~64 KiB."""
    import coremltools as ct
    from coremltools.converters.mil.mil import Builder as mb

    big = F.weights(40, (1024, 512))
    smalls = [F.weights(41 + i, (1024,)) for i in range(40)]  # 2 KiB each in fp16: 80 KiB in all

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 512))], opset_version=ct.target.iOS17)
    def prog(x):
        y = mb.linear(x=x, weight=big)
        for s in smalls:
            y = mb.relu(x=mb.add(x=y, y=s))  # relu keeps the adds from being folded into one
        return mb.identity(x=y, name="out")

    src = F._save(prog, tmp_path / "gap.mlpackage", ct.target.iOS17)
    api.convert(src, tmp_path / "out")
    out = tmp_path / "out" / src.name
    src_size = (src / "Data/com.apple.CoreML/weights/weight.bin").stat().st_size
    out_bin = out / "Data/com.apple.CoreML/weights/weight.bin"
    assert out_bin.stat().st_size <= src_size + 64 + 2048
    wf = WeightFile(out_bin)
    recs = [wf.record(o) for o in F.walk_records(out_bin)]
    large = [r for r in recs if r.nbytes >= 1 << 20]
    assert len(large) == 1 and large[0].data_offset % (64 << 10) == 0
    assert sum(r.offset < large[0].offset for r in recs) >= 25  # the gap holds most of the small payloads
    assert [F.decode_blob(out, v) for v in F.blob_values(F.load_spec(out))] == [
        F.decode_blob(src, v) for v in F.blob_values(F.load_spec(src))
    ]


def test_package_without_weights_is_copied_as_is(tmp_path):
    import coremltools as ct
    from coremltools.converters.mil.mil import Builder as mb

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 8))], opset_version=ct.target.iOS16)
    def prog(x):
        return mb.relu(x=x, name="out")

    src = F._save(prog, tmp_path / "noweights.mlpackage", ct.target.iOS16)
    report = api.convert(src, tmp_path / "out")
    out = tmp_path / "out" / src.name
    assert report.tensors_moved == 0 and report.blob_bytes == 0
    files = {p.relative_to(src): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == sorted(p.relative_to(src) for p in src.rglob("*"))
