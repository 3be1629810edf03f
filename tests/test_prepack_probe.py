"""The cut checks' cost: a failing cut is answered by sessions that save no weights (``Segmenter.probe``), before its
segments' own sessions run; the child takes the parent's digests of the staged payloads instead of hashing them
again (``child.Target.digests``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from weightshare._checksum import new_hasher
from weightshare._placement import AlignPolicy
from weightshare.formats.onnx.ort import segments as segs
from weightshare.formats.onnx.ort.child import optimize as ort_optimize


def _mlp(path: Path, dims: tuple[int, ...] = (4, 64, 4, 64, 4)) -> Path:
    """MatMul, Add (bias), Relu per layer on a 2-D input: ORT fuses each MatMul with its Add into a Gemm, which a
    cut between the two prevents. Widths alternate so that a bias is a weight to the plan (at the budget below, a
    cut goes before it) and the layers' windows are alike."""
    rng = np.random.default_rng(0)
    nodes, inits, cur = [], [], "x"
    for i, (k, n) in enumerate(zip(dims, dims[1:])):
        inits += [
            nh.from_array(rng.standard_normal((k, n)).astype(np.float32), f"w{i}"),
            nh.from_array(rng.standard_normal(n).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            h.make_node("MatMul", [cur, f"w{i}"], [f"m{i}"]),
            h.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            h.make_node("Relu", [f"a{i}"], [f"r{i}"]),
        ]
        cur = f"r{i}"
    graph = h.make_graph(
        nodes,
        "mlp",
        [h.make_tensor_value_info("x", T.FLOAT, ["n", dims[0]])],
        [h.make_tensor_value_info(cur, T.FLOAT, ["n", dims[-1]])],
        inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    return path


def _optimized(src: Path, out: Path, budget: int) -> tuple[dict, list[tuple[str, str]]]:
    """``Segmenter.run`` as the child drives it (the output beside the model, a referencing session for the
    checks); (its report, (route, model) of every session)."""
    sessions: list[tuple[str, str]] = []

    def by_file(model: str, opt: str, bin_name: str) -> None:
        sessions.append(("file", Path(model).name))
        ort_optimize(model, opt, bin_name, "1024")

    def referenced(model: str, opt: str, bin_name: str) -> None:
        sessions.append(("referenced", Path(model).name))
        ort_optimize(model, opt, bin_name, "1024", referenced=True)

    seg = segs.Segmenter(str(src), str(out), by_file, 1152, optimize_referenced=referenced)
    return seg.run().as_dict(), sessions


def test_a_failing_cut_runs_no_session_that_saves_its_segments(tmp_path):
    """The plan cuts before two biases (nodes 1 and 7): ORT's Gemm fusion goes across each, the check drops them.
    Their segments' own sessions (each writes the segment's weights, and a segment's packed copies) never run: the
    probe's sessions, which save none, answered. The cuts that hold are checked on the segments' own sessions, and
    the stitch is node for node ORT's optimization of the whole graph."""
    src = _mlp(tmp_path / "mlp.onnx")
    report, sessions = _optimized(src, tmp_path / "ort.onnx", 1152)
    assert report["unsafe_cuts"] == 2 and report["segments"] == 4, report
    assert sorted(report["dropped_cuts"]) == ["node 1 (Add)", "node 7 (Add)"]
    by_file = {name for route, name in sessions if route == "file"}
    assert not by_file & {"ort.seg0-1.in.onnx", "ort.seg1-3.in.onnx", "ort.seg7-9.in.onnx"}, by_file
    assert {"ort.seg0-3.in.onnx", "ort.seg3-6.in.onnx", "ort.seg6-9.in.onnx", "ort.seg9-12.in.onnx"} <= by_file
    (tmp_path / "whole").mkdir()
    ort_optimize(str(src), str(tmp_path / "whole" / "ort.onnx"), "ort.bin", "1024")

    def fingerprint(path: Path) -> tuple:
        return segs.fingerprint(onnx.load(str(path), load_external_data=False), path.parent)

    assert fingerprint(tmp_path / "ort.onnx") == fingerprint(tmp_path / "whole" / "ort.onnx")


def test_a_cut_moved_within_one_window_is_probed_against_one_window_session(tmp_path):
    """A graph's one cut: its window is the whole graph, the same whatever place the cut moves to (a decoder whose
    cut fails at each of its places). ORT optimizes that window once."""
    src = _mlp(tmp_path / "mlp.onnx", dims=(4, 64, 4))
    seg = segs.Segmenter(str(src), str(tmp_path / "ort.onnx"), lambda a, b, c: None, 1152)
    sessions: list[str] = []

    def referenced(model: str, opt: str, bin_name: str) -> None:
        sessions.append(Path(model).name)
        ort_optimize(model, opt, bin_name, "1024", referenced=True)

    seg.optimize_referenced = referenced
    bounds = [0, 1, len(seg.model.graph.node)]  # between the first MatMul and its bias: fails
    for cut in (1, 2, 3):  # before the bias, before the Relu (Gemm fuses it too): fail; before the next MatMul
        bounds[1] = cut
        probed = seg.probe(bounds, 0)
        assert probed is not None and probed[1] == (cut == 3)
    assert sessions.count(f"ort.win0-{bounds[2]}.in.onnx") == 1, sessions


def test_the_parents_digests_are_the_childs(tmp_path, monkeypatch):
    """The staged blob's digests the parent hands the child are those the child would make of the same bytes
    (``segments._digest_payload``, the packing keys): the same key for the same bytes, with or without them."""
    from weightshare.formats.onnx.ort import child, prepack

    src = _mlp(tmp_path / "mlp.onnx")
    stage = tmp_path / "stage"
    stage.mkdir()
    from weightshare.options import ConvertOptions

    _report, _meta, staged = prepack._stage_portable(src, stage, ConvertOptions())
    try:
        digests = staged.digests()
        assert len(digests) == 4  # the weights (the biases are small enough to stay inline)
        for offset, length, hex_ in digests:
            assert isinstance(offset, int) and isinstance(length, int)
            with open(staged.path, "rb") as f:
                f.seek(offset)
                hasher = new_hasher()
                hasher.update(f.read(length))
            assert hasher.hexdigest() == hex_
    finally:
        staged.close()
    # as the child reads them from its request: a malformed entry is left out, not trusted
    doc = {"blob": prepack.STAGE_FILE, "align": AlignPolicy().render(), "digests": [*digests, ["x"], 7, ["1", 2, "ab"]]}
    monkeypatch.setenv(prepack.TARGET_ENV, json.dumps(doc))
    target = child.Target.from_env(str(stage))
    assert target is not None and [list(d) for d in target.digests] == digests


def test_a_cut_does_not_move_across_a_constant_alone():
    """Before the bias Add's Constant and after it: the same segments (each holds its own copy of a constant it
    reads), so a failing cut moves to one of the two places, not both (BART's decoder tried both)."""
    rng = np.random.default_rng(0)
    nodes = [
        h.make_node("MatMul", ["x", "w0"], ["m0"]),
        h.make_node("Constant", [], ["c"], value=nh.from_array(np.ones(64, np.float32), "c")),
        h.make_node("Add", ["m0", "c"], ["a0"]),
        h.make_node("MatMul", ["a0", "w1"], ["y"]),
    ]
    shapes = {"w0": (4, 64), "w1": (64, 4)}
    weights = [nh.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in shapes.items()]
    graph = h.make_graph(
        nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["n", 4])], [h.make_tensor_value_info("y", T.FLOAT, None)],
        weights,
    )  # fmt: skip
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    p = segs.plan(model.graph, 1100, segs.tensor_types(model))
    assert p.bounds == [0, 3, 4] and p.alternatives == {3: [2]}, (p.bounds, p.alternatives)


