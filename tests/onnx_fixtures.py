"""ONNX fixture models covering every payload kind the scanner must find."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

D = 64  # features
N = 16  # batch


def _typed(name: str, arr: np.ndarray, data_type: int) -> onnx.TensorProto:
    """A tensor stored in its typed protobuf field rather than raw_data."""
    if data_type in (T.FLOAT16, T.BFLOAT16):
        bits = arr.view(np.uint16) if data_type == T.FLOAT16 else arr
        t = onnx.TensorProto(name=name, data_type=data_type, dims=arr.shape)
        t.int32_data.extend(int(v) for v in bits.ravel())
        return t
    return h.make_tensor(name, data_type, arr.shape, arr.ravel().tolist(), raw=False)


def _external(t: onnx.TensorProto, data_path: Path, location: str) -> onnx.TensorProto:
    raw = t.raw_data
    with open(data_path, "ab") as f:
        offset = f.tell()
        f.write(raw)
    t.ClearField("raw_data")
    t.data_location = T.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(len(raw)))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def _cast_f(src: str, dst: str) -> onnx.NodeProto:
    return h.make_node("Cast", [src], [dst], to=T.FLOAT)


def kitchen_sink(directory: Path, seed: int = 0) -> Path:
    """Every payload kind: raw, typed fields, fp16/bf16 + Cast, Constant, sparse, subgraphs, function, external."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: (rng.standard_normal(shape) / 8).astype(np.float32)  # noqa: E731
    nodes, inits, sparse, outputs = [], [], [], []

    def out(name, rank=2):
        outputs.append(h.make_tensor_value_info(name, T.FLOAT, [f"{name}_{i}" for i in range(rank)]))

    # raw fp32, a >= 1 MiB one, and an exact duplicate (dedupe)
    w32 = f32(D, D)
    inits += [nh.from_array(w32, "w32"), nh.from_array(w32.copy(), "w32_copy"), nh.from_array(f32(D, 4096), "wbig")]
    nodes += [
        h.make_node("MatMul", ["x", "w32"], ["m1"]),
        h.make_node("MatMul", ["m1", "w32_copy"], ["y_raw"]),
        h.make_node("MatMul", ["x", "wbig"], ["y_big"]),
    ]
    out("y_raw"), out("y_big")
    # fp16 and bf16 behind Cast (folded); an fp16 used by a Cast and by something else (not folded)
    inits.append(nh.from_array(f32(D, D).astype(np.float16), "w16"))
    nodes += [_cast_f("w16", "w16_f"), h.make_node("MatMul", ["x", "w16_f"], ["y_fp16"])]
    bf = (f32(D, D).view(np.uint32) >> 16).astype(np.uint16)
    t = h.make_tensor("wbf", T.BFLOAT16, [D, D], bf.tobytes(), raw=True)
    inits.append(t)
    nodes += [_cast_f("wbf", "wbf_f"), h.make_node("MatMul", ["x", "wbf_f"], ["y_bf16"])]
    inits.append(nh.from_array(f32(N, D).astype(np.float16), "mixed16"))
    nodes += [
        _cast_f("mixed16", "mixed16_f"),
        h.make_node("Cast", ["mixed16"], ["mixed16_d"], to=T.DOUBLE),
        _cast_f("mixed16_d", "mixed16_df"),
        h.make_node("Add", ["mixed16_f", "mixed16_df"], ["mix_sum"]),
        h.make_node("Add", ["x", "mix_sum"], ["y_mixed"]),
    ]
    # the same fp16 tensor behind two Casts, one of them a graph output
    inits.append(nh.from_array(f32(N, D).astype(np.float16), "two16"))
    nodes += [_cast_f("two16", "y_two_a"), _cast_f("two16", "two_b"), h.make_node("Add", ["x", "two_b"], ["y_two_b"])]
    out("y_fp16"), out("y_bf16"), out("y_mixed"), out("y_two_a"), out("y_two_b")
    # typed fields
    typed = [
        ("t_float", f32(N, D), T.FLOAT),
        ("t_fp16", f32(D, D).astype(np.float16), T.FLOAT16),
        ("t_int8", rng.integers(-128, 128, (N, D)).astype(np.int8), T.INT8),
        ("t_uint8", rng.integers(0, 256, (N, D)).astype(np.uint8), T.UINT8),
        ("t_int16", rng.integers(-30000, 30000, (N, D)).astype(np.int16), T.INT16),
        ("t_bool", rng.integers(0, 2, (N, D)).astype(bool), T.BOOL),
        ("t_int32", rng.integers(-(2**31), 2**31 - 1, (N, D)).astype(np.int32), T.INT32),
        ("t_int64", rng.integers(-(2**40), 2**40, (N, D)).astype(np.int64), T.INT64),
        ("t_double", rng.standard_normal((N, D)), T.DOUBLE),
        ("t_uint32", rng.integers(0, 2**32 - 1, (N, D), dtype=np.uint64).astype(np.uint32), T.UINT32),
        ("t_uint64", rng.integers(0, 2**63, (N, D), dtype=np.uint64), T.UINT64),
    ]
    for name, arr, dt in typed:
        inits.append(_typed(name, arr, dt))
        if name == "t_fp16":
            nodes += [_cast_f(name, f"{name}_f"), h.make_node("MatMul", ["x", f"{name}_f"], [f"y_{name}"])]
        elif dt == T.FLOAT:
            nodes.append(h.make_node("Add", ["x", name], [f"y_{name}"]))
        else:  # non-float consumers keep the tensor's own type
            nodes += [
                h.make_node("Identity", [name], [f"{name}_id"]),
                _cast_f(f"{name}_id", f"{name}_f"),
                h.make_node("Add", ["x", f"{name}_f"], [f"y_{name}"]),
            ]
        out(f"y_{name}")
    # an int64 shape tensor (stays inline) and large int64 indices (move)
    inits.append(nh.from_array(np.array([N * D], np.int64), "flat_shape"))
    inits.append(nh.from_array(rng.integers(0, D, 512).astype(np.int64), "gather_idx"))
    nodes += [
        h.make_node("Reshape", ["x", "flat_shape"], ["y_flat"]),
        h.make_node("Gather", ["x", "gather_idx"], ["y_gather"], axis=1),
    ]
    out("y_flat", 1), out("y_gather")
    # Constant nodes: fp32 value, fp16 value behind Cast, sparse_value
    nodes += [
        h.make_node("Constant", [], ["c32"], value=nh.from_array(f32(N, D), "c32v")),
        h.make_node("Add", ["x", "c32"], ["y_const"]),
        h.make_node("Constant", [], ["c16"], value=nh.from_array(f32(N, D).astype(np.float16))),
        _cast_f("c16", "c16_f"),
        h.make_node("Add", ["x", "c16_f"], ["y_const16"]),
    ]
    out("y_const"), out("y_const16")
    # If with subgraphs two levels deep, each with initializers (raw and fp16 + Cast)
    inner_then = h.make_graph(
        [h.make_node("Add", ["x", "deep_w"], ["deep_out"])],
        "inner_then",
        [],
        [h.make_tensor_value_info("deep_out", T.FLOAT, [N, D])],
        [nh.from_array(f32(N, D), "deep_w")],
    )
    inner_else = h.make_graph(
        [_cast_f("deep16", "deep16_f"), h.make_node("Mul", ["x", "deep16_f"], ["deep_out2"])],
        "inner_else",
        [],
        [h.make_tensor_value_info("deep_out2", T.FLOAT, [N, D])],
        [nh.from_array(f32(N, D).astype(np.float16), "deep16")],
    )
    then_g = h.make_graph(
        [
            h.make_node("MatMul", ["x", "then_w"], ["then_m"]),
            h.make_node("If", ["cond"], ["then_if"], then_branch=inner_then, else_branch=inner_else),
            h.make_node("Add", ["then_m", "then_if"], ["then_out"]),
        ],
        "then",
        [],
        [h.make_tensor_value_info("then_out", T.FLOAT, [N, D])],
        [nh.from_array(f32(D, D), "then_w")],
    )
    else_g = h.make_graph(
        [_cast_f("else16", "else16_f"), h.make_node("MatMul", ["x", "else16_f"], ["else_out"])],
        "else",
        [],
        [h.make_tensor_value_info("else_out", T.FLOAT, [N, D])],
        [nh.from_array(f32(D, D).astype(np.float16), "else16")],
    )
    nodes.append(h.make_node("If", ["cond"], ["y_if"], then_branch=then_g, else_branch=else_g))
    out("y_if")
    # Loop whose body holds a Constant
    body = h.make_graph(
        [
            h.make_node("Constant", [], ["loop_c"], value=nh.from_array(f32(N, D), "loop_cv")),
            h.make_node("Add", ["acc_in", "loop_c"], ["acc_out"]),
            h.make_node("Identity", ["lcond_in"], ["lcond_out"]),
        ],
        "body",
        [
            h.make_tensor_value_info("iter", T.INT64, []),
            h.make_tensor_value_info("lcond_in", T.BOOL, []),
            h.make_tensor_value_info("acc_in", T.FLOAT, [N, D]),
        ],
        [h.make_tensor_value_info("lcond_out", T.BOOL, []), h.make_tensor_value_info("acc_out", T.FLOAT, [N, D])],
    )
    inits += [nh.from_array(np.array(3, np.int64), "trip"), nh.from_array(np.array(True), "true")]
    nodes.append(h.make_node("Loop", ["trip", "true", "x"], ["y_loop"], body=body))
    out("y_loop")
    # a model-local function with a Constant inside
    fn = h.make_function(
        "local",
        "AddConst",
        ["fx"],
        ["fy"],
        [
            h.make_node("Constant", [], ["fc"], value=nh.from_array(f32(N, D), "fcv")),
            h.make_node("Add", ["fx", "fc"], ["fy"]),
        ],
        [h.make_opsetid("", 17)],
    )
    nodes.append(h.make_node("AddConst", ["x"], ["y_func"], domain="local"))
    out("y_func")
    # a tensor that is already external, in a file beside the model
    data_path = directory / "sink.data"
    data_path.unlink(missing_ok=True)
    inits.append(_external(nh.from_array(f32(D, D), "w_ext"), data_path, "sink.data"))
    nodes.append(h.make_node("MatMul", ["x", "w_ext"], ["y_ext"]))
    out("y_ext")

    graph = h.make_graph(
        nodes,
        "sink",
        [h.make_tensor_value_info("x", T.FLOAT, [N, D]), h.make_tensor_value_info("cond", T.BOOL, [])],
        outputs,
        inits,
        sparse_initializer=sparse,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("local", 1)], functions=[fn])
    model.ir_version = 8
    path = directory / "sink.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def sparse_model(directory: Path, seed: int = 0) -> Path:
    """A sparse initializer and a Constant sparse_value, each large enough to move.

    ONNX Runtime densifies sparse initializers at load; onnx's full shape inference
    rejects them as inputs of Add (sparse_tensor type), so this model only passes the
    plain checker.
    """
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: (rng.standard_normal(shape) / 8).astype(np.float32)  # noqa: E731
    sp = h.make_sparse_tensor(
        nh.from_array(f32(300), "sp"),
        nh.from_array(np.sort(rng.choice(N * D, 300, replace=False)).astype(np.int64), "sp_indices"),
        [N, D],
    )
    csp = h.make_sparse_tensor(
        nh.from_array(f32(300), "csp_values"),
        nh.from_array(np.sort(rng.choice(N * D, 300, replace=False)).astype(np.int64), "csp_indices"),
        [N, D],
    )
    nodes = [
        h.make_node("Add", ["x", "sp"], ["y_sparse"]),
        h.make_node("Constant", [], ["csp"], sparse_value=csp),
        h.make_node("Add", ["x", "csp"], ["y_const_sparse"]),
    ]
    graph = h.make_graph(
        nodes,
        "sparse",
        [h.make_tensor_value_info("x", T.FLOAT, [N, D])],
        [
            h.make_tensor_value_info("y_sparse", T.FLOAT, [N, D]),
            h.make_tensor_value_info("y_const_sparse", T.FLOAT, [N, D]),
        ],
        sparse_initializer=[sp],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    path = directory / "sparse.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def fuzz_seed_model(directory: Path, seed: int = 0) -> Path:
    """A small model (about 12 KB) with one of each payload kind, for mutation fuzzing."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: (rng.standard_normal(shape) / 8).astype(np.float32)  # noqa: E731
    data_path = directory / "fz.data"
    data_path.unlink(missing_ok=True)
    inits = [
        nh.from_array(f32(300), "raw"),
        nh.from_array(f32(300).astype(np.float16), "half"),
        _typed("i8", rng.integers(-128, 128, 300).astype(np.int8), T.INT8),
        _typed("i64", rng.integers(-9, 9, 300).astype(np.int64), T.INT64),
        _typed("fd", f32(300), T.FLOAT),
        _external(nh.from_array(f32(300), "ext"), data_path, "fz.data"),
        nh.from_array(np.array([300], np.int64), "shape"),
    ]
    sub = h.make_graph(
        [h.make_node("Add", ["x", "sub_w"], ["sub_y"])],
        "sub",
        [],
        [h.make_tensor_value_info("sub_y", T.FLOAT, [300])],
        [nh.from_array(f32(300), "sub_w")],
    )
    nodes = [
        h.make_node("Cast", ["half"], ["half_f"], to=T.FLOAT),
        h.make_node("Add", ["x", "half_f"], ["a"]),
        h.make_node("Constant", [], ["c"], value=nh.from_array(f32(300), "cv")),
        h.make_node("Add", ["a", "c"], ["b"]),
        h.make_node("If", ["cond"], ["y"], then_branch=sub, else_branch=sub),
        h.make_node("Reshape", ["b", "shape"], ["z"]),
        h.make_node("LocalF", ["z"], ["w"], domain="local"),
    ]
    fn = h.make_function(
        "local",
        "LocalF",
        ["fx"],
        ["fy"],
        [
            h.make_node("Constant", [], ["fc"], value=nh.from_array(f32(300), "fcv")),
            h.make_node("Add", ["fx", "fc"], ["fy"]),
        ],
        [h.make_opsetid("", 17)],
    )
    graph = h.make_graph(
        nodes,
        "fz",
        [h.make_tensor_value_info("x", T.FLOAT, [300]), h.make_tensor_value_info("cond", T.BOOL, [])],
        [h.make_tensor_value_info("y", T.FLOAT, [300]), h.make_tensor_value_info("w", T.FLOAT, [300])],
        inits,
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("local", 1)], functions=[fn])
    path = directory / "fz.onnx"
    path.write_bytes(model.SerializeToString())
    return path
