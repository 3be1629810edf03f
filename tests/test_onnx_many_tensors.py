"""Memory small in the number of tensors.

A model of 20,000 small initializers is converted in a child process; the child's peak RSS may grow by at most
40 MiB over what it held after importing everything. Measured (2-core VM, onnx 1.23, protobuf 7.36): +19 MiB with
the ref table, lazy payloads and the parsed model dropped before the blob is written; +59 MiB before (a TensorRef,
a FileRange, lists, a Site, a Placement, a closure and a protobuf tensor kept per payload). A bound on a child's
peak, not a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

COUNT = 20_000
ELEMS = 300  # 1.2 KB each: above the inline threshold, so every one goes to the blob
GROWTH_MIB = 40

_CHILD = """
import json, sys
from weightshare import api
from weightshare.formats.onnx import convert  # onnx, numpy, protobuf: imported before the baseline is read

def hwm():  # VmHWM, not ru_maxrss: ru_maxrss keeps the parent's peak across fork + exec
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024

before = hwm()
report = api.convert(sys.argv[1], sys.argv[2])
print(json.dumps({"before": before, "peak": hwm(), "moved": report.tensors_moved}))
"""


def _many(path: Path, count: int) -> Path:
    base = np.arange(ELEMS, dtype=np.float32).tobytes()[4:]
    inits = [h.make_tensor(f"t{i}", T.FLOAT, [ELEMS], base + i.to_bytes(4, "little"), raw=True) for i in range(count)]
    graph = h.make_graph(
        [h.make_node("Sum", [f"t{i}" for i in range(count)], ["y"])],
        "many",
        [],
        [h.make_tensor_value_info("y", T.FLOAT, [ELEMS])],
        inits,
    )
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))
    return path


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (VmHWM)")
def test_peak_rss_small_in_the_number_of_tensors(tmp_path):
    model = _many(tmp_path / "many.onnx", COUNT)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, str(model), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        check=False,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    fig = json.loads(res.stdout.strip().splitlines()[-1])
    assert fig["moved"] == COUNT
    growth = fig["peak"] - fig["before"]
    assert growth < GROWTH_MIB, f"converting {COUNT} tensors grew the peak RSS by {growth:.0f} MiB"
    converted = onnx.load(str(tmp_path / "out" / "many.onnx"), load_external_data=False)
    assert len(converted.graph.initializer) == COUNT
    last = converted.graph.initializer[-1]
    assert last.name == f"t{COUNT - 1}" and {e.key for e in last.external_data} == {"location", "offset", "length"}


def test_reserved_marker_key_on_a_tensor_without_payload_is_refused(tmp_path):
    from weightshare.errors import InvalidModel
    from weightshare.formats.onnx.scan import REF_KEY, scan_model

    empty = h.make_tensor("e", T.FLOAT, [0], [])
    entry = empty.external_data.add()
    entry.key, entry.value = REF_KEY, "0"
    graph = h.make_graph(
        [h.make_node("Identity", ["e"], ["y"])], "g", [], [h.make_tensor_value_info("y", T.FLOAT, [0])], [empty]
    )
    path = tmp_path / "m.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))
    with pytest.raises(InvalidModel, match="reserves"):
        scan_model(path)