def _scaled_embedding(path: Path) -> Path:
    """An optimum decoder's prologue: token embedding (``Gather``), ``Mul`` by its scale of 1 (Marian's
    ``scale_embedding: false``), then the first projection. ORT drops the ``Mul`` in the whole graph and keeps it
    where its output is a segment's: a cut before the projection fails."""
    rng = np.random.default_rng(0)
    inits = [
        nh.from_array(rng.standard_normal((16, 64)).astype(np.float32), "table"),
        nh.from_array(np.array(1.0, np.float32), "scale"),
        nh.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w"),
    ]
    nodes = [
        h.make_node("Gather", ["table", "ids"], ["e"]),
        h.make_node("Mul", ["e", "scale"], ["s"]),
        h.make_node("MatMul", ["s", "w"], ["y"]),
    ]
    graph = h.make_graph(
        nodes, "g", [h.make_tensor_value_info("ids", T.INT64, ["n"])],
        [h.make_tensor_value_info("y", T.FLOAT, ["n", 64])], inits,
    )  # fmt: skip
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    return path


@pytest.mark.parametrize(
    ("form", "cuts"),
    [("embedding", {2: False}), ("mlp", {1: False, 2: False, 3: True})],
)
def test_a_failing_cut_is_answered_before_the_segment_after_it_is_optimized(tmp_path, form, cuts):
    """Where the segment before a cut makes a node the window does not have (the embedding's ``Mul`` by 1, a Gemm's
    MatMul without its bias), the pair check must fail: the segment after the cut (a decoder's: ~80% of its
    weights) is not optimized for it. A cut that holds is checked on both segments, as before."""
    src = _scaled_embedding(tmp_path / "emb.onnx") if form == "embedding" else _mlp(tmp_path / "mlp.onnx", (4, 64, 4))
    seg = segs.Segmenter(str(src), str(tmp_path / "ort.onnx"), lambda a, b, c: None, 1 << 30)
    sessions: list[str] = []

    def referenced(model: str, opt: str, bin_name: str) -> None:
        sessions.append(Path(model).name)
        ort_optimize(model, opt, bin_name, "1024", referenced=True)

    seg.optimize_referenced = referenced
    end = len(seg.model.graph.node)
    for cut, holds in cuts.items():
        probed = seg.probe([0, cut, end], 0)
        assert probed is not None and probed[1] == holds, cut
        assert f"ort.probe0-{cut}.in.onnx" in sessions
        assert (f"ort.probe{cut}-{end}.in.onnx" in sessions) == holds, (cut, sessions)


def test_a_digest_of_a_file_the_cut_checks_rewrite_is_never_kept(tmp_path):
    """The cut checks' files (windows, segments, the probes of a failing cut) are rewritten under the same name with
    other bytes: a digest kept from the first would make the second window's weights look like the first's. The
    staged model's blob is written once: its digests are kept."""
    import onnx

    from weightshare.formats.onnx.ort import segments as segs

    def weight(location: str) -> onnx.TensorProto:
        t = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[4])
        t.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", "0"), ("length", "16")):
            t.external_data.add(key=k, value=v)
        return t

    segs._digests.clear()
    for name, kept in (("m.probe3-7.bin", False), ("m.win3-9.bin", False), ("m.seg3-7.bin", False), ("m.bin", True)):
        (tmp_path / name).write_bytes(bytes(16))
        first = segs._digest_payload(weight(name), tmp_path)
        (tmp_path / name).write_bytes(bytes(range(16)))  # the same size, other bytes
        assert (segs._digest_payload(weight(name), tmp_path) == first) is kept, name
    segs._digests.clear()
