"""--prepack at bounded cost: staged bytes given back as the blob takes them (disk_use), ORT's optimization
cut at transformer layer boundaries (several crossing tensors, mask and rotary tensors computed again per
segment, a failed cut moved earlier: DynamicQuantizeLinear stays with its MatMulInteger), each segment packed
by the session that optimizes it. What is asserted is exact: bit-identical outputs at default options, the
packed entries and optimized graph of ORT's own whole-model session, the report's file sizes, nothing left
in OUTDIR."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import model_forms as mf
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from weightshare._disk import allocated_bytes
from weightshare.formats.onnx.disk_use import ReleasedRange, mark_overlaps, punch
from weightshare.formats.onnx.graph import external_tensors
from weightshare.formats.onnx.ort import segments as segs
from weightshare.formats.onnx.ort.prepack import PREPACKED_ENTRY
from weightshare.formats.onnx.ort.types import all_nodes

BUDGET = {segs.BUDGET_ENV: "65536"}


def _holes_supported(path: Path) -> bool:
    path.write_bytes(b"\1" * 3 * 4096)
    return punch(str(path), 4096, 4096) and os.stat(path).st_blocks * 512 < 3 * 4096


def test_punch_frees_whole_blocks_inside_the_range_and_keeps_every_other_byte(tmp_path):
    f = tmp_path / "staged.bin"
    if not _holes_supported(tmp_path / "probe.bin"):
        pytest.skip("this file system keeps punched blocks (the staging then keeps them until it goes)")
    data = bytes(range(256)) * (16 * 4096 // 256)
    f.write_bytes(data)
    before = allocated_bytes(str(tmp_path))
    # a range from mid-block 1 to mid-block 9: blocks 2..8 go, the partial blocks at its ends stay
    assert punch(str(f), 4096 + 100, 8 * 4096)
    after = f.read_bytes()
    assert len(after) == len(data)
    assert after[: 2 * 4096] == data[: 2 * 4096] and after[9 * 4096 :] == data[9 * 4096 :]
    assert after[2 * 4096 : 9 * 4096] == bytes(7 * 4096)
    assert before - allocated_bytes(str(tmp_path)) == 7 * 4096


def test_ranges_sharing_a_block_are_not_released(tmp_path):
    a, b, c = (ReleasedRange("f", 0, 5000), ReleasedRange("f", 6000, 9000), ReleasedRange("f", 20480, 4096))
    other = ReleasedRange("g", 0, 5000)
    mark_overlaps([a, b, c, other])
    assert (a.releasable, b.releasable, c.releasable, other.releasable) == (False, False, True, True)


@pytest.mark.slow
def test_a_failed_run_leaves_nothing_in_outdir(tmp_path, cli):
    src = mf.build("fp32", tmp_path / "src" / "model.onnx", mib=1)
    out = tmp_path / "out"
    res = cli("convert", src, "-o", out, "--prepack", "-q", "--ort-max-growth", "0.01")
    assert res.returncode == 2 and "--ort-max-growth" in res.stderr, res.stderr
    assert not out.exists() or list(out.iterdir()) == []


def _ort_whole(src: Path, tmp: Path) -> tuple[set[tuple[str, str]], Counter[str]]:
    """ORT's own default-option session of ``src``: its (initializer, kernel key) packs and its node ops."""
    from test_ort_prepack_forms import ort_saved_session

    return _packs_and_ops(ort_saved_session(src, tmp))


def _packs_and_ops(path: Path) -> tuple[set[tuple[str, str]], Counter[str]]:
    model = onnx.load(str(path), load_external_data=False)
    packs = {
        (t.name, e.value.split("|")[0])
        for t in external_tensors(model)
        for e in t.external_data
        if e.key.startswith(PREPACKED_ENTRY)
    }
    return packs, Counter(f"{n.domain}.{n.op_type}" for n, _ in all_nodes(model.graph))


