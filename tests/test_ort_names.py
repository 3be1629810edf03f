"""The rules keyed on names ONNX Runtime emits fail closed when an ORT release names things otherwise.

Before: fp16 models built here (an fp16 transformer whose attention scale ORT would fuse, an fp16
Conv+BatchNormalization chain), converted with ``--unpack ort-cpu``, whose rules read ORT's saved graphs.
Under test: ``ort/names.py``'s list of assumed names and its ``saved_hook``, the seam where every graph ORT saved
is read back: the tests rename there what ORT 1.32 emits (``InsertedPrecisionFreeCast_*`` Casts,
``FusedBack_*`` initializers, ``.../MatMulScaleFusion/...`` nodes), as a release that renamed them would.
After: a renamed inserted Cast refuses the conversion in one line, nothing written; the fusion rules, now
structural, decide as they do with ORT's own names (the Conv+BN model refused, the scale fusion repaired and
bit-exact).
"""

from __future__ import annotations

import os
from pathlib import Path

import model_forms as mf
import numpy as np
import onnx
import pytest
from onnx import numpy_helper as nh
from test_ort_cpu_rounding import _conv_bn_fp16, _outputs_equal

import weightshare
from weightshare.errors import Unsupported
from weightshare.formats.onnx.ort import names

pytestmark = pytest.mark.slow  # ORT children per conversion


def _renaming(match: str, new: str, nodes: bool = True, initializers: bool = False, entries: bool = False):
    """A ``saved_hook`` renaming every node (and/or initializer, with its readers; and/or external-data key)
    whose name contains ``match``."""
    seen: list[int] = []

    def hook(model) -> None:
        g = model.graph
        renamed: dict[str, str] = {}
        if entries:
            for t in g.initializer:
                for e in t.external_data:
                    if match in e.key:
                        renamed[e.key] = e.key = e.key.replace(match, new)
        if initializers:
            for t in g.initializer:
                if match in t.name:
                    renamed[t.name] = t.name.replace(match, new)
                    t.name = renamed[t.name]
            for n in g.node:
                n.input[:] = [renamed.get(i, i) for i in n.input]
        if nodes:
            for n in g.node:
                if match in n.name:
                    n.name = n.name.replace(match, new)
                    renamed[n.name] = n.name
        seen.append(len(renamed))

    hook.seen = seen  # type: ignore[attr-defined]
    return hook


def _nothing_written(out: Path) -> bool:
    return not out.exists() or not any(out.iterdir())


def test_names_are_listed_with_the_version_checked():
    import onnxruntime

    assert names.CHECKED_ON == "1.32.0"
    assert names.INSERTED_CAST == "InsertedPrecisionFreeCast_" and names.FUSED_BACK == "FusedBack_"
    assert onnxruntime.__version__ == names.CHECKED_ON  # the suite runs the release the names were read from


def test_inserted_casts_named_otherwise_refuse_the_conversion(tmp_path, monkeypatch):
    src = mf.fp16_transformer(tmp_path / "src" / "model.onnx", mib=1)
    weightshare.convert(src, tmp_path / "as_is", unpack=["ort-cpu"])  # with ORT's own names: converted
    hook = _renaming(names.INSERTED_CAST, "PrecisionCast_")
    monkeypatch.setattr(names, "saved_hook", hook)
    with pytest.raises(Unsupported) as e:
        weightshare.convert(src, tmp_path / "out", unpack=["ort-cpu"])
    assert hook.seen and hook.seen[0] > 0  # the probe's Casts were renamed
    line = e.value.line()
    assert "\n" not in line and "PrecisionCast_" in line and names.CHECKED_ON in line
    assert _nothing_written(tmp_path / "out")


def test_inserted_casts_named_otherwise_are_a_note_in_inspect(tmp_path, monkeypatch):
    from weightshare._dispatch import inventory

    src = mf.fp16_transformer(tmp_path / "src" / "model.onnx", mib=1)
    monkeypatch.setattr(names, "saved_hook", _renaming(names.INSERTED_CAST, "PrecisionCast_"))
    inv = inventory(src, hash_payloads=False)
    assert any("PrecisionCast_" in n for n in inv.notes), inv.notes


def test_fp16_constants_of_a_fusion_refused_under_any_name(tmp_path, monkeypatch):
    """Conv+BatchNormalization folded in fp16: refused whether ORT names the folded constants FusedBack_* or not
    (renamed, neither the fusion's constants nor the harmless folded Casts can be told apart: all refuse)."""
    src = _conv_bn_fp16(tmp_path / "src" / "m.onnx")
    hook = _renaming(names.FUSED_BACK, "Folded_", nodes=False, initializers=True)
    monkeypatch.setattr(names, "saved_hook", hook)
    with pytest.raises(Unsupported) as e:
        weightshare.convert(src, tmp_path / "out", unpack=["ort-cpu"])
    assert any(hook.seen)  # ORT's FusedBack_ initializers were renamed before the rule read them
    line = str(e.value)  # the first tensor ORT computed under a name it does not know: refused, not guessed
    assert "\n" not in line and "--unpack ort-cpu: refused" in line and "'Folded_" in line and "does not know" in line
    assert _nothing_written(tmp_path / "out")


