"""Hostile or broken .mlpackage inputs: one line naming the file and the problem, exit code 2, nothing left behind.

Before: a valid package built by coremltools, then damaged in one way per case.
Under test: weightshare.api.convert / merge, and the CLI for a representative subset.
After: a WeightshareError whose message is one line with the file path; the output directory holds nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import coreml_fixtures as F
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import weightshare.api as api
from weightshare.errors import InvalidModel, UnsafePath, Unsupported

MODEL = "Data/com.apple.CoreML/model.mlmodel"
WEIGHTS = "Data/com.apple.CoreML/weights/weight.bin"


@pytest.fixture(scope="session")
def good(tmp_path_factory) -> Path:
    return F.mlp(tmp_path_factory.mktemp("coreml_good") / "good.mlpackage", "iOS16", hidden=256)


def _edit_spec(pkg: Path, edit) -> None:
    spec = F.load_spec(pkg)
    edit(spec)
    (pkg / MODEL).write_bytes(spec.SerializeToString())


def _first_blob(spec):
    return F.blob_values(spec)[0]


def _patch(pkg: Path, rel: str, offset: int, data: bytes) -> None:
    with open(pkg / rel, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _set_offset(value):
    def edit(spec):
        _first_blob(spec).offset = value

    return edit


def _set_file(name):
    def edit(spec):
        _first_blob(spec).fileName = name

    return edit


def _outside_symlink(pkg: Path) -> None:
    target = pkg.parent / "secret.bin"
    shutil.copyfile(pkg / WEIGHTS, target)
    (pkg / WEIGHTS).unlink()
    os.symlink(target, pkg / WEIGHTS)


def _neural_network(pkg: Path) -> None:
    from coremltools.proto import Model_pb2

    spec = Model_pb2.Model(specificationVersion=4)
    spec.neuralNetwork.SetInParent()
    (pkg / MODEL).write_bytes(spec.SerializeToString())


CASES = {
    "missing manifest": (lambda p: (p / "Manifest.json").unlink(), InvalidModel, "no Manifest.json"),
    "manifest not json": (lambda p: (p / "Manifest.json").write_text("{not json"), InvalidModel, "not valid JSON"),
    "manifest no root": (
        lambda p: (p / "Manifest.json").write_text(json.dumps({"itemInfoEntries": {"a": {"path": "x"}}})),
        InvalidModel,
        "rootModelIdentifier",
    ),
    "manifest path escapes": (
        lambda p: (p / "Manifest.json").write_text(
            json.dumps({"itemInfoEntries": {"a": {"path": "../../etc/passwd"}}, "rootModelIdentifier": "a"})
        ),
        UnsafePath,
        "'..'",
    ),
    "spec not protobuf": (lambda p: (p / MODEL).write_bytes(b"\xff" * 64), InvalidModel, "not a valid Core ML"),
    "neural network": (_neural_network, Unsupported, "not an ML Program"),
    "bad sentinel": (lambda p: _patch(p, WEIGHTS, 64, b"\0\0\0\0"), InvalidModel, "bad sentinel"),
    "bad version": (lambda p: _patch(p, WEIGHTS, 4, struct.pack("<I", 1)), InvalidModel, "storage version 1"),
    "truncated header": (lambda p: os.truncate(p / WEIGHTS, 10), InvalidModel, "shorter"),
    "offset past end": (
        lambda p: _edit_spec(p, _set_offset(1 << 40)),
        InvalidModel,
        "not a record offset in the weight file",
    ),
    "data past end": (
        lambda p: _patch(p, WEIGHTS, 64 + 8, struct.pack("<Q", 1 << 40)),
        InvalidModel,
        "runs past the end",
    ),
    "sub-byte padding": (
        lambda p: (
            _patch(p, WEIGHTS, 64 + 4, struct.pack("<I", 12)),
            _patch(p, WEIGHTS, 64 + 24, struct.pack("<Q", 9)),
        ),
        InvalidModel,
        "padding bits",
    ),
    "blob file outside": (lambda p: _edit_spec(p, _set_file("@model_path/../../../../etc/passwd")), UnsafePath, "'..'"),
    "blob file absolute": (lambda p: _edit_spec(p, _set_file("/etc/passwd")), UnsafePath, "@model_path/"),
    "blob file symlink out": (_outside_symlink, UnsafePath, "symlink"),
    "blob file missing": (
        lambda p: _edit_spec(p, _set_file("@model_path/weights/nope.bin")),
        InvalidModel,
        "does not exist",
    ),
}


def _damaged(good: Path, tmp_path: Path, case: str) -> Path:
    src = tmp_path / "src" / "model.mlpackage"
    shutil.copytree(good, src)
    CASES[case][0](src)
    return src


def _nothing_left(out_dir: Path) -> None:
    assert not out_dir.exists() or list(out_dir.iterdir()) == []


@pytest.mark.parametrize("case", CASES)
def test_convert_bad_input(good, tmp_path, case):
    _, kind, message = CASES[case]
    src = _damaged(good, tmp_path, case)
    out_dir = tmp_path / "out"
    with pytest.raises(kind) as err:
        api.convert(src, out_dir)
    line = str(err.value)
    assert message in line and "\n" not in line
    assert str(src) in line  # names the file (the package or a file inside it)
    _nothing_left(out_dir)


@pytest.mark.parametrize("case", ["bad sentinel", "offset past end", "blob file outside"])
def test_merge_bad_input(good, tmp_path, case):
    _, kind, message = CASES[case]
    src = _damaged(good, tmp_path, case)
    with pytest.raises(kind, match=message):
        api.merge([good, src], tmp_path / "out" / "m.mlpackage", ["a", "b"])
    _nothing_left(tmp_path / "out")


def test_inputs_are_never_touched(good, tmp_path):
    before = {p: p.read_bytes() for p in good.rglob("*") if p.is_file()}
    api.convert(good, tmp_path / "out")
    api.merge([good], tmp_path / "m" / "m.mlpackage", ["main_fn"])
    assert {p: p.read_bytes() for p in good.rglob("*") if p.is_file()} == before


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    manifest=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(
                st.sampled_from(["itemInfoEntries", "rootModelIdentifier", "path", "a", "../x"]), inner, max_size=4
            )
        ),
        max_leaves=12,
    )
)
@pytest.mark.slow
def test_any_manifest_gives_a_clear_error(good, tmp_path_factory, manifest):
    """Arbitrary JSON in Manifest.json: a WeightshareError (or, by chance, a valid package); never a crash."""
    from weightshare.errors import WeightshareError
    from weightshare.formats.coreml.package import read_package

    src = tmp_path_factory.mktemp("fuzz") / "model.mlpackage"
    shutil.copytree(good, src)
    (src / "Manifest.json").write_text(json.dumps(manifest))
    try:
        read_package(src)
    except WeightshareError as e:
        assert "\n" not in str(e) and str(src) in str(e)


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "weightshare", *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", ["manifest not json", "bad sentinel", "blob file outside"])
def test_cli_convert_bad_input_exit_2(good, tmp_path, case):
    src = _damaged(good, tmp_path, case)
    result = _cli("convert", src, "-o", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and CASES[case][2] in lines[0] and str(src) in lines[0]
    assert "Traceback" not in result.stderr
    _nothing_left(tmp_path / "out")


@pytest.mark.slow
def test_cli_merge_duplicate_function_names_exit_2(good, tmp_path):
    result = _cli(
        "merge", good, good, "--function-name", "f", "--function-name", "f", "-o", tmp_path / "o" / "m.mlpackage"
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "duplicate function name 'f'" in lines[0] and str(good) in lines[0]
    _nothing_left(tmp_path / "o")


@pytest.mark.slow
def test_cli_merge_json_report(good, tmp_path):
    out = tmp_path / "m.mlpackage"
    copy = tmp_path / "copy.mlpackage"
    shutil.copytree(good, copy)
    result = _cli("merge", good, copy, "--function-name", "a", "--function-name", "b", "-o", out, "--json")
    assert result.returncode == 0, result.stderr
    (report,) = json.loads(result.stdout)["reports"]
    assert report["deduplicated_bytes"] == report["bytes_written"] > 0
    assert out.is_dir()


def _symlinked_weights_dir(pkg: Path) -> None:
    outside = pkg.parent / "outside_weights"
    shutil.move(pkg / "Data/com.apple.CoreML/weights", outside)
    os.symlink(outside, pkg / "Data/com.apple.CoreML/weights", target_is_directory=True)


def _symlinked_spec(pkg: Path) -> None:
    outside = pkg.parent / "outside.mlmodel"
    shutil.move(pkg / MODEL, outside)
    os.symlink(outside, pkg / MODEL)


def _manifest_item(path: str):
    def edit(pkg: Path) -> None:
        manifest = json.loads((pkg / "Manifest.json").read_text())
        manifest["itemInfoEntries"][manifest["rootModelIdentifier"]]["path"] = path
        (pkg / "Manifest.json").write_text(json.dumps(manifest))

    return edit


# Every form a BlobFileValue name (or a manifest item path) can take to leave the package; each refused as
# UnsafePath before the target is read.
ESCAPES = {
    "absolute after prefix": (_set_file("@model_path//etc/passwd"), "absolute"),
    "dotdot after a directory": (_set_file("@model_path/weights/../../../../etc/passwd"), "'..'"),
    "windows drive": (_set_file("@model_path/C:\\Windows\\weight.bin"), "absolute"),
    "windows unc": (_set_file("@model_path/\\\\server\\share\\weight.bin"), "absolute"),
    "nul byte": (_set_file("@model_path/weights/weight.bin\x00.txt"), "invalid path"),
    "no prefix, relative": (_set_file("../weights/weight.bin"), "@model_path/"),
}
ESCAPES_ON_DISK = {
    "weights dir symlinked out": (_symlinked_weights_dir, "symlink"),
    "spec symlinked out": (_symlinked_spec, "symlink"),
    "manifest item absolute": (_manifest_item("/etc/passwd"), "absolute"),
    "manifest item dotdot": (_manifest_item("com.apple.CoreML/../../../model.mlmodel"), "'..'"),
}


@pytest.mark.parametrize("case", list(ESCAPES) + list(ESCAPES_ON_DISK))
def test_path_escapes_are_refused(good, tmp_path, case):
    src = tmp_path / "src" / "model.mlpackage"
    shutil.copytree(good, src)
    if case in ESCAPES:
        _edit_spec(src, ESCAPES[case][0])
        message = ESCAPES[case][1]
    else:
        ESCAPES_ON_DISK[case][0](src)
        message = ESCAPES_ON_DISK[case][1]
    with pytest.raises(UnsafePath) as err:
        api.convert(src, tmp_path / "out")
    assert message in str(err.value) and "\n" not in str(err.value) and str(src) in str(err.value)
    _nothing_left(tmp_path / "out")
    if case in ESCAPES:  # inspect/check report the same escape as a finding instead of stopping
        from weightshare._dispatch import inventory

        assert any(message in p.problem for p in inventory(src).payloads)


def test_root_model_item_named_like_the_weights_keeps_its_path(good, tmp_path):
    """Found by the fuzz harness's re-read check: a manifest whose root model item is *named* "weights" made the
    converter take it for the weights item and point the root at the weights directory (exit 0, broken output)."""
    from weightshare._dispatch import inventory

    pkg = tmp_path / "c.mlpackage"
    shutil.copytree(good, pkg)
    manifest = json.loads((pkg / "Manifest.json").read_text())
    items, root_id = manifest["itemInfoEntries"], manifest["rootModelIdentifier"]
    items[root_id]["name"] = "weights"
    manifest["itemInfoEntries"] = {root_id: items[root_id], **items}  # listed first, as in the fuzzed input
    (pkg / "Manifest.json").write_text(json.dumps(manifest))
    report = api.convert(pkg, tmp_path / "out")
    out = json.loads((tmp_path / "out" / "c.mlpackage" / "Manifest.json").read_text())
    root = out["itemInfoEntries"][out["rootModelIdentifier"]]
    assert root["path"] == manifest["itemInfoEntries"][manifest["rootModelIdentifier"]]["path"]
    inv = inventory(report.outputs[0])  # the output re-reads, every payload where the model says
    assert inv.payloads and not [p.problem for p in inv.payloads if p.problem]
