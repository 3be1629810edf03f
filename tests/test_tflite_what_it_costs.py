"""What a user pays for a TFLite `--prepack` output, converted + loader against the original.

Before: a model laid out as MediaPipe's members are (``tflite_fixtures.mediapipe_member``), small (0.6 MiB) and
larger (19 MiB), converted with `--prepack`. Under test: `check --json` (and `--strict`), whose figures are the PSS
the model and its runtime add to processes (1 and 4 instances in one process, 2 processes alive at once), through
``weightshare.litert`` (CompiledModel, the cache, the loader's fixed cost per process) and under LiteRT's default
Interpreter (XNNPACK packing per instance). After: the small one is a warning with the break-even (exit 0,
`--strict` exit 1), the larger one is not; and the figures are a measurement's twin: this test measures the same
configurations in the real runtime with its own processes (4 instances in one process, 2 processes with one
instance each, PSS read once all are open) and finds check's figures within 15% (or 2 MiB: Python's own
allocations move that much between two processes) and its verdict the same wherever the two loaders differ by more
than 10%. PSS leaves out the clean pages of shared libraries, which any process on the machine using LiteRT shares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tflite_fixtures import mediapipe_member

pytest.importorskip("ai_edge_litert")

MiB = 1 << 20

_HOLD = r"""
import sys
import numpy as np
import re
def pss():  # PSS without the clean pages of shared libraries (shared with any process on the machine)
    total, code = 0, False
    for line in open("/proc/self/smaps"):
        head = re.match(r"^[0-9a-f]+-[0-9a-f]+ (\S+) \S+ \S+ \S+\s*(\S*)", line)
        if head:
            perms, path = head.groups()
            code = path.startswith("/") and ("x" in perms or re.search(r"\.so(\.[0-9.]+)?$", path) is not None)
        elif line.startswith("Pss:") and not code or line.startswith("Private_Dirty:") and code:
            total += int(line.split()[1]) * 1024
    return total
base = pss()  # Python and numpy: what any process pays
loader, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
held = []
for _ in range(n):
    if loader == "helper":
        from weightshare.litert import interpreter
        it = interpreter(path)
    else:
        from ai_edge_litert.interpreter import Interpreter
        it = Interpreter(model_path=path)  # LiteRT's default: XNNPACK
        it.allocate_tensors()
    d = it.get_input_details()[0]
    it.set_tensor(d["index"], np.ones(d["shape"], d["dtype"]))
    it.invoke()
    held.append(it)
print("ready", flush=True)
sys.stdin.readline()
print(pss() - base, flush=True)
sys.stdin.readline()
"""


def _pss(loader: str, path, processes: int, instances: int) -> int:
    """PSS that ``processes`` processes holding ``instances`` instances each add over Python and numpy, read once
    every one is open."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HOLD, loader, str(path), str(instances)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for _ in range(processes)
    ]
    try:
        assert all(p.stdout.readline().strip() == "ready" for p in procs)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        return sum(int(p.stdout.readline()) for p in procs)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)


def _check(cli, model, *args):
    res = cli("check", model, "--json", *args)
    doc = json.loads(res.stdout)
    return res, doc["reports"][0], doc["findings"]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("paid")
    out = {}
    for name, width in (("small", 256), ("larger", 2048)):
        src = mediapipe_member(root / f"{name}.tflite", width=width)
        res = subprocess.run(
            [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(root / "out"), "--prepack", "-q"],
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stderr
        out[name] = root / "out" / src.name
    return out


@pytest.mark.slow
def test_a_small_model_costs_more_converted_and_check_says_so(cli, outputs):
    res, summary, findings = _check(cli, outputs["small"])
    assert res.returncode == 0, res.stdout
    (warning,) = [f for f in findings if f["code"] == "costs-more-than-original"]
    assert warning["severity"] == "warning" and "break-even" in warning["message"], warning
    scenarios = {(p["instances"], p["processes"]): p for p in summary["paid"]}
    assert set(scenarios) == {(4, 1), (2, 2)} and not any(p["extrapolated"] for p in scenarios.values())
    assert scenarios[2, 2]["converted"] > scenarios[2, 2]["original"]
    assert cli("check", outputs["small"], "--strict").returncode == 1
    more = _check(cli, outputs["small"], "--processes", "3", "--instances", "8")[1]
    assert all(p["extrapolated"] for p in more["paid"]), more["paid"]


@pytest.mark.slow
def test_a_larger_model_pays_and_check_says_what_it_costs(cli, outputs):
    res, summary, findings = _check(cli, outputs["larger"])
    assert res.returncode == 0, res.stdout
    assert not [f for f in findings if f["code"] == "costs-more-than-original"], findings
    (info,) = [f for f in findings if f["code"] == "what-it-costs"]
    assert info["severity"] == "info"
    assert all(p["converted"] < p["original"] for p in summary["paid"]), summary["paid"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["small", "larger"])
def test_checks_figures_are_a_measurements_twin(cli, outputs, name):
    model = outputs[name]
    _res, summary, _findings = _check(cli, model)
    for p in summary["paid"]:
        shape = (p["processes"], p["instances"] // p["processes"])
        conv, orig = _pss("helper", model, *shape), _pss("default", model, *shape)
        for figure, measured in ((p["converted"], conv), (p["original"], orig)):
            assert abs(figure - measured) <= max(0.15 * measured, 2 * MiB), (name, p, conv, orig)
        if abs(conv - orig) > 0.10 * orig:
            assert (p["converted"] > p["original"]) == (conv > orig), (name, p, conv, orig)