@pytest.mark.slow
@pytest.mark.parametrize(
    "form,unpack,budget",
    [
        ("llama", (), BUDGET),
        # 4 segments, 2 of them over a quarter of the weights: packed node by node, the others by their session
        ("llama", (), {segs.BUDGET_ENV: "393216"}),
        ("matmulnbits4", (), BUDGET),
        ("dynamic", (), BUDGET),
        # ("fp16", ()): its attention mask, derived from the inputs, is read by every layer: one piece
        (
            "qdq",
            (),
            BUDGET,
        ),  # quantize_static puts every weight's DequantizeLinear first: they move next to their MatMul
        ("qdq_per_channel", (), BUDGET),
        ("llama_fp16", ("--unpack", "ort-cpu"), BUDGET),  # fp32 copies in the file: ORT inserts no Casts to cut across
    ],
)
def test_llm_forms_are_cut_at_layer_boundaries_and_stay_bit_identical(form, unpack, budget, tmp_path, cli):
    src = mf.build(form, tmp_path / "src" / "model.onnx", mib=1)
    out = tmp_path / "out"
    res = cli("convert", src, "-o", out, "--prepack", *unpack, "--json", "-q", env=budget)
    assert res.returncode == 0, res.stderr
    (report,) = json.loads(res.stdout)["reports"]
    seg = report["prepack"]["segments"]
    assert seg["segments"] > 1, seg  # the child's memory is bounded by a segment, not the model
    if budget is not BUDGET:
        assert 0 < seg["segments_packed_node_by_node"] < seg["segments"], seg
    assert seg["checked_cuts"] >= seg["segments"] - 1
    # bit-identical to the original at default options, and the portable twin without pre-packing
    original, prepacked = ort.InferenceSession(str(src)), ort.InferenceSession(report["outputs"][0])
    so = ort.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    plain_off, portable = (ort.InferenceSession(str(p), so) for p in (src, report["outputs"][1]))
    for batch in (1, 8):
        feeds = mf.feeds(src, batch=batch)
        a, b = original.run(None, feeds)[0], prepacked.run(None, feeds)[0]
        assert a.dtype == b.dtype and np.array_equal(a, b)
        assert np.array_equal(plain_off.run(None, feeds)[0], portable.run(None, feeds)[0])
    # the packed entries and the optimized graph of ORT's own whole-model session (of the model as unpacked,
    # with --unpack: the plain conversion with the same unpacking, which holds the same weights)
    (tmp_path / "whole").mkdir()
    reference = src
    if unpack:
        plain = cli("convert", src, "-o", tmp_path / "plain", *unpack, "--json", "-q")
        assert plain.returncode == 0, plain.stderr
        reference = Path(json.loads(plain.stdout)["reports"][0]["outputs"][0])
    packs, ops = _ort_whole(reference, tmp_path / "whole")
    assert packs, "each of these forms has weights ORT pre-packs"
    assert _packs_and_ops(Path(report["outputs"][0])) == (packs, ops)
    # the report's sizes are the files'; the staging is gone
    files = sorted(p for p in out.iterdir() if p.name != ".weightshare-folder.json")  # the outputs record: bookkeeping
    assert report["prepack"]["final_output_bytes"] == sum(f.stat().st_size for f in files)
    assert report["prepack"]["temp_disk_peak_bytes"] > 0
    assert sorted(f.name for f in files) == sorted(Path(o).name for o in report["outputs"])


@pytest.mark.slow
def test_a_cut_check_is_reused_only_for_windows_of_the_same_shape_and_the_result_is_orts_own(tmp_path, cli):
    """Layer boundaries of a Conv chain and an MLP are all alike: after the first window of a shape, the cuts in
    windows of that shape take its answer (``checks_reused``) instead of a session each. The stitched graph must
    still be ORT's own whole-model graph, packed entries and op counts, and run bit-identical."""
    from prepack_samples import mixed_onnx, sample_input

    # 256 KiB MatMul weights and 144 KiB Conv weights: large enough to count as weights, one segment each
    (tmp_path / "src").mkdir()
    src = mixed_onnx(tmp_path / "src" / "m.onnx", conv_layers=6, channels=64, mm_layers=8, dim=256, spatial=4)
    res = cli("convert", src, "-o", tmp_path / "out", "--prepack", "--json", "-q", env=BUDGET)
    assert res.returncode == 0, res.stderr
    (report,) = json.loads(res.stdout)["reports"]
    seg = report["prepack"]["segments"]
    assert seg["segments"] > 8 and seg["checks_reused"] >= 4, seg
    assert seg["checked_cuts"] - seg["checks_reused"] >= 3  # each distinct shape still ran its own window
    (tmp_path / "whole").mkdir()
    assert _packs_and_ops(Path(report["outputs"][0])) == _ort_whole(src, tmp_path / "whole")
    original, prepacked = ort.InferenceSession(str(src)), ort.InferenceSession(report["outputs"][0])
    for batch in (1, 8):
        feeds = sample_input(src, batch)
        assert np.array_equal(original.run(None, feeds)[0], prepacked.run(None, feeds)[0])


def test_window_shape_keeps_what_orts_decisions_read_and_drops_weight_values(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    def window(w: float, bias: float, scale: float, zero_point: int) -> onnx.ModelProto:
        rng = np.random.default_rng(int(w * 10))
        inits = [
            numpy_helper.from_array((rng.standard_normal((128, 128)) * w).astype(np.float32), "w"),
            numpy_helper.from_array(np.full(128, bias, np.float32), "b"),
            numpy_helper.from_array(np.array(scale, np.float32), "s"),
            numpy_helper.from_array(np.array(zero_point, np.uint8), "zp"),
        ]
        nodes = [
            helper.make_node("MatMul", ["x", "w"], ["m"]),
            helper.make_node("Add", ["m", "b"], ["a"]),
            helper.make_node("QuantizeLinear", ["a", "s", "zp"], ["y"]),
        ]
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 128])
        y = helper.make_tensor_value_info("y", TensorProto.UINT8, [1, 128])
        return helper.make_model(helper.make_graph(nodes, "w", [x], [y], inits))

    def shape(m: onnx.ModelProto, right: int = 2) -> str:
        return segs.window_shape(m, right, frozenset(), frozenset(), tmp_path)

    base = shape(window(1.0, 0.5, 0.1, 128))
    assert shape(window(2.0, 0.5, 0.1, 128)) == base  # another weight (64 KiB: a weight), same shape
    assert shape(window(1.0, 0.7, 0.1, 128)) == base  # another bias vector: not something ORT tests
    assert shape(window(1.0, 0.5, 0.2, 128)) != base  # a scalar scale: fusions compare those
    assert shape(window(1.0, 0.5, 0.1, 0)) != base  # a zero point: its value decides QDQ fusions
    assert shape(window(1.0, 0.5, 0.1, 128), right=1) != base  # the cut elsewhere
