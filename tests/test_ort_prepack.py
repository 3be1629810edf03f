"""convert --prepack (ONNX): ORT's pre-packed and NCHWc weights in the blob; weightshare.ort.session."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from prepack_samples import cnn_onnx, downsample_onnx, mixed_onnx, sample_input
from safetensors import safe_open

import weightshare.ort as wort
from weightshare._safetensors import read_safetensors_metadata
from weightshare.formats.onnx.ort import segments as segs
from weightshare.formats.onnx.ort.child import optimize as ort_optimize
from weightshare.formats.onnx.ort.prepack import METADATA_KEY, OPTIMIZED_PREFIX, PACKED_PREFIX, portable_name


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A small MatMul + Gemm + Conv model and its --prepack conversion (through the CLI, as a user would)."""
    from conftest import run_cli

    d = tmp_path_factory.mktemp("prepack")
    src = mixed_onnx(d / "mixed.onnx", conv_layers=2, channels=32, mm_layers=3, dim=256)
    res = run_cli("convert", src, "-o", d / "out", "--prepack", "--json", "-q")
    assert res.returncode == 0, res.stderr
    (report,) = json.loads(res.stdout)["reports"]
    return src, report


def _blob(model: Path) -> Path:
    m = onnx.load(str(model), load_external_data=False)
    locs = {e.value for t in m.graph.initializer for e in t.external_data if e.key == "location"}
    assert len(locs) == 1
    return model.parent / locs.pop()


def _run(session, src, batch):
    return session.run(None, sample_input(src, batch))[0]


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _plain(path, **config):
    so = ort.SessionOptions()
    for k, v in config.items():
        so.add_session_config_entry(k, v)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


@pytest.mark.slow
def test_outputs_and_files(converted):
    src, report = converted
    model, portable = Path(report["outputs"][0]), Path(report["outputs"][1])
    assert model.name == src.name and portable.name == portable_name(src.name)
    assert Path(report["outputs"][2]) == _blob(model) == _blob(portable)


def test_prepacked_model_loads_plain_and_is_bit_identical(converted):
    src, report = converted
    original, prepacked = _plain(src), ort.InferenceSession(report["outputs"][0])  # no SessionOptions at all
    for batch in (1, 16):
        assert _same(_run(prepacked, src, batch), _run(original, src, batch))


def test_portable_model_loads_with_disable_prepacking(converted):
    src, report = converted
    off = {"session.disable_prepacking": "1"}
    assert _same(_run(_plain(report["outputs"][1], **off), src, 4), _run(_plain(src, **off), src, 4))


def test_packed_entries_point_into_the_safetensors_blob(converted):
    _src, report = converted
    model = onnx.load(report["outputs"][0], load_external_data=False)
    blob = _blob(Path(report["outputs"][0]))
    start, header, meta = read_safetensors_metadata(str(blob))
    packed_ranges = {
        (start + t["data_offsets"][0], t["data_offsets"][1] - t["data_offsets"][0])
        for n, t in header.items()
        if n.startswith(PACKED_PREFIX)
    }
    entries = [e.value for t in model.graph.initializer for e in t.external_data if e.key.startswith("prepacked_")]
    kernels = {v.split("+")[0] for v in entries}
    assert "MatMul" in kernels and kernels & {"Gemm", "FusedGemm"}  # Gemm+Relu becomes FusedGemm at level ALL
    seen = set()
    for value in entries:
        for buf in value.split("|")[1:]:
            offset, size = map(int, buf.split(";")[:2])
            seen.add((offset, size))
    assert seen and seen <= packed_ranges and len(seen) == len(packed_ranges)
    # NCHWc-reordered Conv weights are stored too, and the blob is still plain safetensors
    assert any(n.startswith(OPTIMIZED_PREFIX) for n in header)
    assert {"nchwc", "com.microsoft.nchwc"} & {o.domain for o in model.opset_import} or any(
        n.domain == "com.microsoft.nchwc" for n in model.graph.node
    )
    with safe_open(str(blob), "np") as f:
        assert set(f.keys()) >= set(meta)
        binding = json.loads(f.metadata()[METADATA_KEY])
    assert binding["onnxruntime"] == ort.__version__
    assert binding["optimization_level"] == "ORT_ENABLE_ALL"
    assert binding["portable_model"] == Path(report["outputs"][1]).name
    assert {"cpu_features", "nchwc_block", "machine"} <= set(binding)
    # every payload, packed copies included, carries a checksum
    assert all(len(meta[n]["blake3"]) == 64 for n in header if not n.startswith("__pad__"))


