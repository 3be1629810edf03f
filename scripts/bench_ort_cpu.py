#!/usr/bin/env python3
"""Benchmark `--unpack ort-cpu`: fp16 models made by onnxconverter_common, on ONNX Runtime's CPU provider.

For each model, original vs `weightshare convert --unpack ort-cpu`:
  - conversion peak RSS (child process) and the probe child's own peak, wall time;
  - PSS after 1, 4 and 8 sessions in one process (disable_prepacking on, and off = ORT defaults);
  - median latency of one run at batch 1 and batch 16;
  - whether outputs are bit-identical under default options.

Models (in --workdir):
  mlp-<S>M: an MLP of 2048- or 4096-wide fp16 layers, S MiB of fp16 weights. The graph is what
      convert_float_to_float16(keep_io_types=True) makes of the fp32 MLP (run on a narrow copy so that a 1 GiB
      model needs no 2 GiB fp32 one in memory); the weights are random fp16 in an external data file.
  cnn: 4 x Conv 512x512x3x3 + MatMul, converted from fp32 with convert_float_to_float16 (keep_io_types=True);
      measured also at ORT_ENABLE_EXTENDED, since at the default level ORT's NCHWc transformer copies every Conv
      weight per session whatever the file holds.

    python scripts/bench_ort_cpu.py [--workdir /tmp/ws-ortcpu] [--sizes 64,1024] [--no-cnn]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from weightshare._runtimes.memory import run_child_peak

SESSIONS = [1, 4, 8]


def _fp16(model):
    from onnxconverter_common import float16

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float16.convert_float_to_float16(model, keep_io_types=True)


def _mlp_fp32(d: int, layers: int, rng):
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits += [
            nh.from_array((rng.standard_normal((d, d)) / d**0.5).astype(np.float32), f"w{i}"),
            nh.from_array((rng.standard_normal(d) / 8).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            h.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
            h.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            h.make_node("Relu", [f"a{i}"], [f"r{i}"]),
        ]
        x = f"r{i}"
    g = h.make_graph(
        nodes,
        "mlp",
        [h.make_tensor_value_info("x", T.FLOAT, ["N", "D"])],
        [h.make_tensor_value_info(x, T.FLOAT, ["N", "D"])],
        inits,
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    assert isinstance(m, onnx.ModelProto)
    return m


def make_mlp(path: Path, mib: int) -> Path:
    """The converter's graph (from a narrow model), then full-size fp16 weights streamed to external data."""
    import onnx
    from onnx import TensorProto as T

    d = 2048 if mib <= 256 else 4096
    layers = max(1, mib * (1 << 20) // (d * d * 2))
    rng = np.random.default_rng(0)
    model = _fp16(_mlp_fp32(8, layers, rng))
    for v in model.graph.value_info:  # the converter's shape inference saw the narrow model: keep the types only
        v.type.tensor_type.ClearField("shape")
    data = path.with_suffix(".data")
    with open(data, "wb") as f:
        for t in model.graph.initializer:
            shape = (d, d) if t.name.startswith("w") else (d,)
            arr = rng.standard_normal(shape, dtype=np.float32) / (d**0.5 if len(shape) == 2 else 8)
            raw = arr.astype(np.float16).tobytes()
            offset = f.tell()
            f.write(raw)
            f.write(b"\0" * (-f.tell() % 4096))
            t.ClearField("raw_data")
            del t.dims[:]
            t.dims.extend(shape)
            t.data_location = T.EXTERNAL
            for k, v in (("location", data.name), ("offset", str(offset)), ("length", str(len(raw)))):
                e = t.external_data.add()
                e.key, e.value = k, v
    onnx.save(model, path)
    return path


def make_cnn(path: Path) -> Path:
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    c, layers, hw = 512, 4, 8
    rng = np.random.default_rng(0)
    f32 = lambda *s: (rng.standard_normal(s) / 32).astype(np.float32)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits += [nh.from_array(f32(c, c, 3, 3), f"cw{i}"), nh.from_array(f32(c), f"cb{i}")]
        nodes += [
            h.make_node("Conv", [x, f"cw{i}", f"cb{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
            h.make_node("Relu", [f"c{i}"], [f"r{i}"]),
        ]
        x = f"r{i}"
    inits += [
        nh.from_array(np.array([0, -1], np.int64), "shape"),
        nh.from_array(f32(c * hw * hw, 10), "fw"),
        nh.from_array(f32(10), "fb"),
    ]
    nodes += [
        h.make_node("Reshape", [x, "shape"], ["f"]),
        h.make_node("MatMul", ["f", "fw"], ["mm"]),
        h.make_node("Add", ["mm", "fb"], ["y"]),
    ]
    g = h.make_graph(
        nodes,
        "cnn",
        [h.make_tensor_value_info("x", T.FLOAT, ["N", c, hw, hw])],
        [h.make_tensor_value_info("y", T.FLOAT, ["N", 10])],
        inits,
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(_fp16(m), path)
    return path


# ---- child side: sessions of one model in a fresh process ----


def _session(path: str, level: str, share: bool):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }[level]
    if share:
        so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def child(path: str, level: str, share: bool, width: int) -> dict:
    from weightshare._runtimes.memory import memory_now

    def feeds(session, batch):
        inp = session.get_inputs()[0]
        shape = [batch] + [d if isinstance(d, int) else width for d in inp.shape[1:]]
        return {inp.name: np.random.default_rng(batch).standard_normal(shape).astype(np.float32)}

    rows, sessions = {}, []
    for n in range(1, max(SESSIONS) + 1):
        s = _session(path, level, share)
        s.run(None, feeds(s, 1))
        sessions.append(s)
        if n in SESSIONS:
            rows[n] = memory_now()["pss_mib"]
    latency = {}
    for batch in (1, 16):
        f = feeds(sessions[0], batch)
        sessions[0].run(None, f)
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            sessions[0].run(None, f)
            times.append(time.perf_counter() - t0)
        latency[batch] = round(statistics.median(times) * 1000, 2)
    out = sessions[0].run(None, feeds(sessions[0], 4))[0]
    return {"pss": rows, "latency_ms": latency, "out_sha": __import__("hashlib").sha256(out.tobytes()).hexdigest()}


def measure(path: Path, level: str, share: bool, width: int, env: dict | None = None) -> dict:
    res = subprocess.run(
        [sys.executable, __file__, "--child", str(path), level, str(int(share)), str(width)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )
    if res.returncode != 0:
        raise SystemExit(f"child failed on {path}: {res.stderr.strip()[-500:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def convert(src: Path, out: Path, *extra: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    res, peak = run_child_peak(
        [
            sys.executable,
            "-m",
            "weightshare",
            "convert",
            str(src),
            "-o",
            str(out),
            "--unpack",
            "ort-cpu",
            *extra,
            "--json",
            "-q",
        ]
    )
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"convert failed: {res.stderr}")
    report = json.loads(res.stdout)["reports"][0]  # the --json document: one report per model
    probe = next(
        (float(m.group(1)) for n in report["notes"] if (m := re.search(r"probe child peak RSS (\d+)", n))), float("nan")
    )
    return {
        "wall_s": round(wall, 2),
        "peak_rss_mib": round(peak, 1),
        "converter_self_peak_mib": report["peak_rss_mib"],
        "probe_child_peak_mib": probe,
        "unpacked": report["unpacked"],
        "out": str(out / src.name),
    }


def bench_model(label: str, src: Path, work: Path, width: int, levels: list[str]) -> dict:
    conv = convert(src, work / f"{label}-out")
    pre = convert(src, work / f"{label}-prepacked", "--prepack") if levels else None
    print(
        f"\n== {label}: {src.stat().st_size + sum(p.stat().st_size for p in src.parent.glob(src.stem + '.data'))} "
        f"bytes; convert --unpack ort-cpu: {conv}",
        flush=True,
    )
    result = {"convert": conv, "runs": []}
    for level in levels:
        for share in (True, False):
            row = {"level": level, "disable_prepacking": share}
            for which, path in (("original", src), ("converted", Path(conv["out"]))):
                row[which] = measure(path, level, share, width)
            o, c = row["original"], row["converted"]
            same = o["out_sha"] == c["out_sha"]
            if pre and level == "all" and not share:  # ORT's defaults: --prepack's own setting
                # with the glibc setting the docs require for --prepack models opened by plain ORT: without it,
                # ORT's freed validation buffers stay in each session's heap
                row["prepacked"] = measure(Path(pre["out"]), level, share, width, {"MALLOC_MMAP_THRESHOLD_": "1048576"})
            print(
                f"{level:8s} prepack={'off' if share else 'on ':3s} PSS 1/4/8 original "
                f"{'/'.join(str(o['pss'][str(n)]) for n in SESSIONS)} MiB (4/1 = "
                f"{o['pss']['4'] / o['pss']['1']:.2f}x), converted "
                f"{'/'.join(str(c['pss'][str(n)]) for n in SESSIONS)} MiB "
                f"(4/1 = {c['pss']['4'] / c['pss']['1']:.2f}x);"
                f" latency b1 {o['latency_ms']['1']} -> {c['latency_ms']['1']} ms, b16 {o['latency_ms']['16']} -> "
                f"{c['latency_ms']['16']} ms; outputs bit-identical: {same}",
                flush=True,
            )
            if "prepacked" in row:
                p = row["prepacked"]
                print(
                    f"{'':8s} converted --unpack ort-cpu --prepack (ORT defaults, MALLOC_MMAP_THRESHOLD_=1048576): "
                    "PSS 1/4/8 "
                    f"{'/'.join(str(p['pss'][str(n)]) for n in SESSIONS)} MiB (4/1 = "
                    f"{p['pss']['4'] / p['pss']['1']:.2f}x); latency b1 {p['latency_ms']['1']} ms, b16 "
                    f"{p['latency_ms']['16']} ms; outputs bit-identical: {p['out_sha'] == o['out_sha']}; "
                    f"convert peak {pre['peak_rss_mib']} MiB",
                    flush=True,
                )
            result["runs"].append(row)
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], sys.argv[4] == "1", int(sys.argv[5]))))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ws-ortcpu"))
    ap.add_argument(
        "--sizes", default="64,256,1024", help="MLP sizes in MiB of fp16 weights (sessions are measured up to 64)"
    )
    ap.add_argument("--no-cnn", action="store_true")
    ap.add_argument("--json", type=Path, help="also write all figures to this file")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for mib in (int(s) for s in args.sizes.split(",") if s):
        d = args.workdir / f"mlp-{mib}M"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        src = make_mlp(d / "mlp.onnx", mib)
        width = 2048 if mib <= 256 else 4096
        results[f"mlp-{mib}M"] = bench_model(f"mlp-{mib}M", src, d, width, ["all"] if mib <= 64 else [])
    if not args.no_cnn:
        d = args.workdir / "cnn"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        results["cnn"] = bench_model("cnn", make_cnn(d / "cnn.onnx"), d, 512, ["all", "extended"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
