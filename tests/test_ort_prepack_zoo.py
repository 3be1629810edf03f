"""convert --prepack --shared-blob: a decoder family (decoder, decoder_with_past, merged) in one blob that holds
each distinct plain payload and each distinct packed copy once; every model bit-identical at default options,
every portable twin bit-identical under disable_prepacking, and weightshare.ort.session falling back to the
model's own twin."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import model_forms as mf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from safetensors import safe_open

import weightshare.ort as wort
from weightshare._safetensors import read_safetensors_metadata
from weightshare.formats.onnx.graph import external_tensors
from weightshare.formats.onnx.ort.prepack import METADATA_KEY, PREPACKED_ENTRY, portable_name

pytestmark = pytest.mark.slow  # three conversions with an ORT child each

NAMES = ("decoder_model.onnx", "decoder_with_past_model.onnx", "decoder_model_merged.onnx")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    from conftest import run_cli

    d = tmp_path_factory.mktemp("family")
    mf.decoder_family(d / "src", mib=1)
    res = run_cli("convert", d / "src", "-o", d / "out", "--prepack", "--shared-blob", "family", "--json", "-q")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    zoo = doc["reports"][0]["zoo"]  # the zoo's figures, the same in each of its models' records
    return d / "src", d / "out", {**zoo, "models": doc["reports"]}


def _feeds(src: Path) -> list[dict[str, np.ndarray]]:
    return [mf.feeds(src, batch=b, use_cache_branch=c) for b in (1, 8) for c in (True, False)]


def test_every_model_and_twin_is_bit_identical(family):
    src, out, report = family
    assert sorted(Path(m["outputs"][0]).name for m in report["models"]) == sorted(NAMES)
    off = ort.SessionOptions()
    off.add_session_config_entry("session.disable_prepacking", "1")
    for name in NAMES:
        original, prepacked = ort.InferenceSession(str(src / name)), ort.InferenceSession(str(out / name))
        plain, twin = (
            ort.InferenceSession(str(src / name), off),
            ort.InferenceSession(str(out / portable_name(name)), off),
        )
        for feeds in _feeds(src / name):
            assert np.array_equal(original.run(None, feeds)[0], prepacked.run(None, feeds)[0])
            assert np.array_equal(plain.run(None, feeds)[0], twin.run(None, feeds)[0])


def _ranges(model_path: Path) -> tuple[set[tuple[str, str]], dict[tuple[str, str], str]]:
    """(location, offset) of every plain payload; (weight, kernel key) -> packed buffer offsets."""
    model = onnx.load(str(model_path), load_external_data=False)
    plain, packed = set(), {}
    for t in external_tensors(model):
        e = {x.key: x.value for x in t.external_data}
        plain.add((e["location"], e["offset"]))
        for k, v in e.items():
            if k.startswith(PREPACKED_ENTRY):
                key, *bufs = v.split("|")
                packed[(t.name, key)] = ",".join(b.split(";")[0] for b in bufs)
    return plain, packed


def test_one_blob_holds_each_distinct_payload_and_packed_copy_once(family):
    _, out, report = family
    blobs = {x.value for n in NAMES for t in external_tensors(onnx.load(str(out / n), load_external_data=False))
             for x in t.external_data if x.key == "location"}  # fmt: skip
    assert blobs == {Path(report["blob"]).name}
    packed = [_ranges(out / n)[1] for n in NAMES]
    assert all(packed), "every model carries ORT's packed copies"
    # the same weight packed by the same kernel is the same bytes: all three models point at one copy
    for key in set(packed[0]) & set(packed[1]) & set(packed[2]):
        assert packed[0][key] == packed[1][key] == packed[2][key]
    _, header, _meta = read_safetensors_metadata(report["blob"])
    starts = [v["data_offsets"][0] for n, v in header.items() if not n.startswith("__")]
    assert len(starts) == len(set(starts))  # no payload stored twice
    # unique plain bytes (the family's one set of weights) + unique packed bytes, and little else
    src = Path(report["models"][0]["model"]).parent
    weights = (src / "decoder_model.data").stat().st_size
    assert report["blob_bytes"] <= 1.1 * (weights + max(m["prepack"]["packed_bytes"] for m in report["models"]))


def test_blob_metadata_names_every_twin_and_the_helper_falls_back_to_its_own(family, monkeypatch, caplog):
    _, out, report = family
    with safe_open(report["blob"], "np") as f:
        record = json.loads(f.metadata()[METADATA_KEY])
    assert record["portable_models"] == {n: portable_name(n) for n in NAMES}
    other = {**wort.this_machine(), "onnxruntime": "0.0.0"}
    monkeypatch.setattr(wort, "_machine", other)
    monkeypatch.setattr(wort, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="weightshare.ort"):
        sess = wort.session(out / "decoder_with_past_model.onnx")
    said = caplog.records[0].getMessage()
    assert "onnxruntime" in said
    # its own twin, not the zoo's first model's: ORT got the bytes (no path to show), so the log and the
    # graph's inputs tell which model runs
    assert portable_name("decoder_with_past_model.onnx") in said
    with_past = onnx.load(str(out / portable_name("decoder_with_past_model.onnx")), load_external_data=False)
    assert [i.name for i in sess.get_inputs()] == [i.name for i in with_past.graph.input]


def _digests(path: Path) -> list[str]:
    """BLAKE2 of every payload in a safetensors blob (header entries, metadata left out)."""
    import hashlib

    start, header, _meta = read_safetensors_metadata(path)
    out = []
    with open(path, "rb") as f:
        for name, v in header.items():
            if name.startswith("__"):
                continue
            a, b = v["data_offsets"]
            f.seek(start + a)
            out.append(hashlib.blake2b(f.read(b - a)).hexdigest())
    return out


def test_blob_size_is_unique_plain_plus_unique_packed_bytes(family):
    """Computed from the tensors: every distinct source payload and every distinct packed copy is in the blob
    exactly once, and the blob is no more than 1.1x their bytes."""
    import hashlib

    from weightshare.options import INLINE_THRESHOLD

    src, _out, report = family
    plain: dict[str, int] = {}
    for name in NAMES:
        for t in onnx.load(str(src / name)).graph.initializer:
            data = onnx.numpy_helper.to_array(t).tobytes()
            if len(data) >= INLINE_THRESHOLD:  # smaller ones stay inside the model files
                plain[hashlib.blake2b(data).hexdigest()] = len(data)
    blob = Path(report["blob"])
    stored = _digests(blob)
    assert len(stored) == len(set(stored)), "a payload is stored twice"
    assert set(plain) <= set(stored), "a source payload is missing from the blob"
    start, header, _meta = read_safetensors_metadata(blob)
    packed = {}
    with open(blob, "rb") as f:
        for name, v in header.items():
            if "ort.prepacked/" in name:  # "<model>/ort.prepacked/..." in a zoo blob
                a, b = v["data_offsets"]
                f.seek(start + a)
                packed[hashlib.blake2b(f.read(b - a)).hexdigest()] = b - a
    assert packed, "the family's MatMul weights are pre-packed"
    unique = sum(plain.values()) + sum(packed.values())
    assert blob.stat().st_size <= 1.1 * unique, (blob.stat().st_size, sum(plain.values()), sum(packed.values()))


def test_verify_runs_each_model_against_its_own_portable_twin(family, tmp_path, cli):
    """Before: verify took the record's first portable model for every model of the zoo, so a correct zoo failed
    (the second model's original against the first model's twin) and a tampered twin of the second model went
    unseen. After: each model's own twin is run, and a twin replaced by another model's fails."""
    import shutil

    src, out, _ = family
    for name in NAMES:
        res = cli("verify", src / name, out / name, "--runs", "1")
        assert res.returncode == 0, (name, res.stdout, res.stderr)
        assert portable_name(name) in res.stdout + res.stderr or "portable" in (res.stdout + res.stderr), res.stdout
    tampered = tmp_path / "out"
    shutil.copytree(out, tampered)
    second = NAMES[1]
    shutil.copyfile(tampered / portable_name(NAMES[0]), tampered / portable_name(second))
    res = cli("verify", src / second, tampered / second, "--runs", "1")
    assert res.returncode != 0, res.stdout


def _own_packed_bytes(model_path: Path) -> int:
    """The bytes the model's own ``prepacked_N`` entries point at (each buffer once), read with onnx."""
    buffers = set()
    for t in external_tensors(onnx.load(str(model_path), load_external_data=False)):
        e = {x.key: x.value for x in t.external_data}
        for k, v in e.items():
            if k.startswith(PREPACKED_ENTRY):
                buffers |= {(e["location"], *map(int, b.split(";")[:2])) for b in v.split("|")[1:]}
    return sum(n for _loc, _off, n in buffers)