def test_folded_casts_named_otherwise_refuse_a_model_that_converts(tmp_path, monkeypatch):
    """The fp16 transformer converts with ORT's own names; with ``FusedBack_`` renamed, its folded Casts are
    tensors ORT computed under names weightshare does not know: refused, nothing written."""
    src = mf.fp16_transformer(tmp_path / "src" / "model.onnx", mib=1)
    weightshare.convert(src, tmp_path / "as_is", unpack=["ort-cpu"])
    hook = _renaming(names.FUSED_BACK, "Folded_", nodes=False, initializers=True)
    monkeypatch.setattr(names, "saved_hook", hook)
    with pytest.raises(Unsupported) as e:
        weightshare.convert(src, tmp_path / "out", unpack=["ort-cpu"])
    assert any(hook.seen)
    assert "\n" not in str(e.value) and "'Folded_" in str(e.value)
    assert _nothing_written(tmp_path / "out")


def test_scale_fusion_under_another_name_is_still_repaired(tmp_path, monkeypatch, cli):
    """x / 7 fused by ORT into FusedMatMul(alpha=1/7) once the Casts are in the file: the repair (``unfuse``)
    is chosen by what the fusion made, not by ORT's node name, so a renamed fusion is repaired alike."""
    src = mf.build("fp16", tmp_path / "src" / "model.onnx", mib=2)
    model = onnx.load(str(src))
    for t in model.graph.initializer:
        if t.name == "scale":
            t.CopyFrom(nh.from_array(np.array(7.0, np.float16), "scale"))
    onnx.save(model, str(src))
    hook = _renaming("MatMulScaleFusion", "ScaleIntoMatMul")
    monkeypatch.setattr(names, "saved_hook", hook)
    report = weightshare.convert(src, tmp_path / "out", unpack=["ort-cpu"])
    assert any(hook.seen)  # the fusion's nodes were renamed in the check's graphs
    assert any("Expand(scalar, Shape(x))" in n for n in report.notes), report.notes
    _outputs_equal(src, tmp_path / "out" / "model.onnx")


def _fp16_chain(path: Path, n: int = 64) -> Path:
    """MatMul + Sin, 4 times, in fp16: ORT's CPU provider runs it in fp32 between an inserted Cast at each end."""
    from onnx import TensorProto as T
    from onnx import helper as h

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(4):
        inits.append(nh.from_array((rng.standard_normal((n, n)) / 8).astype(np.float16), f"w{i}"))
        nodes += [h.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), h.make_node("Sin", [f"m{i}"], [f"r{i}"])]
        x = f"r{i}"
    io = [h.make_tensor_value_info("x", T.FLOAT16, ["N", n]), h.make_tensor_value_info(x, T.FLOAT16, ["N", n])]
    model = h.make_model(h.make_graph(nodes, "g", io[:1], io[1:], inits), opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    return path


def test_a_cut_through_renamed_inserted_casts_is_not_made(tmp_path, monkeypatch):
    """``--prepack``'s segments: a cut inside an fp32 run is exact only once the inserted Cast pair at it is
    spliced (``segments._splice_casts``, keyed on ORT's name). Renamed, the pair is not spliced, the pair check
    (node-for-node fingerprints against the two segments optimized together) fails every such cut, and the graph
    is optimized in one piece: the same graph as ORT's whole-graph optimization, never another."""
    from weightshare.formats.onnx.ort import segments as segs
    from weightshare.formats.onnx.ort.child import optimize as ort_optimize

    src = _fp16_chain(tmp_path / "src" / "m.onnx")
    optimize = lambda a, b, c: ort_optimize(a, b, c, "1024")  # noqa: E731

    def level_all(out: Path, budget: int) -> dict:
        out.parent.mkdir(parents=True)
        return segs.Segmenter(str(src), str(out), optimize, budget).run().as_dict()

    def fingerprint(out: Path):
        return segs.fingerprint(onnx.load(str(out), load_external_data=False), out.parent)

    assert level_all(tmp_path / "named" / "ort.onnx", 9000)["segments"] > 2  # with ORT's names: cut, spliced
    hook = _renaming(names.INSERTED_CAST, "PrecisionCast_")
    monkeypatch.setattr(names, "saved_hook", hook)
    renamed = level_all(tmp_path / "renamed" / "ort.onnx", 9000)
    assert any(hook.seen) and renamed["segments"] == 1 and renamed["unsafe_cuts"] >= 1, renamed
    monkeypatch.setattr(names, "saved_hook", None)
    level_all(tmp_path / "whole" / "ort.onnx", 1 << 40)
    assert fingerprint(tmp_path / "renamed" / "ort.onnx") == fingerprint(tmp_path / "whole" / "ort.onnx")


# Started with every Python process of the conversion, --prepack's optimizer child included, where ORT's packed
# copies are read: their prepacked_N entries get another key, as an ORT release that renamed them would write.
_RENAME_ENTRIES = """
import os
if os.environ.get("RENAME_PREPACKED"):
    from weightshare.formats.onnx.ort import names

    def hook(model):
        for t in model.graph.initializer:
            for e in t.external_data:
                if e.key.startswith(names.PREPACKED_ENTRY):
                    e.key = "packed_copy_" + e.key[len(names.PREPACKED_ENTRY):]

    names.saved_hook = hook
"""


def test_packed_entries_under_another_key_refuse_prepack(tmp_path, monkeypatch):
    """ORT 1.32 records each packed copy as a ``prepacked_N`` external-data entry; under another key the child
    would find nothing packed and the model would pack per session again: refused in one line, nothing written."""
    src = mf.build("fp32", tmp_path / "src" / "model.onnx", mib=1)
    weightshare.convert(src, tmp_path / "as_is", prepack=True)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_RENAME_ENTRIES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RENAME_PREPACKED", "1")
    with pytest.raises(Unsupported) as e:
        weightshare.convert(src, tmp_path / "out", prepack=True)
    line = e.value.line()
    assert "\n" not in line and "'packed_copy_0'" in line and names.CHECKED_ON in line, line
    assert _nothing_written(tmp_path / "out")
