"""Runs in a child process: let ONNX Runtime optimize and pre-pack a converted model and save the result.

    python -m weightshare.formats.onnx.ort_child MODEL OUT_MODEL MIN_EXTERNAL_BYTES SEGMENT_BYTES

1. ONNX Runtime writes OUT_MODEL, the ORT_ENABLE_ALL optimized graph (NCHWc Conv weights included),
   with its initializers in files next to it, pre-packing off. A graph with more than SEGMENT_BYTES
   of weights is optimized segment by segment and stitched (``ort_segments``), so that memory does
   not grow with the model.
2. Each weight-bearing node of that graph runs alone in a session that saves its pre-packed copies
   (``session.save_external_prepacked_constant_initializers``) to ``node<i>.packed.bin``.
The last stdout line is JSON: what the packed data is bound to, and the ``prepacked_N`` entries per
initializer. A child process because ORT's heap must not stay in the converter's process, and so
that its peak RSS can be measured on its own.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import onnx

# /proc/cpuinfo flags that select MLAS kernels (SGEMM packing, NCHWc block size, int8 paths).
CPU_FLAGS = (
    "sse4_1",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "asimddp",
    "i8mm",
    "bf16",
    "sve",
    "sme",
)


def cpu_features() -> list[str]:
    from ...runtimes.cpuinfo import cpu_flags

    flags = cpu_flags()
    return [f for f in CPU_FLAGS if f in flags]


def nchwc_block_size(directory: str | None = None) -> int:
    """Measured, not guessed: ORT pads the output channels of an NCHWc Conv weight to its block size,
    so an 8-channel 1x1 Conv's reordered weight has block-size rows (0: no NCHWc on this CPU).
    ``directory``: where its scratch file goes (the converter's locked staging; default $TMPDIR)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    graph = h.make_graph(
        [h.make_node("Conv", ["x", "w"], ["y"])],
        "probe",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 8, 4, 4])],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        [nh.from_array(np.ones((8, 8, 1, 1), np.float32), "w")],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    import tempfile

    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        so = ort.SessionOptions()
        so.optimized_model_filepath = f"{tmp}/probe.onnx"
        so.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        optimized = onnx.load(f"{tmp}/probe.onnx")
    if not any(n.domain == "com.microsoft.nchwc" for n in optimized.graph.node):
        return 0
    return max((t.dims[0] for t in optimized.graph.initializer if len(t.dims) == 4), default=0)


def optimize(model: str, out_model: str, bin_name: str, min_external: str) -> None:
    """The level-ALL graph (fusions, NCHWc Conv weights) of ``model``, without pre-packing.

    With pre-packing off ORT holds only the reordered Conv weights (1x, plus ~3x the Conv weight it
    is reordering, measured); the rest streams from the mapped file to BIN (156 MiB peak RSS for a
    1 GiB MatMul model). Conv-heavy graphs therefore go through ``optimize_bounded`` in segments.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    # The default level: what a user's plain InferenceSession(path) runs, NCHWc included.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = out_model
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", bin_name)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", min_external)
    so.log_severity_level = 3  # ORT warns that a level-ALL graph is hardware-specific: we record that instead
    ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _one_node_model(
    node: onnx.NodeProto, graph: onnx.ModelProto, inits: dict[str, onnx.TensorProto]
) -> onnx.ModelProto:
    """``node`` alone, its constant inputs as (external) initializers, the others as untyped-shape inputs."""
    import onnx
    from onnx import helper as h

    elem = next((inits[i].data_type for i in node.input if i in inits), onnx.TensorProto.FLOAT)
    if node.op_type in ("DynamicQuantizeMatMul", "MatMulIntegerToFloat"):
        elem = onnx.TensorProto.FLOAT  # float activations, int8 weights
    inputs = [h.make_tensor_value_info(i, elem, None) for i in node.input if i and i not in inits]
    outputs = [h.make_tensor_value_info(o, elem, None) for o in node.output if o]
    g = h.make_graph([node], "one_node", inputs, outputs, [inits[i] for i in node.input if i in inits])
    m = h.make_model(g, opset_imports=graph.opset_import)
    m.ir_version = graph.ir_version
    return m


def pack(opt_model: str, min_external: int) -> dict[str, list[list[str]]]:
    """Pre-pack node by node: each weight-bearing node of the optimized graph alone in a session.

    Returns initializer name -> [[prepacked entry value, file], ...]. Peak memory is one node's weights
    and packed copies, whatever the model's size. A node whose kernel does not pre-pack yields nothing.
    """
    import gc
    import os

    import onnx
    import onnxruntime as ort

    from ...ort import malloc_trim

    model = onnx.load(opt_model, load_external_data=False)
    stage = os.path.dirname(opt_model)
    inits = {t.name: t for t in model.graph.initializer}
    found: dict[str, list[list[str]]] = {}
    for n, node in enumerate(model.graph.node):
        if not any(i in inits and inits[i].data_location == onnx.TensorProto.EXTERNAL for i in node.input):
            continue
        name = os.path.join(stage, f"node{n}.onnx")
        with open(name, "wb") as f:
            f.write(_one_node_model(node, model, inits).SerializeToString())
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the node, as the graph has it
        so.optimized_model_filepath = os.path.join(stage, f"node{n}.packed.onnx")
        so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"node{n}.packed.bin")
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", str(min_external)
        )
        so.log_severity_level = 3
        try:
            ort.InferenceSession(name, so, providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - a node ORT cannot run alone keeps no packed copy; its session packs it
            continue
        finally:
            os.unlink(name)
            gc.collect()
            malloc_trim()
        packed = onnx.load(so.optimized_model_filepath, load_external_data=False)
        os.unlink(so.optimized_model_filepath)
        for t in packed.graph.initializer:
            for e in t.external_data:
                if e.key.startswith("prepacked_"):
                    found.setdefault(t.name, []).append([e.value, f"node{n}.packed.bin"])
    return found


def optimize_bounded(model: str, out_model: str, min_external: str, budget: int) -> dict[str, Any]:
    """Step 1 in memory bounded by ``budget`` weight bytes per segment (``ort_segments``): the
    optimized graph in ``out_model``, its initializers in files named after it."""
    from .ort_segments import Segmenter

    def run(src: str, dst: str, bin_name: str) -> None:
        from ...ort import malloc_trim

        optimize(src, dst, bin_name, min_external)
        malloc_trim()  # the session's heap goes back before the next segment's session

    return Segmenter(model, out_model, run, budget).run().as_dict()


def main(argv: list[str]) -> int:
    model, out_model, min_external, budget = argv
    from .ort_limits import die_with_parent

    die_with_parent()  # its parent (run_child_peak's wrapper) dies with the converter: so does this child
    import onnxruntime as ort

    segments = optimize_bounded(model, out_model, min_external, int(budget))
    packed = pack(out_model, int(min_external))
    binding = {
        "onnxruntime": ort.__version__,
        "optimization_level": "ORT_ENABLE_ALL",
        "machine": platform.machine(),
        "cpu_features": cpu_features(),
        "nchwc_block": nchwc_block_size(os.path.dirname(os.path.abspath(out_model))),  # in the staging, not $TMPDIR
    }
    print(json.dumps({"binding": binding, "packed": packed, "segments": segments}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as e:  # the parent turns this one line into its own error
        print(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        sys.exit(1)