def _flipped(report, tmp_path: Path, prefix: str) -> Path:
    out = tmp_path / "flipped"
    shutil.copytree(Path(report["outputs"][0]).parent, out)
    blob = _blob(out / Path(report["outputs"][0]).name)
    start, header, _meta = read_safetensors_metadata(str(blob))
    name = next(n for n in header if n.startswith(prefix))
    begin, end = header[name]["data_offsets"]
    pos = start + (begin + end) // 2 + 3  # a float's exponent byte: the change shows in the outputs
    with open(blob, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0x40]))
    return out / Path(report["outputs"][0]).name


@pytest.mark.parametrize("prefix", [PACKED_PREFIX, OPTIMIZED_PREFIX])
def test_helper_falls_back_on_a_flipped_byte(converted, tmp_path, prefix, caplog):
    src, report = converted
    flipped = _flipped(report, tmp_path, prefix)
    expected = _run(_plain(src), src, 4)
    if prefix == PACKED_PREFIX:  # ORT's load-time validation catches a packed copy...
        with pytest.raises(Exception, match="do not match"):
            ort.InferenceSession(str(flipped))
    else:  # ...but not an NCHWc weight: plain ORT computes wrong results, hence the helper's checksums
        assert not _same(_run(ort.InferenceSession(str(flipped)), src, 4), expected)
    with caplog.at_level(logging.WARNING, logger="weightshare.ort"):
        sess = wort.session(flipped)
        again = wort.session(flipped)
    # the fallback computes what the original computes at the same (default) options, not under
    # disable_prepacking (MLAS's unpacked path rounds differently from the packed one at batch > 1)
    assert _same(_run(sess, src, 4), expected) and _same(_run(again, src, 4), expected)
    said = [r.getMessage() for r in caplog.records if r.name == "weightshare.ort"]
    assert len(said) == 1 and "recorded blake3 digest" in said[0] and portable_name(src.name) in said[0]
    assert "MiB per session" in said[0]  # what the exact fallback costs


def test_helper_falls_back_when_onnxruntime_refuses(converted, tmp_path, monkeypatch, caplog):
    """Packed data that passes the helper's own checks but not ORT's validation (as on another CPU whose
    features the record does not capture): ORT's refusal is the last line of defence."""
    src, report = converted
    flipped = _flipped(report, tmp_path, PACKED_PREFIX)
    monkeypatch.setattr(wort, "check_packed_payloads", lambda blob, info: None)
    with caplog.at_level(logging.WARNING, logger="weightshare.ort"):
        sess = wort.session(flipped)
    assert "onnxruntime refused it" in caplog.records[0].getMessage()
    assert _same(_run(sess, src, 4), _run(_plain(src), src, 4))


def test_helper_opens_the_prepacked_model_when_it_matches(converted, caplog):
    src, report = converted
    with caplog.at_level(logging.WARNING, logger="weightshare.ort"):
        sess = wort.session(report["outputs"][0])
    assert not caplog.records
    assert _same(_run(sess, src, 4), _run(_plain(src), src, 4))


