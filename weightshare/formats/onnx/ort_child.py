"""Runs in a child process: let ONNX Runtime optimize and pre-pack a converted model and save the result.

    python -m weightshare.formats.onnx.ort_child MODEL OUT_MODEL BIN_NAME MIN_EXTERNAL_BYTES

ONNX Runtime writes OUT_MODEL (the ORT_ENABLE_ALL optimized graph, NCHWc Conv weights included) and,
next to it, BIN_NAME holding every initializer and each pre-packed MatMul/Gemm copy
(``session.save_external_prepacked_constant_initializers``). The last stdout line is JSON describing
what the saved data is bound to. A child process because ORT's heap (packed copies, reordered
weights) must not stay in the converter's process, and so that its peak RSS can be measured on its own.
"""

from __future__ import annotations

import json
import platform
import sys

# /proc/cpuinfo flags that select MLAS kernels (SGEMM packing, NCHWc block size, int8 paths).
CPU_FLAGS = ("sse4_1", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "asimddp", "i8mm", "bf16", "sve", "sme")


def cpu_features() -> list[str]:
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags.update(value.split())
    except OSError:
        pass
    return [f for f in CPU_FLAGS if f in flags]


def nchwc_block_size() -> int:
    """Measured, not guessed: ORT pads the output channels of an NCHWc Conv weight to its block size,
    so an 8-channel 1x1 Conv's reordered weight has block-size rows (0: no NCHWc on this CPU)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto as T, helper as h, numpy_helper as nh

    graph = h.make_graph([h.make_node("Conv", ["x", "w"], ["y"])], "probe",
                         [h.make_tensor_value_info("x", T.FLOAT, [1, 8, 4, 4])],
                         [h.make_tensor_value_info("y", T.FLOAT, None)],
                         [nh.from_array(np.ones((8, 8, 1, 1), np.float32), "w")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.optimized_model_filepath = f"{tmp}/probe.onnx"
        so.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        optimized = onnx.load(f"{tmp}/probe.onnx")
    if not any(n.domain == "com.microsoft.nchwc" for n in optimized.graph.node):
        return 0
    return max((t.dims[0] for t in optimized.graph.initializer if len(t.dims) == 4), default=0)


def main(argv: list[str]) -> int:
    model, out_model, bin_name, min_external = argv
    import onnxruntime as ort

    so = ort.SessionOptions()
    # The default level: what a user's plain InferenceSession(path) runs, NCHWc included.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = out_model
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", bin_name)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", min_external)
    so.log_severity_level = 3  # ORT warns that a level-ALL graph is hardware-specific: we record that instead
    ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    binding = {"onnxruntime": ort.__version__, "optimization_level": "ORT_ENABLE_ALL",
               "machine": platform.machine(), "cpu_features": cpu_features(), "nchwc_block": nchwc_block_size()}
    print(json.dumps(binding))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as e:  # the parent turns this one line into its own error
        print(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        sys.exit(1)
