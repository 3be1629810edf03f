"""ExecuTorch as a format: detection, the bounds-checked reader, convert (segments re-laid page-aligned in place),
inventory/check, the loader's binding of keys to content, and damaged inputs.

Before: programs and data files with the layouts executorch 1.5.1 writes (tests/executorch_fixtures.py, 128-byte
segment alignment). Under test: ``weightshare convert``/``check``/``inspect`` on them through the format registry.
After: every payload at 64 KiB (>= 1 MiB) or 64 B, its bytes unchanged and found under the same key or tensor index,
the flatbuffer unchanged but for the fields that locate segments. Running the programs in ExecuTorch's runtime is
scripts/build_executorch.py's part (executorch is not a test dependency: 1.5 GB with torch).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from executorch_fixtures import data_file, external_program, portable_program, xnnpack_program
from fuzz_harness import MUTATIONS, FuzzStats, check_one, mutate, scratch_dir

from weightshare import api, formats
from weightshare._check import Gate, findings_for
from weightshare._dispatch import inventory
from weightshare._verify import VerifyReport
from weightshare.errors import InvalidModel
from weightshare.formats.executorch import flatbuf
from weightshare.formats.executorch.loader import bind_keys
from weightshare.formats.executorch.verify import compare_payloads
from weightshare.options import ConvertOptions

MIB = 1 << 20


def _program(path: Path) -> flatbuf.Program:
    with open(path, "rb") as f:
        return flatbuf.read_program(f.fileno(), str(path))


def _data(path: Path) -> flatbuf.DataFile:
    with open(path, "rb") as f:
        return flatbuf.read_data_file(f.fileno(), str(path))


def _bytes(path: Path, pos: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(pos)
        return f.read(n)


def _named_bytes(path: Path) -> dict[str, tuple[int, bytes]]:
    prog = _program(path)
    return {
        nd.key: (
            prog.segments[nd.segment].file_offset,
            _bytes(path, prog.segments[nd.segment].file_offset, prog.segments[nd.segment].nbytes),
        )
        for nd in prog.named_data
    }


def _expected_alignment(nbytes: int) -> int:
    return 64 * 1024 if nbytes >= MIB else 64


def test_detected_by_content_and_a_pte_without_its_identifier_is_one_line(tmp_path, cli):
    assert formats.detect(xnnpack_program(tmp_path / "x.pte")).name == "executorch"
    assert formats.detect(data_file(tmp_path / "f.ptd", {"w": np.ones(4, np.float32)})).name == "executorch"
    renamed = tmp_path / "model.bin"
    shutil.copy(tmp_path / "x.pte", renamed)
    assert formats.detect(renamed).name == "executorch"  # the content decides, not the name
    bad = tmp_path / "bad.pte"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(InvalidModel, match="not an ExecuTorch program"):
        formats.detect(bad)
    res = cli("convert", bad, "-o", tmp_path / "out")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "out" / "bad.pte").exists()


@pytest.mark.covers("executorch", "convert")
def test_xnnpack_program_every_weight_page_aligned_same_bytes_same_key(tmp_path):
    src = xnnpack_program(tmp_path / "m.pte", dim=512, layers=2)
    before = _program(src)
    assert any(off % (64 * 1024) for off, _ in _named_bytes(src).values())  # the exporter's 128-byte layout
    report = api.convert(src, tmp_path / "out")
    out = tmp_path / "out" / "m.pte"
    after = _program(out)
    old, new = _named_bytes(src), _named_bytes(out)
    assert old.keys() == new.keys() and len(old) == 4
    for key, (offset, data) in new.items():
        assert data == old[key][1], key
        assert offset % _expected_alignment(len(data)) == 0, (key, offset)
    # the delegate blob: same bytes; the flatbuffer: identical but for the u64 fields that locate segments
    d_old, d_new = before.segments[1], after.segments[1]
    assert _bytes(out, d_new.file_offset, d_new.nbytes) == _bytes(src, d_old.file_offset, d_old.nbytes)
    assert after.program_size == before.program_size
    patched = {before.header_pos, before.segment_data_size_pos}
    patched |= {s.offset_field for s in before.segments} | {s.size_field for s in before.segments}
    a, b = bytearray(_bytes(src, 0, before.program_size)), bytearray(_bytes(out, 0, after.program_size))
    for pos in patched - {None}:
        a[pos : pos + 8] = b[pos : pos + 8] = bytes(8)
    assert a == b
    assert after.segment_base == after.segments[1].file_offset  # the omitted offset (0) is the segment base
    assert report.tensors_moved == 6 and report.bytes_written == sum(s.nbytes for s in before.segments)


def test_portable_program_constant_segment_split_per_tensor(tmp_path):
    src = portable_program(tmp_path / "p.pte", dim=512, layers=2)
    before = _program(src)
    api.convert(src, tmp_path / "out")
    out = tmp_path / "out" / "p.pte"
    after = _program(out)
    seg_a, seg_b = before.segments[0], after.segments[0]
    assert seg_b.file_offset % (64 * 1024) == 0
    sizes = [c.shape for c in before.constants]
    for c in before.constants:
        n = int(np.prod(c.shape)) * 4
        old = _bytes(src, seg_a.file_offset + before.constant_offsets[c.buffer_index], n)
        pos = seg_b.file_offset + after.constant_offsets[c.buffer_index]
        assert _bytes(out, pos, n) == old, c.name
        assert pos % _expected_alignment(n) == 0, (c.name, pos)
        assert after.constant_offsets[c.buffer_index] + n <= seg_b.nbytes
    assert sizes == [(512, 512), (512,), (512, 512), (512,)]
    notes = inventory(out).notes  # the arena the runtime allocates per program, apart from the mapped weights
    assert any(n.startswith("memory-planned buffers") and "1.0 MiB per loaded program" in n for n in notes), notes


def test_data_file_segments_aligned_and_found_by_name(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "base.0.weight": rng.standard_normal((640, 512), np.float32),
        "base.0.bias": rng.standard_normal(640, np.float32),
    }
    src = data_file(tmp_path / "foundation.ptd", tensors)
    api.convert(src, tmp_path / "out")
    data = _data(tmp_path / "out" / "foundation.ptd")
    for nd in data.named_data:
        seg = data.segments[nd.segment]
        assert _bytes(tmp_path / "out" / "foundation.ptd", seg.file_offset, seg.nbytes) == tensors[nd.key].tobytes()
        assert seg.file_offset % _expected_alignment(seg.nbytes) == 0
        assert nd.dtype == "float32" and nd.shape == tensors[nd.key].shape


def test_identical_named_data_is_stored_once(tmp_path):
    src = xnnpack_program(tmp_path / "m.pte", dim=512, layers=2, duplicate=True)
    report = api.convert(src, tmp_path / "out")
    out = tmp_path / "out" / "m.pte"
    named = _named_bytes(out)
    first = next(k for k in named if not k.startswith("duplicate"))
    dup = next(k for k in named if k.startswith("duplicate"))
    assert named[first] == named[dup]  # same offset, same bytes
    assert report.deduplicated == 1 and report.deduplicated_bytes == 512 * 512 * 4


def _codes(path: Path, *targets: str) -> dict[str, str]:
    inv = inventory(path)
    return {f.code.value: f.severity.value for f in findings_for(inv, Gate(targets=targets, measure=False))}


@pytest.mark.covers("executorch", "check")
def test_check_names_xnnpack_packing_under_the_plain_runtime_and_alignment(tmp_path, cli):
    src = xnnpack_program(tmp_path / "m.pte", dim=512, layers=2)
    plain = cli("check", src, "--target", "executorch-mmap", "--json")
    assert plain.returncode == 1
    codes = {f["code"]: f["severity"] for f in json.loads(plain.stdout)["findings"]}
    assert codes == {"executorch-xnnpack-pack-copy-per-program": "error", "unaligned": "warning"}, codes
    # the first setting, weightshare's loader, packs once per process: a warning (exit 0)
    assert _codes(src) == {"executorch-xnnpack-pack-copy-per-program": "warning", "unaligned": "warning"}
    api.convert(src, tmp_path / "out")
    assert "unaligned" not in _codes(tmp_path / "out" / "m.pte", "executorch-mmap")
    portable = portable_program(tmp_path / "p.pte")
    assert _codes(portable, "executorch-mmap") == {"unaligned": "warning"}
    api.convert(portable, tmp_path / "out")
    assert _codes(tmp_path / "out" / "p.pte", "executorch-mmap") == {}


def test_program_with_external_constants_locates_them_in_the_ptd_beside_it(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {
        "base.0.weight": rng.standard_normal((64, 64), np.float32),
        "base.0.bias": rng.standard_normal(64, np.float32),
    }
    data_file(tmp_path / "foundation.ptd", tensors)
    data_file(tmp_path / "other.ptd", {"unrelated": np.ones(8, np.float32)})
    prog = external_program(tmp_path / "lora_a.pte", list(tensors), [t.shape for t in tensors.values()])
    inv = inventory(prog)
    where = {p.name: (p.file, p.nbytes, p.shape) for p in inv.payloads}
    assert where == {k: ("foundation.ptd", t.nbytes, t.shape) for k, t in tensors.items()}
    (tmp_path / "foundation.ptd").unlink()
    missing = inventory(prog)
    assert all("no .ptd" in p.problem for p in missing.payloads) and len(missing.payloads) == 2


def test_loader_binds_each_key_to_its_bytes_before_sharing_packed_weights(tmp_path):
    a = xnnpack_program(tmp_path / "a.pte", dim=64, layers=1, seed=0)
    assert bind_keys([a]) == []
    assert bind_keys([a]) == []  # the same bytes again: shareable
    b = xnnpack_program(tmp_path / "b.pte", dim=64, layers=1, seed=1)
    prog_b = _program(b)
    # b under a's keys: a file may claim any key; the cache must not hand it a's packed weights
    key_pos = {nd.key: i for i, nd in enumerate(prog_b.named_data)}
    raw = bytearray(b.read_bytes())
    for nd_a, nd_b in zip(_program(a).named_data, prog_b.named_data):
        at = raw.find(nd_b.key.encode())
        while at >= 0:
            raw[at : at + 64] = nd_a.key.encode()
            at = raw.find(nd_b.key.encode())
    forged = tmp_path / "forged.pte"
    forged.write_bytes(bytes(raw))
    assert key_pos and sorted(bind_keys([forged])) == sorted(nd.key for nd in _program(a).named_data)


@pytest.mark.parametrize("maker", [xnnpack_program, portable_program])
def test_every_truncation_is_refused_in_one_line_nothing_written(tmp_path, maker):
    data = maker(tmp_path / "m.pte", dim=64, layers=1).read_bytes()
    segment_base = _program(tmp_path / "m.pte").segment_base
    cuts = sorted({*range(0, segment_base + 64, 7), *range(segment_base, len(data), 997), len(data) - 1})
    for cut in cuts:
        src = tmp_path / "cut" / "m.pte"
        src.parent.mkdir(exist_ok=True)
        src.write_bytes(data[:cut])
        with pytest.raises(InvalidModel) as e:  # damaged, said so: not "unknown format", not a crash
            api.convert(src, tmp_path / "out")
        assert "\n" not in e.value.line(), cut
        assert not (tmp_path / "out" / "m.pte").exists()


@pytest.mark.slow
def test_mutated_programs_and_data_files_never_traceback(tmp_path):
    seeds = [
        ("m.pte", xnnpack_program(tmp_path / "x.pte", dim=32, layers=2).read_bytes()),
        ("p.pte", portable_program(tmp_path / "p.pte", dim=32, layers=2).read_bytes()),
        (
            "f.ptd",
            data_file(
                tmp_path / "f.ptd", {"w": np.ones((32, 32), np.float32), "b": np.ones(32, np.float32)}
            ).read_bytes(),
        ),
    ]
    stats = FuzzStats()
    rng = random.Random(35)
    work = scratch_dir(tmp_path / "w")
    try:
        for i in range(240):
            name, data = seeds[i % len(seeds)]
            kind, mutated = mutate(data, rng, MUTATIONS[i % len(MUTATIONS)])
            try:
                check_one(mutated, name, work, stats, kind)
            except AssertionError as e:
                (tmp_path / f"failing-{name}").write_bytes(mutated)
                raise AssertionError(f"input {i} ({kind}): {e}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    assert stats.inputs == 240 and stats.rejected > 30 and stats.converted > 30, stats


def test_segment_offset_outside_the_file_is_refused_before_reading(tmp_path):
    src = xnnpack_program(tmp_path / "m.pte", dim=64, layers=1)
    prog = _program(src)
    raw = bytearray(src.read_bytes())
    pos = prog.segments[2].offset_field
    assert pos is not None
    struct.pack_into("<Q", raw, pos, 1 << 62)
    src.write_bytes(bytes(raw))
    with pytest.raises(InvalidModel, match="run past the end"):
        _program(src)
    assert os.path.getsize(src) < 1 << 20


@pytest.mark.covers("executorch", "verify")
@pytest.mark.parametrize("maker", [xnnpack_program, portable_program])
def test_verify_compares_every_weight_by_key_and_finds_one_flipped_byte(tmp_path, maker):
    src = maker(tmp_path / "m.pte", dim=128, layers=2)
    api.convert(src, tmp_path / "out")
    out = tmp_path / "out" / "m.pte"
    good = VerifyReport(str(src), str(out), "executorch")
    compare_payloads(good, src, out)
    assert good.mismatches == [] and good.payloads_compared == 4
    seg = _program(out).segments[-1]
    raw = bytearray(out.read_bytes())
    raw[seg.file_offset + 100] ^= 0x01
    out.write_bytes(bytes(raw))
    bad = VerifyReport(str(src), str(out), "executorch")
    compare_payloads(bad, src, out)
    assert len(bad.mismatches) == 1 and "differs from the original at byte" in bad.mismatches[0], bad.mismatches


def test_prepack_is_refused_and_another_formats_unpack_is_a_note(tmp_path, cli):
    src = xnnpack_program(tmp_path / "m.pte", dim=64, layers=1)
    res = cli("convert", src, "-o", tmp_path / "out", "--prepack")
    assert res.returncode == 2 and "weightshare.executorch.program" in res.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    report = api.convert(src, tmp_path / "out2", ConvertOptions(unpack=frozenset({"sparse"})))
    assert report.notes == ["--unpack sparse is not implemented for ExecuTorch"]


def test_an_empty_first_segment_does_not_hold_a_large_one_off_its_page(tmp_path):
    # segments [empty constant segment, a 1 MiB weight], both offset fields omitted (relative 0): the weight must
    # land at the segment base, 64 KiB-aligned, whatever the empty segment's placement
    import flatbuffers
    from executorch_fixtures import _plan, _program_file

    weight = np.random.default_rng(3).standard_normal(1 << 18, np.float32).tobytes()
    b = flatbuffers.Builder(1024)
    src = tmp_path / "m.pte"
    src.write_bytes(_program_file(_plan(b, [], delegate_segment=None), b, [b"", weight], [("w", 1)], [0], 0))
    before = _program(src)
    assert before.segments[1].offset_field is None and before.segments[1].file_offset % (64 * 1024)
    api.convert(src, tmp_path / "out")
    after = _program(tmp_path / "out" / "m.pte")
    seg = after.segments[1]
    assert seg.file_offset % (64 * 1024) == 0 and after.segment_base == seg.file_offset
    assert _bytes(tmp_path / "out" / "m.pte", seg.file_offset, seg.nbytes) == weight