def test_helper_falls_back_on_another_machine(converted, monkeypatch, caplog):
    src, report = converted
    other = {**wort.this_machine(), "nchwc_block": 8 if wort.this_machine()["nchwc_block"] != 8 else 16}
    monkeypatch.setattr(wort, "_machine", other)  # what an AVX2 machine measures for a blob built on AVX-512
    monkeypatch.setattr(wort, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="weightshare.ort"):
        sess = wort.session(report["outputs"][0])
    assert "nchwc_block" in caplog.records[0].getMessage()
    assert portable_name(src.name) in caplog.records[0].getMessage()  # ORT got the bytes: it has no path to show
    assert _same(_run(sess, src, 4), _run(_plain(src), src, 4))


_PSS_PROBE = """
import json, sys, onnxruntime as ort
from weightshare._runtimes.memory import memory_now
from weightshare.ort import malloc_trim
from prepack_samples import sample_input
path, src = sys.argv[1:]
sessions, rows = [], []
base = memory_now()["pss_mib"]
for n in range(4):
    s = ort.InferenceSession(path)
    s.run(None, sample_input(src, 16))
    malloc_trim()
    sessions.append(s)
    rows.append(memory_now()["pss_mib"] - base)
print(json.dumps(rows))
"""


def _pss_rows(model: str, src: Path) -> list[float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    res = subprocess.run([sys.executable, "-c", _PSS_PROBE, model, str(src)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.splitlines()[-1])


@pytest.mark.slow
def test_default_option_sessions_share_packed_weights(tmp_path):
    """4 plain sessions of the --prepack model cost about one; of the ordinary conversion, four."""
    from conftest import run_cli

    src = mixed_onnx(tmp_path / "big.onnx", conv_layers=2, channels=128, mm_layers=4, dim=1024)  # ~18 MiB
    weights = (tmp_path / "big.data").stat().st_size / 2**20
    for flag, out in (("--prepack", "pre"), (None, "plain")):
        res = run_cli("convert", src, "-o", tmp_path / out, "-q", *([flag] if flag else []))
        assert res.returncode == 0, res.stderr
    pre = _pss_rows(str(tmp_path / "pre" / src.name), src)
    plain = _pss_rows(str(tmp_path / "plain" / src.name), src)
    per_session = lambda rows: (rows[3] - rows[0]) / 3  # noqa: E731
    # what is left per session is ORT's own bookkeeping (~1 MiB), not weights
    assert per_session(pre) < 0.1 * weights, (pre, weights)
    assert per_session(plain) > 0.75 * weights, (plain, weights)  # the same probe sees the per-session copies
    assert pre[3] <= 1.2 * pre[0], pre


@pytest.mark.slow
def test_a_model_onnxruntime_cannot_load_fails_cleanly(tmp_path, cli):
    """exit 2, one line naming the file, nothing left in OUTDIR (no model, no blob, no staging directory)."""
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    w = nh.from_array(np.ones((64, 64), np.float32), "w")
    graph = h.make_graph(
        [h.make_node("NoSuchOp", ["x", "w"], ["y"], domain="example.nowhere")],
        "g",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 64])],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        [w],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("example.nowhere", 1)])
    src = tmp_path / "odd.onnx"
    onnx.save(model, src)
    res = cli("convert", src, "-o", tmp_path / "out", "--prepack", "-q")
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "odd.onnx" in res.stderr and "onnxruntime" in res.stderr
    out = tmp_path / "out"
    assert "Traceback" not in res.stderr and (not out.exists() or list(out.iterdir()) == [])


@pytest.mark.slow
def test_verify_passes_the_prepacked_model_and_fails_a_flipped_packed_copy(converted, tmp_path, cli):
    src, report = converted
    ok = cli("verify", src, report["outputs"][0], "--runs", "1")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = cli("verify", src, _flipped(report, tmp_path, PACKED_PREFIX), "--runs", "1")
    # the recorded digest of the packed copy catches the flip before onnxruntime's own validation would
    assert bad.returncode == 1 and f"blob record '{PACKED_PREFIX}" in bad.stdout, bad.stdout + bad.stderr
    assert "internal error" not in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("prefix", [PACKED_PREFIX, OPTIMIZED_PREFIX])
