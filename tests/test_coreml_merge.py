"""`weightshare merge`: the multifunction model coremltools' save_multifunction would build, streamed.

Before: single-function packages at different input lengths (same weights, as when one model is exported per
sequence length), with different opsets and compressed weights, and a multifunction package from coremltools.
Under test: weightshare.api.merge.
After: the output has the same functions, descriptions, inputs, outputs and ops as save_multifunction's; every
weight decodes through coremltools' blob reader to its source's elements; shared weights are stored once.
"""

from __future__ import annotations

from pathlib import Path

import coreml_fixtures as F
import pytest

import weightshare.api as api
from weightshare.errors import UsageError
from weightshare.formats.coreml.milblob import WeightFile


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("coreml_merge_src")
    return {
        "s1": F.mlp(d / "s1.mlpackage", "iOS16", seq=1),
        "s15": F.mlp(d / "s15.mlpackage", "iOS15", seq=3),
        "s4": F.mlp(d / "s4.mlpackage", "iOS17", seq=4),
        "s8": F.mlp(d / "s8.mlpackage", "iOS18", seq=8),
        "other": F.mlp(d / "other.mlpackage", "iOS18", seed=7, seq=2),
        "lut4": F.compressed(d / "lut4.mlpackage", "lut4"),
        "lut2-16": F.compressed(d / "lut2-16.mlpackage", "lut2-16"),
        "int8-16": F.compressed(d / "int8-16.mlpackage", "int8-16"),
        "nested": F.nested(d / "nested.mlpackage"),
    }


def _used_names(block, used):
    used.update(block.outputs)
    for op in block.operations:
        for arg in op.inputs.values():
            used.update(b.name for b in arg.arguments if b.name)
        for inner in op.blocks:
            _used_names(inner, used)
    return used


def _ops(block, out, used):
    """(type, input names, output names) of every op, nested blocks included.

    Unused consts are left out: coremltools' load/export round trip adds dead scalar consts next to
    control-flow ops (const_0 = 0.0 before a cond), which the spec it merges from never had.
    """
    for op in block.operations:
        if op.type == "const" and op.outputs[0].name not in used:
            continue
        out.append((op.type, tuple(sorted(op.inputs)), tuple(o.name for o in op.outputs)))
        for b in op.blocks:
            _ops(b, out, used)
    return out


def _summary(pkg: Path) -> dict:
    spec = F.load_spec(pkg)
    desc = spec.description
    return {
        "version": spec.specificationVersion,
        "default": desc.defaultFunctionName,
        "descriptions": {f.name: f.SerializeToString(deterministic=True) for f in desc.functions},
        "functions": {
            name: (
                f.opset,
                [i.name for i in f.inputs],
                _ops(f.block_specializations[f.opset], [], _used_names(f.block_specializations[f.opset], set())),
                list(f.block_specializations[f.opset].outputs),
            )
            for name, f in spec.mlProgram.functions.items()
        },
    }


def _blob_map(pkg: Path) -> dict:
    """function name -> decoded elements of its BlobFileValues, in traversal order."""
    spec = F.load_spec(pkg)
    return {name: [F.decode_blob(pkg, v) for v in F.blob_values_of(f)] for name, f in spec.mlProgram.functions.items()}


def _weight_bin(pkg: Path) -> Path:
    return pkg / "Data/com.apple.CoreML/weights/weight.bin"


CASES = {
    "same-weights-3-lengths": (["s1", "s4", "s8"], ["f1", "f4", "f8"], "f4"),
    "different-weights": (["s1", "other"], ["a", "b"], None),
    "ios15-and-nested-ios17": (["s15", "nested"], ["old", "nest"], "nest"),
    "compressed-ios16-and-ios18": (["int8-16", "lut4"], ["q8", "p4"], None),
}


