"""MediaPipe ``.task`` bundles: read for what they are (a zip of STORED .tflite members plus metadata).

Before: bundles written by stdlib ``zipfile`` in face_landmarker.task's layout (three fp16 members without a
SignatureDef and a metadata member) or a single-model task (an fp32 member of 2 MiB plus labels), each member's data
at a chosen offset residue; hostile zips built from them byte by byte.
Under test: ``inspect`` / ``check`` (members inventoried in place, per-task copies under MediaPipe), ``convert`` (a
bundle rewritten only where it saves, 64 KiB-aligned, names and order kept; else a one-line refusal), a folder run
(bundles copied as they were, with a note), the zip reader's checks.
After: the written bundle read back by stdlib ``zipfile``; its members run in LiteRT give identical outputs.
"""

from __future__ import annotations

import json
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mediapipe_fixtures import (
    FACE_LANDMARKER,
    data_offsets,
    face_landmarker,
    fp16_member,
    fp32_member,
    single_model_task,
)
from mediapipe_fixtures import write_bundle as zip_bundle
from tflite_fixtures import sample_model

from weightshare import api
from weightshare.errors import InvalidModel, Unsupported, WeightshareError
from weightshare.formats import detect


def _json(res) -> dict:
    assert res.returncode in (0, 1), res.stderr
    return json.loads(res.stdout)


@pytest.mark.covers("mediapipe", "inspect")
def test_inspect_reads_every_member_in_place(tmp_path, cli):
    task = face_landmarker(tmp_path / "face_landmarker.task")
    res = cli("inspect", task, "--json")
    assert res.returncode == 0, res.stderr
    (inv,) = _json(res)["reports"]
    assert inv["format"] == "mediapipe"
    names = [p["name"] for p in inv["payloads"]]
    for member in FACE_LANDMARKER[:2] + FACE_LANDMARKER[3:]:
        assert any(n.startswith(member + "/") for n in names), (member, names)
    assert FACE_LANDMARKER[2] in names  # the metadata member, listed as such
    # offsets are absolute in the bundle: the member's data offset plus the buffer's place inside the member
    offsets = data_offsets(task)
    weight = next(p for p in inv["payloads"] if p["name"] == "face_landmarks_detector.tflite/dense/MatMul_fp16")
    start = offsets["face_landmarks_detector.tflite"]
    member = task.read_bytes()[start : start + zipfile.ZipFile(task).getinfo(FACE_LANDMARKER[1]).file_size]
    raw = task.read_bytes()[weight["offset"] : weight["offset"] + weight["nbytes"]]
    assert start < weight["offset"] < start + len(member) and raw in member
    # what MediaPipe pays per task: XNNPACK packs the fp16 weight as fp32 (twice its bytes), nothing misaligned
    assert weight["copies"] == {"mediapipe-tasks": 2 * weight["nbytes"]}
    assert any("MediaPipe packs" in n and "face_blendshapes.tflite" in n for n in inv["notes"])


@pytest.mark.covers("mediapipe", "check")
def test_check_reports_what_each_task_copies(tmp_path, cli):
    task = face_landmarker(tmp_path / "face_landmarker.task")
    doc = _json(cli("check", task, "--json", "--threshold", "1"))
    codes = {f["code"]: f for f in doc["findings"]}
    assert "unreadable-model" not in codes
    pack = codes["mediapipe-pack-copy-per-task"]
    assert "weightshare.litert" in pack["fix"] and "per MediaPipe task" in pack["message"]
    assert "mediapipe-unaligned-copy-per-task" not in codes  # every member is 4-byte aligned


def test_check_names_misaligned_constants_and_the_fix(tmp_path, cli):
    task = single_model_task(tmp_path / "classifier.task", residue=2)  # fp32 constants at 2 mod 4
    doc = _json(cli("check", task, "--json"))
    finding = next(f for f in doc["findings"] if f["code"] == "mediapipe-unaligned-copy-per-task")
    assert finding["severity"] == "error" and "weightshare convert" in finding["fix"]
    assert "model.tflite/dense/MatMul" in finding["message"]


