"""The report's peak is the process tree's: the converter and every child it runs, summed at each sample
(a --prepack report said 47.7 MiB, the parent's, while the tree peaked at 641 MiB)."""

import json
import subprocess
import sys
import threading
import time

import pytest

from weightshare._platform import TreePeak, tree_rss_bytes

CHILD = "import numpy as np, time; a = np.ones(200 << 18, np.float32); print('ready', flush=True); time.sleep(0.6)"


@pytest.mark.slow
def test_tree_peak_counts_a_childs_memory_beside_its_parents():
    own = tree_rss_bytes()
    peak = TreePeak(interval=0.02)
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    child.wait()
    peak.close()
    got = peak.peak_since(start)
    assert got >= own + (200 << 20), (got >> 20, own >> 20)  # the child's 200 MiB on top of this process
    # a window that starts after the child exited holds none of it
    later = time.perf_counter()
    assert peak.peak_since(later) < own + (100 << 20)


def test_the_sampler_stops_with_the_run(tmp_path):
    import weightshare
    from weightshare._samples import mlp_onnx

    src = mlp_onnx(tmp_path / "m.onnx", dim=64, layers=2)
    report = weightshare.convert(src, tmp_path / "out")
    assert report.peak_rss_mib > 0
    assert not [t for t in threading.enumerate() if t.name == "weightshare-tree-peak"]


@pytest.mark.slow
def test_a_prepack_reports_peak_counts_its_onnxruntime_child(tmp_path, cli):
    from weightshare._samples import mlp_onnx

    src = mlp_onnx(tmp_path / "m.onnx", dim=256, layers=4)
    res = cli("convert", src, "-o", tmp_path / "out", "--prepack", "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)["reports"][0]
    child, own = rep["prepack"]["ort_child_peak_rss_mib"], rep["prepack"]["converter_peak_rss_mib"]
    # the tree held the converter while its child ran: its peak is above either process's own
    assert rep["peak_rss_mib"] >= max(child, own)
    assert rep["peak_rss_mib"] > own
