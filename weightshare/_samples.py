"""Sample models for `weightshare demo`, the benchmarks and the tests.

An MLP whose weights are stored the way exporters often store them: fp16
initializers behind ``Cast(to=FLOAT)`` (what ``keep_io_types`` fp16 exports
produce), or plain fp32, embedded or in an external data file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def mlp_onnx(
    path: str | os.PathLike[str],
    layers: int = 12,
    dim: int = 2048,
    weights: str = "float16",
    external: bool = False,
    seed: int = 0,
    batch: int = 1,
) -> Path:
    """Write an MLP: x[batch, dim] -> (MatMul W_i -> Add b_i -> Relu) x layers -> y.

    Args:
        weights: "float16" (fp16 initializers, each behind Cast(to=FLOAT)) or "float32".
        external: store weights in ``<stem>.data`` beside the model, written layer by layer
            so that models larger than protobuf's 2 GiB limit (and than RAM) can be made.
    """
    from onnx import TensorProto, helper, numpy_helper

    path = Path(path)
    rng = np.random.default_rng(seed)
    np_type = np.float16 if weights == "float16" else np.float32
    nodes, inits = [], []
    data_file = path.with_suffix(".data")
    data = open(data_file, "wb") if external else None
    try:
        x = "x"
        for i in range(layers):
            w = (rng.standard_normal((dim, dim), dtype=np.float32) / np.sqrt(dim)).astype(np_type)
            b = (rng.standard_normal(dim, dtype=np.float32) * 0.1).astype(np_type)
            for name, arr in ((f"w{i}", w), (f"b{i}", b)):
                t = numpy_helper.from_array(arr, name)
                if data is not None:
                    offset = data.tell()
                    data.write(arr.tobytes())
                    t.ClearField("raw_data")
                    t.data_location = TensorProto.EXTERNAL
                    for k, v in (("location", data_file.name), ("offset", str(offset)), ("length", str(arr.nbytes))):
                        e = t.external_data.add()
                        e.key, e.value = k, v
                inits.append(t)
            wi, bi = f"w{i}", f"b{i}"
            if np_type == np.float16:
                nodes += [
                    helper.make_node("Cast", [wi], [f"w{i}_f"], to=TensorProto.FLOAT),
                    helper.make_node("Cast", [bi], [f"b{i}_f"], to=TensorProto.FLOAT),
                ]
                wi, bi = f"w{i}_f", f"b{i}_f"
            y = "y" if i == layers - 1 else f"h{i}"
            nodes += [
                helper.make_node("MatMul", [x, wi], [f"m{i}"]),
                helper.make_node("Add", [f"m{i}", bi], [f"a{i}"]),
                helper.make_node("Relu", [f"a{i}"], [y]),
            ]
            x = y
    finally:
        if data is not None:
            data.close()
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, dim])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="weightshare-sample")
    model.ir_version = 8
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path