def test_convert_refuses_a_bundle_a_rebuild_cannot_improve(tmp_path, cli):
    task = face_landmarker(tmp_path / "face_landmarker.task")
    out = tmp_path / "out"
    res = cli("convert", task, "-o", out)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert str(task) in lines[0] and "packs their weights per task" in lines[0]
    assert "weightshare.litert" in lines[0] and "Traceback" not in res.stderr
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_convert_writes_an_aligned_bundle_that_runs_the_same(tmp_path, cli):
    from ai_edge_litert.interpreter import Interpreter

    task = single_model_task(tmp_path / "classifier.task", residue=2)
    out = tmp_path / "out"
    res = cli("convert", task, "-o", out)
    assert res.returncode == 0, res.stderr
    written = out / task.name
    with zipfile.ZipFile(task) as a, zipfile.ZipFile(written) as b:
        assert b.testzip() is None
        assert [i.filename for i in b.infolist()] == [i.filename for i in a.infolist()]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in b.infolist())
        for name in a.namelist():
            assert a.read(name) == b.read(name)
        members = {n: (a.read(n), b.read(n)) for n in a.namelist() if n.endswith(".tflite")}
    assert all(offset % 65536 == 0 for offset in data_offsets(written).values()), data_offsets(written)
    rng = np.random.default_rng(0)
    for before, after in members.values():
        for batch in (1, 4):
            x = rng.standard_normal((batch, 128)).astype(np.float32)
            outs = []
            for content in (before, after):
                interp = Interpreter(model_content=content)
                detail = interp.get_input_details()[0]
                interp.resize_tensor_input(detail["index"], [batch, 128])
                interp.allocate_tensors()
                interp.set_tensor(detail["index"], x)
                interp.invoke()
                outs.append(interp.get_tensor(interp.get_output_details()[0]["index"]).copy())
            assert np.array_equal(outs[0], outs[1])
    after_check = _json(cli("check", written, "--json"))
    assert not [f for f in after_check["findings"] if f["code"] == "mediapipe-unaligned-copy-per-task"]


@pytest.mark.covers("mediapipe", "convert")
def test_convert_is_deterministic_and_keeps_member_order(tmp_path):
    task = zip_bundle(tmp_path / "b.task", [("z_first.tflite", fp32_member(11)), ("a.txt", b"x")], residue=1)
    from weightshare.formats.mediapipe.bundle import read_bundle

    api.convert(task, tmp_path / "o1")
    api.convert(task, tmp_path / "o2")
    assert (tmp_path / "o1" / "b.task").read_bytes() == (tmp_path / "o2" / "b.task").read_bytes()
    assert [m.name for m in read_bundle(tmp_path / "o1" / "b.task").members] == ["z_first.tflite", "a.txt"]