@pytest.mark.parametrize("case", CASES)
def test_merge_matches_save_multifunction(sources, case, tmp_path):
    import coremltools as ct

    keys, names, default = CASES[case]
    srcs = [sources[k] for k in keys]
    ref = F.multifunction(tmp_path / "ref.mlpackage", srcs, names, default)
    out = tmp_path / "ws.mlpackage"
    report = api.merge(srcs, out, names, default)
    assert report.outputs == [str(out)]

    ct.models.MLModel(str(out), skip_model_load=True)
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

    spec = F.load_spec(out)
    prog = milproto_load(spec, spec.specificationVersion, str(out / "Data/com.apple.CoreML/weights"))
    assert sorted(prog.functions) == sorted(names)

    assert _summary(out) == _summary(ref)
    ours, theirs = _blob_map(out), _blob_map(ref)
    for name, src in zip(names, srcs):
        assert ours[name] == _blob_map(src)["main"]
        assert ours[name] == theirs[name]
    assert WeightFile(_weight_bin(out)).count <= WeightFile(_weight_bin(ref)).count  # each payload once


def test_shared_weights_stored_once(sources, tmp_path):
    srcs = [sources["s1"], sources["s4"], sources["s8"]]
    report = api.merge(srcs, tmp_path / "m.mlpackage", ["f1", "f4", "f8"])
    single = api.convert(sources["s1"], tmp_path / "single")
    assert report.bytes_written == single.bytes_written
    assert report.deduplicated_bytes == 2 * single.bytes_written
    assert report.blob_bytes == single.blob_bytes
    offsets = {
        name: [v.offset for v in F.blob_values_of(f)]
        for name, f in F.load_spec(tmp_path / "m.mlpackage").mlProgram.functions.items()
    }
    assert offsets["f1"] == offsets["f4"] == offsets["f8"]


def test_multifunction_source_contributes_its_functions(sources, tmp_path):
    mf = F.multifunction(tmp_path / "mf.mlpackage", [sources["s1"], sources["s4"]], ["f1", "f4"])
    out = tmp_path / "m.mlpackage"
    api.merge([mf, sources["other"]], out, [], "other")  # default names: mf's own, then the package stem
    s = _summary(out)
    assert sorted(s["functions"]) == ["f1", "f4", "other"] and s["default"] == "other"
    ours = _blob_map(out)
    assert ours["f1"] == _blob_map(sources["s1"])["main"]
    assert ours["other"] == _blob_map(sources["other"])["main"]

    renamed = tmp_path / "r.mlpackage"
    api.merge([mf, sources["other"]], renamed, ["g1", "g4", "g_other"])
    assert sorted(_summary(renamed)["functions"]) == ["g1", "g4", "g_other"]
    assert _summary(renamed)["default"] == "g1"


def test_merge_is_deterministic(sources, tmp_path):
    for name in ["a", "b"]:
        api.merge([sources["s1"], sources["lut4"]], tmp_path / name / "m.mlpackage", ["x", "y"])
    for rel in ["Manifest.json", "Data/com.apple.CoreML/model.mlmodel", "Data/com.apple.CoreML/weights/weight.bin"]:
        assert (tmp_path / "a/m.mlpackage" / rel).read_bytes() == (tmp_path / "b/m.mlpackage" / rel).read_bytes()


@pytest.mark.parametrize(
    "names, default, message",
    [
        (["f", "f"], None, "duplicate function name 'f'"),
        (["f"], None, "1 function name(s) given for 2 function(s)"),
        (["f", "g"], "h", "default function 'h' is not one of the functions"),
        (["f", "not valid"], None, "is not an identifier"),
    ],
)
def test_bad_function_names_leave_no_output(sources, tmp_path, names, default, message):
    out_dir = tmp_path / "out"
    with pytest.raises(UsageError) as err:
        api.merge([sources["s1"], sources["s4"]], out_dir / "m.mlpackage", names, default)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not out_dir.exists()  # not even the directory the failed run would have created


def test_ios16_palettized_source_is_refused(sources, tmp_path):
    from weightshare.errors import Unsupported

    with pytest.raises(Unsupported, match="constexpr_lut_to_dense in its CoreML6 form"):
        api.merge([sources["s1"], sources["lut2-16"]], tmp_path / "m.mlpackage", ["a", "b"])
    assert list(tmp_path.iterdir()) == []