def test_check_refuses_a_flipped_packed_or_reordered_copy(converted, tmp_path, prefix, cli):
    """Packed copies and NCHWc weights are payloads no portable tensor references: check re-hashes them too."""
    src, report = converted
    ok = cli("check", report["outputs"][0], "--json")
    assert "checksum-mismatch" not in ok.stdout, ok.stdout
    bad = cli("check", _flipped(report, tmp_path, prefix), "--json")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    found = [f for f in json.loads(bad.stdout)["findings"] if f["code"] == "checksum-mismatch"]
    assert len(found) == 1, found
    if prefix == PACKED_PREFIX:  # a blob record only; an NCHWc weight is an initializer of the prepacked graph
        assert found[0]["tensor"].startswith(prefix), found


# ---------------------------------------------------------------- step 1 in segments (bounded memory)


SAMPLES = {  # several conv/mm sizes; residual Adds with BatchNorm or Clip; branches; unaligned channels
    "mixed": lambda p: mixed_onnx(p, conv_layers=4, channels=32, mm_layers=5, dim=128),
    "mixed-wide": lambda p: mixed_onnx(p, conv_layers=3, channels=64, mm_layers=4, dim=96, spatial=5),
    "cnn": lambda p: cnn_onnx(p, channels=48, blocks=6, spatial=6, seed=3),
    "cnn-unaligned": lambda p: cnn_onnx(p, channels=20, blocks=7, spatial=8),
    "downsample": lambda p: downsample_onnx(p, channels=16, blocks=4, spatial=16),
}


def _level_all(src: Path, out: Path, budget: int) -> dict:
    """ORT's level-ALL graph of ``src`` into ``out`` (external data beside it), in segments of ``budget``."""
    out.parent.mkdir(exist_ok=True)
    opt = lambda a, b, c: ort_optimize(a, b, c, "1024")
    return segs.Segmenter(str(src), str(out), opt, budget).run().as_dict()


def _fingerprint(path: Path):
    return segs.fingerprint(onnx.load(str(path), load_external_data=False), path.parent)


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_segmented_optimization_is_the_whole_graph_optimization(tmp_path, sample):
    """Stitched segments: node for node the graph ORT builds from the whole model, and bit-identical outputs."""
    src = SAMPLES[sample](tmp_path / f"{sample}.onnx")
    whole = _level_all(src, tmp_path / "whole" / "ort.onnx", 1 << 40)
    split = _level_all(src, tmp_path / "split" / "ort.onnx", 20000)
    assert whole["segments"] == 1 and split["segments"] > 2, split
    # every cut checked, and each dropped or moved one once more (a moved cut re-checks the cut before it)
    assert split["checked_cuts"] >= split["segments"] - 1 + split["unsafe_cuts"] + split["moved_cuts"]
    assert _fingerprint(tmp_path / "split" / "ort.onnx") == _fingerprint(tmp_path / "whole" / "ort.onnx")
    stitched, original = ort.InferenceSession(str(tmp_path / "split" / "ort.onnx")), _plain(src)
    for batch in (1, 16):
        assert _same(_run(stitched, src, batch), _run(original, src, batch))
    # nothing but the stitched model's own data is left beside it
    referenced = {
        e.value
        for t in onnx.load(str(tmp_path / "split" / "ort.onnx"), load_external_data=False).graph.initializer
        for e in t.external_data
        if e.key == "location"
    }
    assert {p.name for p in (tmp_path / "split").iterdir()} == referenced | {"ort.onnx"}