def test_folder_run_copies_bundles_as_they_were_with_a_note(tmp_path, cli):
    folder = tmp_path / "app"
    folder.mkdir()
    sample_model(folder / "model.tflite", fc_out=8)
    task = face_landmarker(folder / "face_landmarker.task")
    out = tmp_path / "out"
    res = cli("convert", folder, "-o", out, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert (out / "face_landmarker.task").read_bytes() == task.read_bytes()
    notes = doc["reports"][0]["folder"]["notes"]
    assert len(notes) == 1 and notes[0].startswith("face_landmarker.task: copied as it was")
    assert "weightshare.litert" in notes[0]
    assert [Path(r["model"]).name for r in doc["reports"]] == ["model.tflite"]


def _patched(data: bytes, at: int, value: bytes) -> bytes:
    return data[:at] + value + data[at + len(value) :]


def _central_entries(data: bytes) -> list[int]:
    """Where each central directory entry starts (no archive comment)."""
    cd, count = struct.unpack_from("<I", data, len(data) - 6)[0], struct.unpack_from("<H", data, len(data) - 12)[0]
    starts, pos = [], cd
    for _ in range(count):
        starts.append(pos)
        n, e, c = struct.unpack_from("<HHH", data, pos + 28)
        pos += 46 + n + e + c
    return starts


def _hostile(kind: str, tmp_path: Path) -> tuple[bytes, str]:
    """A damaged bundle and the words its one-line error must hold."""
    good = face_landmarker(tmp_path / "good.task").read_bytes()
    cd = struct.unpack_from("<I", good, len(good) - 6)[0]  # central directory offset (no comment)
    if kind == "compressed":
        path = tmp_path / "deflated.task"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("face_detector.tflite", fp16_member(1, 64, 96))
        return path.read_bytes(), "compressed"
    if kind == "escaping-name":
        bad = zip_bundle(tmp_path / "esc.task", [("../evil.tflite", fp16_member(1, 64, 96))])
        return bad.read_bytes(), "unsafe member name"
    if kind == "duplicate-name":
        bad = zip_bundle(tmp_path / "dup.task", [("m.tflite", b"a" * 64), ("m.tflite", b"b" * 64)])
        return bad.read_bytes(), "appears twice"
    if kind == "local-central-mismatch":  # the local header names another file than the central entry
        return _patched(good, 30, b"X"), "disagrees with the central directory"
    if kind == "size-past-directory":  # the first central entry claims more bytes than lie before the directory
        return _patched(
            _patched(good, cd + 20, struct.pack("<II", 10**7, 10**7)), 18, struct.pack("<II", 10**7, 10**7)
        ), ("run into the central directory")
    if kind == "truncated":
        return good[: len(good) // 2], "no zip end-of-central-directory record"
    if kind == "directory-outside":
        return _patched(good, len(good) - 6, struct.pack("<I", len(good) * 4)), "does not fit the file"
    if kind == "too-many-members":
        return _patched(good, len(good) - 14, struct.pack("<HH", 60000, 60000)), "claims 60000 members"
    if kind == "overlap":  # a zip bomb's trick: member b's local header planted inside member a's data
        inner = b"0123456789"
        planted = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, zlib.crc32(inner), 10, 10, 5, 0)
        a_data = b"x" * 16 + planted + b"b.bin" + inner + b"y" * 16
        bundle = zip_bundle(tmp_path / "overlap.task", [("a.bin", a_data), ("b.bin", inner)])
        data = bundle.read_bytes()
        second = _central_entries(data)[1]
        data = _patched(data, second + 42, struct.pack("<I", data_offsets(bundle)["a.bin"] + 16))
        return data, "overlaps the member before it"
    raise AssertionError(kind)


HOSTILE = [
    "compressed",
    "escaping-name",
    "duplicate-name",
    "local-central-mismatch",
    "size-past-directory",
    "truncated",
    "directory-outside",
    "too-many-members",
    "overlap",
]


@pytest.mark.filterwarnings("ignore:Duplicate name")
@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_bundles_one_line_exit_2(tmp_path, kind):
    data, words = _hostile(kind, tmp_path)
    src = tmp_path / "hostile.task"
    src.write_bytes(data)
    with pytest.raises((InvalidModel, Unsupported)) as info:
        api.inspect(src)
    assert words in info.value.message and str(src) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(WeightshareError):
        api.convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.slow
def test_hostile_bundle_on_the_command_line(tmp_path, cli):
    data, _ = _hostile("compressed", tmp_path)
    src = tmp_path / "hostile.task"
    src.write_bytes(data)
    for args in (("inspect", src), ("convert", src, "-o", tmp_path / "out")):
        res = cli(*args)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert "compressed" in res.stderr and "Traceback" not in res.stderr


def test_a_damaged_member_fails_its_crc(tmp_path):
    task = face_landmarker(tmp_path / "f.task")
    data = bytearray(task.read_bytes())
    start = data_offsets(task)[FACE_LANDMARKER[1]]
    data[start + 2000] ^= 0xFF
    task.write_bytes(bytes(data))
    with pytest.raises(InvalidModel, match="fails its CRC-32"):
        api.inspect(task)


def test_the_real_layout_with_a_prefix_before_the_first_header(tmp_path):
    """face_landmarker.task as shipped starts with two zero bytes before its first local header."""
    inner = face_landmarker(tmp_path / "plain.task", residue=2).read_bytes()  # 2 mod 4 here: 0 mod 4 once shifted
    # shift every absolute offset by 2: the central entries' local header offsets and the directory's offset
    cd = struct.unpack_from("<I", inner, len(inner) - 6)[0]
    count = struct.unpack_from("<H", inner, len(inner) - 12)[0]
    data = bytearray(b"\0\0" + inner)
    pos = cd + 2
    for _ in range(count):
        n, e, c = struct.unpack_from("<HHH", data, pos + 28)
        struct.pack_into("<I", data, pos + 42, struct.unpack_from("<I", data, pos + 42)[0] + 2)
        pos += 46 + n + e + c
    struct.pack_into("<I", data, len(data) - 6, cd + 2)
    task = tmp_path / "prefixed.task"
    task.write_bytes(bytes(data))
    assert detect(task).name == "mediapipe"
    from weightshare.formats.mediapipe.bundle import read_bundle

    bundle = read_bundle(task)
    assert [m.name for m in bundle.members] == list(FACE_LANDMARKER)
    assert bundle.members[0].header_offset == 2 and bundle.members[0].data_offset % 4 == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzzed_bundles_fail_cleanly(tmp_path, data):
    src_task = tmp_path / "fuzz_src.task"
    good = (src_task if src_task.exists() else face_landmarker(src_task)).read_bytes()
    mutated = bytearray(good)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(good) - 1))
        mutated[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(len(good) // 2, len(good)))
    src = tmp_path / "fuzzed.task"
    src.write_bytes(bytes(mutated[:cut]))
    try:
        api.inspect(src)
    except WeightshareError as e:
        assert "\n" not in e.message


@pytest.mark.covers("mediapipe", "verify")
def test_verify_compares_the_members_byte_for_byte(tmp_path, cli):
    task = single_model_task(tmp_path / "classifier.task", residue=2)
    out = tmp_path / "out"
    assert cli("convert", task, "-o", out).returncode == 0
    res = cli("verify", task, out / task.name, "--json")
    assert res.returncode == 0, res.stderr
    (doc,) = json.loads(res.stdout)["reports"]
    assert doc["passed"] and doc["payloads_compared"] == 2
    # a member changed after the conversion: verify says which, exit 1
    changed = tmp_path / "changed.task"
    zip_bundle(changed, [("model.tflite", fp32_member(8)), ("labels.txt", zipfile.ZipFile(task).read("labels.txt"))])
    res = cli("verify", task, changed)
    assert res.returncode == 1 and "member 'model.tflite': its bytes differ" in res.stdout + res.stderr


def test_converted_members_inside_a_bundle_are_judged_as_members(tmp_path, cli):
    """A member written by `weightshare convert` (buffers appended after its flatbuffer) stays a member of the
    bundle: its buffers are read in place from the bundle, not an external blob held to the blob's alignment."""
    from weightshare.api import convert

    single = tmp_path / "m" / "model.tflite"
    single.parent.mkdir()
    single.write_bytes(fp32_member(9))
    convert(single, tmp_path / "conv")
    member = (tmp_path / "conv" / "model.tflite").read_bytes()
    task = zip_bundle(tmp_path / "b.task", [("model.tflite", member), ("labels.txt", b"a\nb")], residue=2)
    doc = _json(cli("check", task, "--json"))
    assert [f["code"] for f in doc["findings"]] == ["mediapipe-unaligned-copy-per-task"]


def test_the_written_layout_byte_for_byte(tmp_path):
    """write_bundle: each local header padded by one zipalign record (id 0xD935, its alignment, zeros) so that the
    member's first byte is on the boundary; sizes and CRC in the local header (no data descriptor); the central
    directory without extra fields, its offsets pointing at the local headers."""
    from weightshare.formats.mediapipe.bundle import read_bundle, write_bundle

    src = zip_bundle(tmp_path / "s.task", [("a.tflite", b"A" * 100), ("meta/b.txt", b"B" * 7)], residue=1)
    out = tmp_path / "o.task"
    write_bundle(read_bundle(src), out, 4096)
    data = out.read_bytes()
    # first member: header at 0, name 8 bytes, data at 4096 -> extra = 4096 - 30 - 8 bytes
    assert data[:4] == b"PK\x03\x04"
    sig, ver, flags, method, _, _, crc, csize, usize, nlen, xlen = struct.unpack_from("<IHHHHHIIIHH", data, 0)
    assert (method, csize, usize, nlen, xlen, flags & 0x8) == (0, 100, 100, 8, 4096 - 38, 0)
    assert crc == zlib.crc32(b"A" * 100)
    assert struct.unpack_from("<HHH", data, 38) == (0xD935, 4096 - 38 - 4, 4096)
    assert data[44:4096] == bytes(4096 - 44) and data[4096:4196] == b"A" * 100
    # second member: header right after the first's data, its data at 8192
    assert data[4196:4200] == b"PK\x03\x04" and data[8192:8199] == b"B" * 7
    offsets = [p for p in _central_entries(data)]
    assert [struct.unpack_from("<I", data, p + 42)[0] for p in offsets] == [0, 4196]
    assert all(struct.unpack_from("<H", data, p + 30)[0] == 0 for p in offsets)  # no central extra fields
    with zipfile.ZipFile(out) as z:
        assert z.testzip() is None and z.namelist() == ["a.tflite", "meta/b.txt"]