@pytest.mark.parametrize("name", NAMES)
def test_fallback_line_names_the_models_own_packed_bytes(family, name, monkeypatch, caplog):
    """Before: the zoo's packed copies are named "<model>/ort.prepacked/...", and the loader summed only names
    starting "ort.prepacked/": "+0.0 MiB per session" for a model whose twin pre-packs 1 MiB per session. After:
    the sum of the model's own entries."""
    _, out, _ = family
    expected = _own_packed_bytes(out / name)
    assert expected >= 2**19, expected  # both MatMul weights of the 1 MiB family, packed
    monkeypatch.setattr(wort, "_machine", {**wort.this_machine(), "onnxruntime": "1.99.0"})
    monkeypatch.setattr(wort, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="weightshare.ort"):
        wort.session(out / name)
    (said,) = [r.getMessage() for r in caplog.records if r.name == "weightshare.ort"]
    assert f"+{expected / 2**20:.1f} MiB per session" in said, said


@pytest.mark.parametrize("name", NAMES)
def test_inventory_envelope_names_the_models_own_packed_bytes(family, name):
    """The same figure in what check reports of the envelope (``packed_for``; before: "0" for every member)."""
    from weightshare.formats.onnx.inventory import inventory_file

    _, out, _ = family
    inv = inventory_file(out / name, hash_payloads=False)
    assert inv.packed_for["packed_bytes"] == str(_own_packed_bytes(out / name))