def test_convert_rewrites_every_function_of_a_multifunction_package(sources, tmp_path):
    mf = F.multifunction(tmp_path / "mf.mlpackage", [sources["s1"], sources["other"]], ["a", "b"])
    api.convert(mf, tmp_path / "out")
    out = tmp_path / "out" / mf.name
    assert _summary(out) == _summary(mf)
    assert _blob_map(out) == _blob_map(mf)
    assert all(v.fileName == "@model_path/weights/weight.bin" for v in F.blob_values(F.load_spec(out)))


_RSS_PROBE = """
import sys
from pathlib import Path
import weightshare.api as api
from weightshare.formats.coreml.package import spec_protos
spec_protos()
if sys.argv[1] != "-":
    srcs = sys.argv[2:]
    api.merge(srcs, sys.argv[1], [f"f{i}" for i in range(len(srcs))])
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the (large) pytest parent across fork and exec.
print(next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) / 1024)
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for VmHWM")
def test_peak_memory_does_not_grow_with_functions(tmp_path):
    """Memory stays flat: merge holds chunks, not payloads. 64 MiB of weights, merged 1x and 4x (four copies of
    the package, so each one is read and hashed): coremltools' way would add ~64 MiB per function."""
    import shutil
    import subprocess
    import sys

    import coremltools as ct
    from coremltools.converters.mil.mil import Builder as mb

    ws = [F.weights(60 + i, (2048, 2048)).astype("float16") for i in range(8)]  # 8 MiB each in fp16

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 2048))], opset_version=ct.target.iOS18)
    def prog(x):
        for w in ws:
            x = mb.linear(x=x, weight=w.astype("float32"))
        return mb.identity(x=x, name="out")

    src = F._save(prog, tmp_path / "big.mlpackage", ct.target.iOS18)
    copies = [src] + [shutil.copytree(src, tmp_path / f"big{i}.mlpackage") for i in range(1, 4)]

    def rss(out, sources):
        args = [sys.executable, "-c", _RSS_PROBE, str(out), *map(str, sources)]
        return float(subprocess.run(args, capture_output=True, text=True, check=True).stdout.split()[-1])

    base = rss("-", [])
    one = rss(tmp_path / "one.mlpackage", copies[:1])
    four = rss(tmp_path / "four.mlpackage", copies)
    assert (tmp_path / "four.mlpackage/Data/com.apple.CoreML/weights/weight.bin").stat().st_size < 70 << 20
    print(f"peak RSS MiB: import {base:.0f}, 1 function {one:.0f}, 4 functions {four:.0f}")
    assert one - base < 32, (base, one)  # less than half the weights
    assert four - one < 16, (one, four)  # flat: not one more copy per function


def test_opsets_compare_by_number_not_as_strings():
    """A CoreML10 function holding the iOS18 form of constexpr_lut_to_dense must not be treated as pre-iOS18
    (as strings, "CoreML10" < "CoreML8")."""
    from coremltools.proto import MIL_pb2

    from weightshare.formats.coreml.merge import opset_number, relabel_opset

    assert [opset_number(n, None) for n in ("CoreML5", "CoreML8", "CoreML10")] == [5, 8, 10]
    func = MIL_pb2.Function(opset="CoreML10")
    func.block_specializations["CoreML10"].operations.add(type="constexpr_lut_to_dense")
    relabel_opset(func, "CoreML11", None)  # no refusal: both are iOS18 or later
    assert func.opset == "CoreML11" and list(func.block_specializations) == ["CoreML11"]
    old = MIL_pb2.Function(opset="CoreML7")
    old.block_specializations["CoreML7"].operations.add(type="constexpr_lut_to_dense")
    with pytest.raises(Exception, match="cannot be merged"):
        relabel_opset(old, "CoreML8", type("P", (), {"model_path": Path("x")})())
