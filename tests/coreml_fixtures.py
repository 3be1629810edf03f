"""Small ML Program packages built in code with coremltools' MIL builder (no downloads, a few seconds in all).

Each builder returns the path of a saved .mlpackage. Weight values are seeded, so
the same call gives the same payloads (which the dedupe tests rely on).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

logging.getLogger("coremltools").setLevel(logging.ERROR)

import coremltools as ct  # noqa: E402  (after quieting its logger: it logs at import)
from coremltools.converters.mil.mil import Builder as mb  # noqa: E402
from coremltools.converters.mil.mil import types  # noqa: E402

from weightshare.formats.coreml.verify import READERS as _READERS  # noqa: E402  (coremltools reader per MIL dtype)

TARGETS = {"iOS15": ct.target.iOS15, "iOS16": ct.target.iOS16, "iOS17": ct.target.iOS17, "iOS18": ct.target.iOS18}


def _save(prog, path: Path, target, precision=None) -> Path:
    kwargs = {"compute_precision": precision} if precision is not None else {}
    model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=target, skip_model_load=True, **kwargs)
    model.save(str(path))
    return Path(path)


def weights(seed: int, shape, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def mlp(path: Path, target: str = "iOS16", seed: int = 0, hidden: int = 1024, seq: int = 1) -> Path:
    """linear -> relu -> linear; the first weight is >= 1 MiB in fp16 when hidden >= 1024 (large alignment)."""
    w1, w2 = weights(seed, (hidden, 512)), weights(seed + 1, (64, hidden))
    b1 = weights(seed + 2, (hidden,))

    @mb.program(input_specs=[mb.TensorSpec(shape=(seq, 512))], opset_version=TARGETS[target])
    def prog(x):
        y = mb.relu(x=mb.linear(x=x, weight=w1, bias=b1))
        return mb.linear(x=y, weight=w2, name="out")

    return _save(prog, path, TARGETS[target])


def nested(path: Path, seed: int = 10) -> Path:
    """Consts inside both branches of a ``cond`` and a ``while_loop`` body (nested blocks), iOS17."""
    wa, wb, wc = weights(seed, (64, 64)), weights(seed + 1, (64, 64)), weights(seed + 2, (64,))

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(1, 64)), mb.TensorSpec(shape=(1,), dtype=types.bool)],
        opset_version=ct.target.iOS17,
    )
    def prog(x, flag):
        pred = mb.squeeze(x=flag)
        y = mb.cond(pred=pred, _true_fn=lambda: mb.linear(x=x, weight=wa), _false_fn=lambda: mb.linear(x=x, weight=wb))

        def body(v, i):
            return mb.add(x=v, y=wc), mb.add(x=i, y=np.int32(1))

        def cond(v, i):
            return mb.less(x=i, y=np.int32(3))

        out, _ = mb.while_loop(_cond=cond, _body=body, loop_vars=(y, np.int32(0)))
        return mb.identity(x=out, name="out")

    return _save(prog, path, ct.target.iOS17, precision=ct.precision.FLOAT32)


def compressed(path: Path, kind: str, seed: int = 20) -> Path:
    """A model whose weights are constexpr ops: kind is e.g. 'int4', 'int8', 'lut3', 'lut6', 'sparse', 'lut2-16'.

    iOS18 kinds store sub-byte dtypes (int4, uint1..uint6) in weight.bin; 'lut2-16' and 'int8-16' use the iOS16
    constexpr ops (indices packed into uint8).
    """
    from coremltools.optimize import coreml as cto

    base = mlp(
        path.with_name(path.name + ".base.mlpackage"),
        "iOS16" if kind.endswith("-16") else "iOS18",
        seed=seed,
        hidden=256,
    )
    model = ct.models.MLModel(str(base), skip_model_load=True)
    name = kind.removesuffix("-16")
    if name in ("int4", "int8"):
        cfg = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric",
            dtype=name,
            weight_threshold=100,
            **({"granularity": "per_block", "block_size": 32} if name == "int4" else {}),
        )
        out = cto.linear_quantize_weights(model, cto.OptimizationConfig(global_config=cfg))
    elif name.startswith("lut"):
        cfg = cto.OpPalettizerConfig(mode="uniform", nbits=int(name[3:]), weight_threshold=100)
        out = cto.palettize_weights(model, cto.OptimizationConfig(global_config=cfg))
    elif name == "sparse":
        cfg = cto.OpMagnitudePrunerConfig(target_sparsity=0.5, weight_threshold=100)
        out = cto.prune_weights(model, cto.OptimizationConfig(global_config=cfg))
    else:
        raise ValueError(kind)
    out.save(str(path))
    return Path(path)


def multifunction(path: Path, sources: list[Path], names: list[str], default: str | None = None) -> Path:
    """coremltools' own save_multifunction over single-function sources."""
    desc = ct.utils.MultiFunctionDescriptor()
    for src, name in zip(sources, names):
        desc.add_function(str(src), "main", name)
    desc.default_function_name = default or names[0]
    ct.utils.save_multifunction(desc, str(path))
    return Path(path)