def test_the_pair_check_drops_a_cut_that_breaks_a_fusion(tmp_path):
    """A budget so small that a cut falls between a Conv and its BatchNorm: ORT fuses the two in the whole
    graph, not across the cut. The check must see it, drop the cut, and the result must still be exact."""
    src = cnn_onnx(tmp_path / "cnn.onnx", channels=32, blocks=3, spatial=6)
    seg = segs.Segmenter(str(src), str(tmp_path / "s" / "ort.onnx"), lambda a, b, c: None, 1000)
    (tmp_path / "s").mkdir()
    seg.optimize = lambda a, b, c: ort_optimize(a, b, c, "1024")
    bounds = seg.plan.bounds
    bad = next(k for k in range(len(bounds) - 2) if seg.model.graph.node[bounds[k + 1]].op_type == "BatchNormalization")
    assert not seg.cut_is_exact(bounds, bad)
    report = _level_all(src, tmp_path / "split" / "ort.onnx", 1000)
    whole = _level_all(src, tmp_path / "whole" / "ort.onnx", 1 << 40)
    assert report["unsafe_cuts"] >= 1 and report["segments"] > 1 and whole["segments"] == 1
    assert _fingerprint(tmp_path / "split" / "ort.onnx") == _fingerprint(tmp_path / "whole" / "ort.onnx")


def test_the_pair_check_drops_a_cut_between_matmul_and_its_bias(tmp_path):
    """ORT fuses MatMul+Add into Gemm in the whole graph: a cut between them is dropped, the result stays exact."""
    src = downsample_onnx(tmp_path / "ds.onnx", channels=16, blocks=4, spatial=16)
    report = _level_all(src, tmp_path / "split" / "ort.onnx", 1000)
    _level_all(src, tmp_path / "whole" / "ort.onnx", 1 << 40)
    assert report["segments"] > 2 and any("(Add)" in d for d in report["dropped_cuts"]), report
    assert _fingerprint(tmp_path / "split" / "ort.onnx") == _fingerprint(tmp_path / "whole" / "ort.onnx")


def test_reorder_splice_and_standin_are_what_makes_cuts_exact(tmp_path):
    """Without the stitch's NCHWc splice a cut inside a Conv chain leaves a ReorderOutput/ReorderInput pair the
    whole graph does not have; without the stand-in a residual Add after a cut is not fused into its Conv."""
    src = cnn_onnx(tmp_path / "cnn.onnx", channels=32, blocks=1, spatial=6)
    (tmp_path / "s").mkdir()
    seg = segs.Segmenter(
        str(src), str(tmp_path / "s" / "ort.onnx"), lambda a, b, c: ort_optimize(a, b, c, "1024"), 1000
    )
    g = seg.model.graph
    cut = next(p for p, n in enumerate(g.node) if n.output[0] == "block0.conv1")  # after stem+MaxPool
    bounds = [0, cut, len(g.node)]
    assert seg.standin(bounds, 1) == {"pool"}
    assert seg.cut_is_exact(bounds, 0)
    left, right = seg.segment(bounds, 0), seg.segment(bounds, 1)
    assert any(n.op_type == "ReorderOutput" and n.output[0] == "pool" for n in left.graph.node)
    assert any(n.op_type == "ReorderInput" and n.input[0] == "pool" for n in right.graph.node)
    stitched = segs.stitch([left, right], g.input, g.output, standins=[frozenset(), frozenset({"pool"})])
    assert not any("pool" in (*n.input, *n.output) for n in stitched.graph.node)  # NCHWc straight through
    is_standin = lambda n: n.op_type == "MaxPool" and segs._attr(n, "kernel_shape", None) == [1, 1]
    assert any(map(is_standin, right.graph.node)) and not any(map(is_standin, stitched.graph.node))
    plain = seg._run(cut, len(g.node), frozenset(), "plain")  # the second segment without its stand-in
    adds = lambda m: sum(n.op_type == "Add" for n in m.graph.node)
    assert adds(plain) == 1 and adds(right) == 0  # the residual Add fused into the Conv only with the stand-in