def _damage(model_path: Path, tensor: str, rewrite) -> None:
    """Rewrite the first buffer (offset, length) of ``tensor``'s prepacked_0 entry with ``rewrite``."""
    model = onnx.load(str(model_path), load_external_data=False)
    (t,) = [t for t in external_tensors(model) if t.name == tensor]
    entries = {x.key: x for x in t.external_data}
    plain = int(entries["offset"].value), int(entries["length"].value)
    key, first, *rest = entries[f"{PREPACKED_ENTRY}0"].value.split("|")
    offset, length, *more = first.split(";")
    offset, length = rewrite(int(offset), int(length), plain)
    entries[f"{PREPACKED_ENTRY}0"].value = "|".join([key, ";".join([str(offset), str(length), *more]), *rest])
    onnx.save(model, str(model_path))


DAMAGE = {
    "another weight's packed copy": lambda o, n, plain: (o + n, n),  # the next copy in the blob: layer0.down.w's
    "its plain payload": lambda o, n, plain: plain,
    "a range of another length": lambda o, n, plain: (o, n - 64),
    "past the blob's end": lambda o, n, plain: (o + 2**30, n),
}


def test_check_vouches_for_every_entry_of_the_undamaged_zoo(family, cli):
    """The rule that flags a damaged entry passes every entry of every model as written (no false alarm)."""
    from weightshare.formats.onnx.findings import OnnxCode

    _, out, _ = family
    res = cli("check", out, "--json")
    doc = json.loads(res.stdout)
    assert len(doc["reports"]) == 2 * len(NAMES), res.stdout + res.stderr
    assert OnnxCode.BAD_PREPACKED_ENTRY.value not in {f["code"] for f in doc["findings"]}, doc["findings"]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_check_flags_a_zoo_members_damaged_packed_entry(family, damage, tmp_path, cli):
    """Before: a blob with no name starting "ort.prepacked/" (a zoo's: "<model>/ort.prepacked/...") had its
    entries skipped, so a zoo member's wrong entry was never flagged statically. After: every entry into the
    blob must be one its records vouch for (the packing of that tensor's payload, under any model's name)."""
    import shutil

    from weightshare.formats.onnx.findings import OnnxCode

    _, out, _ = family
    code = OnnxCode.BAD_PREPACKED_ENTRY.value
    damaged = tmp_path / "out"
    shutil.copytree(out, damaged)
    target = damaged / "decoder_with_past_model.onnx"
    tensor = next(t for t, _key in _ranges(target)[1] if t.endswith("up.w"))
    _damage(target, tensor, DAMAGE[damage])
    res = cli("check", target, "--json")
    doc = json.loads(res.stdout)
    assert res.returncode == 1, res.stdout + res.stderr
    flagged = [f for f in doc["findings"] if f["code"] == code]
    assert len(flagged) == 1 and tensor in flagged[0]["message"], doc["findings"]