def odd_subbyte(path: Path, kind: str, seed: int = 30) -> Path:
    """A weight with an element count that leaves padding bits in its sub-byte payload (33 x 65 = 2145 elements)."""
    from coremltools.optimize import coreml as cto

    w = weights(seed, (33, 65))

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 65))], opset_version=ct.target.iOS18)
    def prog(x):
        return mb.linear(x=x, weight=w, name="out")

    base = _save(prog, path.with_name(path.name + ".base.mlpackage"), ct.target.iOS18)
    model = ct.models.MLModel(str(base), skip_model_load=True)
    if kind == "int4":
        cfg = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", weight_threshold=10)
        out = cto.linear_quantize_weights(model, cto.OptimizationConfig(global_config=cfg))
    else:
        cfg = cto.OpPalettizerConfig(mode="uniform", nbits=int(kind[3:]), weight_threshold=10)
        out = cto.palettize_weights(model, cto.OptimizationConfig(global_config=cfg))
    out.save(str(path))
    return Path(path)


# --- reading packages back, for assertions -------------------------------------------------------------------------

MODEL_REL = Path("Data/com.apple.CoreML/model.mlmodel")


def load_spec(pkg: Path):
    from coremltools.proto import Model_pb2

    spec = Model_pb2.Model()
    spec.ParseFromString((Path(pkg) / MODEL_REL).read_bytes())
    return spec


def blob_values(spec):
    """Every BlobFileValue of the program, in the traversal order weightshare uses."""
    from weightshare.formats.coreml.convert import iter_blob_file_values

    return list(iter_blob_file_values(spec.mlProgram))


def decode_blob(pkg: Path, bfv) -> tuple[int, bytes]:
    """(mil dtype, decoded element bytes) of one BlobFileValue, through coremltools' own blob reader."""
    from coremltools.libmilstoragepython import _BlobStorageReader

    from weightshare.formats.coreml.milblob import WeightFile

    path = Path(pkg) / "Data/com.apple.CoreML" / bfv.fileName.removeprefix("@model_path/")
    dtype = WeightFile(path).record(bfv.offset).dtype
    reader = _BlobStorageReader(str(path))
    return dtype, np.asarray(getattr(reader, _READERS[dtype])(bfv.offset)).tobytes()


def walk_records(path: Path) -> list[int]:
    """Record offsets as MILBlob's StorageReader::GetAllOffsets finds them (header count, 64-byte steps)."""
    import struct

    data = Path(path).read_bytes()
    count = struct.unpack_from("<I", data)[0]
    offsets, pos = [], 64
    for _ in range(count):
        sentinel, _dtype, size, offset = struct.unpack_from("<IIQQ", data, pos)
        assert sentinel == 0xDEADBEEF, f"walk hit a non-record at {pos}"
        offsets.append(pos)
        pos = (offset + size + 63) // 64 * 64
    return offsets


def blob_values_of(message):
    """Every BlobFileValue below one message (a Function, a Block)."""
    from weightshare.formats.coreml.convert import iter_blob_file_values

    return list(iter_blob_file_values(message))