def test_graphs_that_are_not_cut(tmp_path):
    from onnx import TensorProto as T
    from onnx import helper as h

    src = mixed_onnx(tmp_path / "m.onnx", conv_layers=2, channels=32, mm_layers=2, dim=64)
    model = onnx.load(str(src), load_external_data=False)
    types = segs.tensor_types(model)
    assert len(segs.plan(model.graph, 1 << 30, types).bounds) == 2  # small enough for one piece
    assert len(segs.plan(model.graph, 1000, types).bounds) > 2
    then = h.make_graph(
        [h.make_node("Identity", ["y"], ["z"])], "then", [], [h.make_tensor_value_info("z", T.FLOAT, None)]
    )
    model.graph.node.append(h.make_node("If", ["cond"], ["w"], then_branch=then, else_branch=then))
    p = segs.plan(model.graph, 1000, types)
    assert len(p.bounds) == 2 and "subgraph" in p.reason


@pytest.mark.slow
def test_prepack_cli_reports_segments_and_stays_bit_identical(tmp_path):
    from conftest import run_cli

    src = cnn_onnx(tmp_path / "cnn.onnx", channels=48, blocks=6, spatial=6, seed=3)
    res = run_cli("convert", src, "-o", tmp_path / "out", "--prepack", "--json", "-q", env={segs.BUDGET_ENV: "20000"})
    assert res.returncode == 0, res.stderr
    (report,) = json.loads(res.stdout)["reports"]
    note = next(n for n in report["notes"] if "segments" in n)
    assert int(note.split(" in ")[1].split()[0]) > 2, note
    prepacked = ort.InferenceSession(report["outputs"][0])
    for batch in (1, 16):
        assert _same(_run(prepacked, src, batch), _run(_plain(src), src, batch))
    off = {"session.disable_prepacking": "1"}
    assert _same(_run(_plain(report["outputs"][1], **off), src, 4), _run(_plain(src, **off), src, 4))


def test_a_failure_while_cutting_falls_back_to_the_whole_graph(tmp_path):
    src = cnn_onnx(tmp_path / "cnn.onnx", channels=32, blocks=3, spatial=6)

    def refuse_segments(model: str, out: str, bin_name: str) -> None:
        if model.endswith(".in.onnx"):  # a segment or pair model
            raise RuntimeError("refused")
        ort_optimize(model, out, bin_name, "1024")

    (tmp_path / "s").mkdir()
    report = segs.Segmenter(str(src), str(tmp_path / "s" / "ort.onnx"), refuse_segments, 20000).run().as_dict()
    assert report["segments"] == 1 and report["single_reason"] == "cutting failed: RuntimeError"
    whole = _level_all(src, tmp_path / "whole" / "ort.onnx", 1 << 40)
    assert whole["segments"] == 1
    assert _fingerprint(tmp_path / "s" / "ort.onnx") == _fingerprint(tmp_path / "whole" / "ort.onnx")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["ort.bin", "ort.onnx"]


def test_a_full_disk_while_cutting_fails_the_run_and_leaves_nothing(tmp_path):
    """A segment's file that does not fit is no reason to optimize the whole graph in one piece (more memory, and
    its files would not fit either): the error goes up, the cutting's files are gone. Any other OSError falls back."""
    import errno

    src = cnn_onnx(tmp_path / "cnn.onnx", channels=32, blocks=3, spatial=6)
    for code, falls_back in ((errno.ENOSPC, False), (errno.EDQUOT, False), (errno.EACCES, True)):
        out = tmp_path / f"s{code}"
        out.mkdir()

        def full(model: str, to: str, bin_name: str, code: int = code) -> None:
            if model.endswith(".in.onnx"):  # a segment or pair model
                raise OSError(code, os.strerror(code))
            ort_optimize(model, to, bin_name, "1024")

        seg = segs.Segmenter(str(src), str(out / "ort.onnx"), full, 20000)
        if falls_back:
            assert seg.run().as_dict()["single_reason"] == "cutting failed: PermissionError"
            assert sorted(p.name for p in out.iterdir()) == ["ort.bin", "ort.onnx"]
        else:
            with pytest.raises(OSError) as raised:
                seg.run()
            assert raised.value.errno == code
            assert not list(out.iterdir()), sorted(p.name for p in out.iterdir())