def test_the_loader_checks_a_zoo_blobs_reordered_conv_weights(tmp_path, monkeypatch, caplog):
    """Before: the loader hashed only names starting "ort.prepacked/" or "ort.optimized/", none of a zoo's
    ("<model>/ort.optimized/..."), and ORT never validates NCHWc-reordered Conv weights: a flipped byte in one
    changed the zoo model's outputs silently. After: it is found, and the model falls back to its portable twin,
    whose outputs are the original's."""
    from conftest import run_cli
    from prepack_samples import mixed_onnx, sample_input

    (tmp_path / "src").mkdir()
    src = [mixed_onnx(tmp_path / "src" / f"{n}.onnx", mm_layers=1, dim=64, seed=i) for i, n in enumerate("ab")]
    res = run_cli("convert", *src, "-o", tmp_path / "out", "--prepack", "--shared-blob", "zoo", "-q")
    assert res.returncode == 0, res.stderr
    (blob,) = (tmp_path / "out").glob("zoo*.safetensors")
    start, header, _meta = read_safetensors_metadata(blob)
    reordered = [v["data_offsets"][0] for n, v in header.items() if n.startswith("a/ort.optimized/")]
    assert reordered, list(header)
    with open(blob, "r+b") as f:
        f.seek(start + reordered[0] + 16)
        byte = f.read(1)
        f.seek(start + reordered[0] + 16)
        f.write(bytes([byte[0] ^ 0x40]))
    monkeypatch.setattr(wort, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="weightshare.ort"):
        sess = wort.session(tmp_path / "out" / "a.onnx")
    said = [r.getMessage() for r in caplog.records if r.name == "weightshare.ort"]
    assert said and "a/ort.optimized/" in said[0] and "digest" in said[0], said
    original = ort.InferenceSession(str(src[0]), providers=["CPUExecutionProvider"])
    for batch in (1, 4):
        feeds = sample_input(src[0], batch)
        assert all(np.array_equal(x, y) for x, y in zip(original.run(None, feeds), sess.run(None, feeds)))


def test_a_zoo_members_packed_copy_names_its_kernel_as_a_single_models_does(tmp_path):
    """The remainder's breakdown says which kernel made a packed copy from its name; in a --shared-blob zoo the
    name carries the model's stem first. A tensor merely named like one (no / before it) is not a packed copy."""
    from weightshare.formats.onnx.remainder import readers

    names = ["ort.prepacked/w/MatMul+3/0", "decoder_model/ort.prepacked/w/Gemm+1/0", "xort.prepacked/w/MatMul+1/0"]
    found = readers(_one_matmul(tmp_path, "xort.prepacked/w/MatMul+1/0"), names)
    assert found == {names[0]: ["MatMul"], names[1]: ["Gemm"], names[2]: ["MatMul"]}


def _one_matmul(tmp_path, weight: str):
    import onnx
    from onnx import TensorProto, helper

    w = helper.make_tensor(weight, TensorProto.FLOAT, [2, 2], [1.0, 2.0, 3.0, 4.0])
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", weight], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])],
        [w],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g), path)
    return path
