"""Structure-aware fuzzing: mutate fields of a parsed model, re-serialise, convert, compare runtime outputs.

Byte mutation (fuzz_harness.py) mostly produces files no parser accepts; this mutates *valid* structure
(dims, data types, names, attributes, node inputs, external data entries, fp16 payload bits) so that many
inputs still parse, many still run, and the converter's graph logic is what gets exercised. For each input:

- the original runs in the runtime (ORT CPU / LiteRT builtin kernels, the reference path) in a worker
  process, so that a runtime crash on a hostile model counts as "original does not run", not as ours;
- weightshare converts it: a WeightshareError must be one line naming a file and leave OUTDIR empty,
  any other exception is an internal error;
- when both the original ran and the conversion succeeded, the converted model must run and give
  byte-identical outputs (dtype, shape, ``.tobytes()``).
"""

from __future__ import annotations

import copy
import multiprocessing
import random
import shutil
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from weightshare import api
from weightshare.errors import WeightshareError
from weightshare.options import ConvertOptions

# ---------------------------------------------------------------- running models (in the worker process)

_NP = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
    "tensor(int16)": np.int16,
}


def _feed(dtype, shape, rng: np.random.Generator) -> np.ndarray:
    shape = [d if isinstance(d, int) and 0 <= d <= 4096 else 1 for d in (shape or [])]
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-3, 4, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def _outputs(values) -> list[tuple[str, tuple, bytes]]:
    return [(str(np.asarray(v).dtype), tuple(np.asarray(v).shape), np.ascontiguousarray(v).tobytes()) for v in values]


def run_onnx(path: str, config: dict[str, str] | None = None) -> list:
    import onnxruntime as ort

    so = ort.SessionOptions()
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    so.log_severity_level = 4
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    feeds = {}
    for i in sess.get_inputs():
        if i.type not in _NP:
            raise ValueError(f"input type {i.type}")
        feeds[i.name] = _feed(_NP[i.type], i.shape, rng)
    return _outputs(sess.run(None, feeds))


def run_tflite(path: str) -> list:
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    it = Interpreter(model_path=path, experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    rng = np.random.default_rng(7)
    out = []
    signatures = it.get_signature_list()
    if not signatures:
        it.allocate_tensors()
        for d in it.get_input_details():
            it.set_tensor(d["index"], _feed(d["dtype"], list(d["shape"]), rng))
        it.invoke()
        return _outputs(it.get_tensor(d["index"]) for d in it.get_output_details())
    for key in sorted(signatures):
        runner = it.get_signature_runner(key)
        feeds = {name: _feed(d["dtype"], list(d["shape"]), rng) for name, d in runner.get_input_details().items()}
        result = runner(**feeds)
        out += _outputs(result[k] for k in sorted(result))
    return out


def run_compiled(path: str, helper: bool) -> list:
    """Every signature under XNNPACK (LiteRT's CompiledModel, CPU); ``helper``: through
    ``weightshare.litert.compiled_model``, which must have found and used the model's cache."""
    from ai_edge_litert.compiled_model import CompiledModel

    if helper:
        from weightshare.litert import compiled_model

        cm = compiled_model(path)
        if cm.weightshare_cache is None:
            raise ValueError("the helper did not use the --prepack cache")
    else:
        cm = CompiledModel.from_file(path)
    rng = np.random.default_rng(7)
    out = []
    for key in sorted(cm.get_signature_list()):
        idx = cm.get_signature_index(key)
        sig = cm.get_signature_list()[key]
        ins, outs = cm.create_input_buffers(idx), cm.create_output_buffers(idx)
        details = cm.get_input_tensor_details(key)
        for name, buf in zip(sig["inputs"], ins):
            buf.write(_feed(details[name]["dtype"], list(details[name]["shape"]), rng))
        cm.run_by_index(idx, ins, outs)
        od = cm.get_output_tensor_details(key)
        out += _outputs(
            buf.read(int(np.prod(od[n]["shape"])), od[n]["dtype"]).reshape(od[n]["shape"])
            for n, buf in zip(sig["outputs"], outs)
        )
    return out


def run_model(fmt: str, path: str, config: dict[str, str] | None = None):
    """("ok", outputs) or ("fail", message): the runtime refused or failed the model."""
    try:
        if fmt == "tflite-xnnpack":
            return "ok", run_compiled(path, bool(config))
        return "ok", run_onnx(path, config) if fmt == "onnx" else run_tflite(path)
    except Exception as e:  # the runtime's verdict on a hostile model, whatever its type
        return "fail", f"{type(e).__name__}: {str(e)[:200]}"


class Runner:
    """Runs models in a worker process; a crash (segfault) of the runtime restarts the worker."""

    def __init__(self):
        self._ctx = multiprocessing.get_context("spawn")
        self._pool = None

    def run(self, fmt: str, path: Path, timeout: float = 60, config: dict[str, str] | None = None):
        if self._pool is None:
            self._pool = ProcessPoolExecutor(1, mp_context=self._ctx)
        try:
            return self._pool.submit(run_model, fmt, str(path), config).result(timeout)
        except (BrokenProcessPool, TimeoutError) as e:
            self.close()
            return "crash", type(e).__name__

    def close(self) -> None:
        if self._pool is not None:
            for p in list(getattr(self._pool, "_processes", {}).values()):
                p.kill()  # only the worker this Runner started
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


# ---------------------------------------------------------------- ONNX mutations

EXT_VALUES = (
    "+16",
    " 16",
    "16 ",
    "16_384",
    "\u0661\u0666",
    "0x10",
    "-1",
    "",
    "1e3",
    "00016",
    "16.0",
    str(1 << 63),
    str(1 << 64),
    "0",
    "4",
    "\uff11\uff16",
)


def _onnx_parts(model):
    from weightshare.formats.onnx.graph import iter_scopes, subgraphs  # noqa: F401

    scopes = list(iter_scopes(model))
    tensors, nodes, names = [], [], set()
    for scope in scopes:
        if hasattr(scope, "initializer"):
            tensors += [(scope, t) for t in scope.initializer]
            names.update(t.name for t in scope.initializer)
            names.update(v.name for v in (*scope.input, *scope.output))
        for node in scope.node:
            nodes.append((scope, node))
            names.update(node.input)
            names.update(node.output)
            for a in node.attribute:
                if a.HasField("t"):
                    tensors.append((scope, a.t))
    return scopes, tensors, nodes, sorted(n for n in names if n)


def _special_fp16(rng: random.Random, n: int) -> bytes:
    pool = [0x7C01, 0x7D55, 0xFC01, 0x7E00, 0x7E01, 0x7C00, 0xFC00, 0x8000, 0x0000, 0x0001, 0x83FF, 0x3C00]
    return np.array([rng.choice(pool) for _ in range(n)], np.uint16).tobytes()


def mutate_onnx(model, rng: random.Random, data_files: list[str]) -> str:
    """Apply one structural mutation in place; return its name."""
    import onnx
    from onnx import TensorProto as TP

    scopes, tensors, nodes, names = _onnx_parts(model)
    kind = rng.choice(
        (
            "dims",
            "dtype",
            "tensor-name",
            "node-input",
            "node-output",
            "drop-node",
            "dup-node",
            "attr",
            "external",
            "fp16-cast",
            "fp16-bits",
            "graph-output",
            "dup-tensor",
            "opset",
            "cast-to",
        )
    )
    pick_name = lambda: rng.choice(names + ["", "fresh"]) if names else "fresh"  # noqa: E731
    if kind in ("dims", "dtype", "tensor-name", "external", "dup-tensor") and tensors:
        scope, t = rng.choice(tensors)
        external = [(s, x) for s, x in tensors if x.external_data]
        if kind == "external" and external and rng.random() < 0.7:  # the seeds hold few external tensors
            scope, t = rng.choice(external)
        if kind == "dims":
            if t.dims and rng.random() < 0.8:
                i = rng.randrange(len(t.dims))
                t.dims[i] = rng.choice((0, 1, t.dims[i] + 1, max(0, t.dims[i] - 1), t.dims[i] * 2, 1 << 31))
            else:
                t.dims.append(rng.choice((1, 2, 0)))
        elif kind == "dtype":
            t.data_type = rng.choice(
                (
                    TP.FLOAT16,
                    TP.BFLOAT16,
                    TP.FLOAT,
                    TP.INT8,
                    TP.UINT8,
                    TP.INT64,
                    TP.DOUBLE,
                    TP.STRING,
                    TP.BOOL,
                    TP.INT4,
                    rng.randrange(0, 30),
                )
            )
        elif kind == "tensor-name":
            t.name = pick_name()
        elif kind == "dup-tensor" and hasattr(scope, "initializer"):
            scope.initializer.append(copy.deepcopy(t))
        elif kind == "external":
            if t.data_location != TP.EXTERNAL and data_files and rng.random() < 0.4:
                t.ClearField("raw_data")
                t.data_location = TP.EXTERNAL
                for k, v in (("location", rng.choice(data_files)), ("offset", "0"), ("length", "1200")):
                    e = t.external_data.add()
                    e.key, e.value = k, v
            elif t.external_data:
                e = rng.choice(list(t.external_data))
                if rng.random() < 0.15:
                    e.key = rng.choice(("offset", "length", "location", "checksum", "junk"))
                else:
                    e.value = (
                        rng.choice(EXT_VALUES)
                        if e.key != "location"
                        else rng.choice(("../x", "/etc/passwd", "", "missing.data", *data_files))
                    )
            else:
                return "external(none)"
        return kind
    if kind in ("node-input", "node-output", "drop-node", "dup-node", "attr", "cast-to") and nodes:
        scope, node = rng.choice(nodes)
        if kind == "node-input":
            if node.input and rng.random() < 0.8:
                node.input[rng.randrange(len(node.input))] = pick_name()
            else:
                node.input.append(pick_name())
        elif kind == "node-output":
            if node.output and rng.random() < 0.7:
                node.output[rng.randrange(len(node.output))] = pick_name()
            elif node.output and rng.random() < 0.5:
                del node.output[:]
            else:
                node.output.append(pick_name())
        elif kind == "drop-node":
            for i, n in enumerate(scope.node):
                if n is node or n == node:
                    del scope.node[i]
                    break
        elif kind == "dup-node":
            scope.node.append(copy.deepcopy(node))
        elif kind == "attr" and node.attribute:
            a = rng.choice(list(node.attribute))
            if a.type == onnx.AttributeProto.INT:
                a.i = rng.choice((0, 1, -1, a.i + 1, TP.FLOAT, TP.FLOAT16, TP.BFLOAT16, 1 << 40))
            elif a.type == onnx.AttributeProto.FLOAT:
                a.f = rng.choice((0.0, -1.0, float("nan"), 1e30))
            elif a.type == onnx.AttributeProto.TENSOR and a.t.dims:
                a.t.dims[0] = rng.choice((0, 1, a.t.dims[0] + 1))
            else:
                a.name = rng.choice(("value", "to", "axis", "junk"))
        elif kind == "cast-to":  # retarget a Cast, or make any node a Cast
            node.op_type = "Cast"
            del node.attribute[:]
            node.attribute.append(onnx.helper.make_attribute("to", rng.choice((TP.FLOAT, TP.FLOAT16, TP.INT32))))
        return kind
    if kind in ("fp16-cast", "fp16-bits"):
        return _fp16_mutation(model, rng, kind, tensors, scopes)
    if kind == "graph-output":
        g = model.graph
        if g.output and rng.random() < 0.5:
            del g.output[rng.randrange(len(g.output))]
        else:
            g.output.append(onnx.helper.make_tensor_value_info(pick_name(), TP.FLOAT, None))
        return kind
    if kind == "opset" and model.opset_import:
        model.opset_import[0].version = rng.choice((1, 7, 13, 17, 19, 21, 99))
        return kind
    return f"{kind}(n/a)"


def _fp16_mutation(model, rng, kind, tensors, scopes) -> str:
    """Exercise the fold: an fp32 initializer becomes fp16 + Cast (values or special bit patterns)."""
    from onnx import TensorProto as TP
    from onnx import helper

    if kind == "fp16-bits":
        halves = [(s, t) for s, t in tensors if t.data_type == TP.FLOAT16 and t.raw_data]
        if not halves:
            return "fp16-bits(n/a)"
        _, t = rng.choice(halves)
        t.raw_data = _special_fp16(rng, len(t.raw_data) // 2)
        return kind
    graphs = [
        s
        for s in scopes
        if hasattr(s, "initializer") and any(t.data_type == TP.FLOAT and t.raw_data for t in s.initializer)
    ]
    if not graphs:
        return "fp16-cast(n/a)"
    g = rng.choice(graphs)
    t = rng.choice([t for t in g.initializer if t.data_type == TP.FLOAT and t.raw_data])
    values = np.frombuffer(t.raw_data[: len(t.raw_data) // 4 * 4], "<f4").astype("<f2")  # dims may lie already
    half = helper.make_tensor(t.name + "_h", TP.FLOAT16, list(t.dims), values.tobytes(), raw=True)
    if rng.random() < 0.3:
        half.raw_data = _special_fp16(rng, values.size)
    name = t.name
    for i, x in enumerate(g.initializer):
        if x.name == name:
            del g.initializer[i]
            break
    g.initializer.append(half)
    g.node.insert(0, helper.make_node("Cast", [name + "_h"], [name], to=rng.choice((TP.FLOAT,) * 5 + (TP.DOUBLE,))))
    return kind


# ---------------------------------------------------------------- TFLite mutations


def mutate_tflite(m, rng: random.Random) -> str:
    from ai_edge_litert import schema_py_generated as s

    tensors = [t for g in (m.subgraphs or []) for t in (g.tensors or [])]
    ops = [op for g in (m.subgraphs or []) for op in (g.operators or [])]
    buffers = m.buffers or []
    kind = rng.choice(
        (
            "shape",
            "type",
            "buffer",
            "buffer-data",
            "op-input",
            "op-output",
            "opcode",
            "fp16-bits",
            "buffer-offset",
            "quant",
            "drop-op",
            "dup-buffer",
        )
    )
    if kind in ("shape", "type", "buffer", "quant") and tensors:
        t = rng.choice(tensors)
        if kind == "shape":
            shape = [int(v) for v in (t.shape if t.shape is not None else [])]  # Python ints: no int32 overflow
            if shape and rng.random() < 0.8:
                i = rng.randrange(len(shape))
                shape[i] = max(-1, min(rng.choice((0, 1, -1, shape[i] + 1, shape[i] * 2, 1 << 30)), (1 << 31) - 1))
            else:
                shape.append(rng.choice((1, 2)))
            t.shape = np.array(shape, np.int32)
        elif kind == "type":
            t.type = rng.choice(
                (
                    s.TensorType.FLOAT16,
                    s.TensorType.FLOAT32,
                    s.TensorType.INT8,
                    s.TensorType.INT32,
                    s.TensorType.UINT8,
                    s.TensorType.INT64,
                    rng.randrange(0, 20),
                )
            )
        elif kind == "buffer":
            t.buffer = rng.randrange(0, len(buffers) + 2)
        else:
            t.quantization = (
                None
                if rng.random() < 0.5
                else s.QuantizationParametersT(
                    scale=np.array([rng.choice((0.5, 0.0, float("nan")))], np.float32),
                    zeroPoint=np.array([0], np.int64),
                )
            )
        return kind
    if kind in ("buffer-data", "buffer-offset", "fp16-bits", "dup-buffer") and len(buffers) > 1:
        b = rng.choice(buffers[1:])
        if kind == "buffer-data":
            data = np.asarray(b.data if b.data is not None else [], np.uint8)
            b.data = rng.choice((data[: len(data) // 2], np.concatenate([data, data[:8]]), None, data[:0]))
        elif kind == "buffer-offset":
            b.offset, b.size = rng.choice(((1 << 20, 16), (16, 1 << 40), (0, 0), (8, 8)))
        elif kind == "dup-buffer":
            m.buffers.append(copy.deepcopy(b))
        else:
            fp16 = [
                t
                for t in tensors
                if t.type == s.TensorType.FLOAT16 and 0 < t.buffer < len(buffers) and buffers[t.buffer].data is not None
            ]
            if not fp16:
                return "fp16-bits(n/a)"
            buf = buffers[rng.choice(fp16).buffer]
            buf.data = np.frombuffer(_special_fp16(rng, len(buf.data) // 2), np.uint8).copy()
        return kind
    if kind in ("op-input", "op-output", "opcode", "drop-op") and ops:
        op = rng.choice(ops)
        if kind == "op-input" and op.inputs is not None and len(op.inputs):
            ins = list(op.inputs)
            ins[rng.randrange(len(ins))] = rng.randrange(-1, len(tensors) + 1)
            op.inputs = np.array(ins, np.int32)
        elif kind == "op-output" and op.outputs is not None and len(op.outputs):
            outs = list(op.outputs)
            outs[rng.randrange(len(outs))] = rng.randrange(0, len(tensors) + 1)
            op.outputs = np.array(outs, np.int32)
        elif kind == "opcode":
            op.opcodeIndex = rng.randrange(0, len(m.operatorCodes or []) + 1)
        elif kind == "drop-op":
            for g in m.subgraphs:
                if g.operators and op in g.operators:
                    g.operators.remove(op)
        return kind
    return f"{kind}(n/a)"


# ---------------------------------------------------------------- the loop


@dataclass
class StructStats:
    inputs: int = 0
    unserialisable: int = 0
    converted: int = 0
    rejected: int = 0
    internal_errors: int = 0
    original_ran: int = 0
    compared: int = 0
    mismatches: int = 0
    unset_reads: int = 0
    kinds: dict = field(default_factory=dict)

    def line(self, fmt: str) -> str:
        return (
            f"{fmt}: {self.inputs} inputs ({self.unserialisable} unserialisable), {self.converted} converted, "
            f"{self.rejected} rejected, {self.internal_errors} internal errors; original ran {self.original_ran}, "
            f"outputs compared {self.compared}, mismatches {self.mismatches}"
            + (f" (not compared: {self.unset_reads} read unset tensors)" if self.unset_reads else "")
        )


class Finding(Exception):
    """A broken invariant: internal error, multi-line or file-less message, leftovers, or an output mismatch."""


def load_seed(fmt: str, path: Path):
    if fmt == "onnx":
        import onnx

        return onnx.load(path, load_external_data=False)
    from ai_edge_litert import schema_py_generated as s

    return s.ModelT.InitFromPackedBuf(path.read_bytes(), 0)


def serialise(fmt: str, model) -> bytes:
    if fmt == "onnx":
        return model.SerializeToString()
    import flatbuffers

    b = flatbuffers.Builder(1 << 16)
    b.Finish(model.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def one_input(
    fmt: str,
    seed_model,
    name: str,
    rng: random.Random,
    work: Path,
    extra: dict[str, bytes],
    runner: Runner,
    stats: StructStats,
    mode: str = "plain",
) -> None:
    """Mutate, convert and compare once; raise Finding on a broken invariant.

    ``mode`` (ONNX): "plain", "prepack" (``--prepack``: the prepacked model at default options against the
    original at default options, and the portable one under disable_prepacking against the original under it)
    or "ort-cpu" (``--unpack ort-cpu``: both settings against the original)."""
    model = copy.deepcopy(seed_model)
    kinds = []
    stats.inputs += 1
    try:
        for _ in range(rng.choice((1, 1, 2, 3))):
            kinds.append(mutate_onnx(model, rng, sorted(extra)) if fmt == "onnx" else mutate_tflite(model, rng))
        data = serialise(fmt, model)
    except Exception:  # the mutated value does not fit its field (e.g. a negative uint): nothing to test
        stats.unserialisable += 1
        return
    kind = "+".join(kinds)
    stats.kinds[kinds[0]] = stats.kinds.get(kinds[0], 0) + 1
    src_dir, out = work / "in", work / "out"
    shutil.rmtree(work, ignore_errors=True)
    src_dir.mkdir(parents=True)
    for rel, content in extra.items():
        (src_dir / rel).write_bytes(content)
    src = src_dir / name
    src.write_bytes(data)
    try:
        api.convert(src, out, MODES[mode])
        converted = True
        stats.converted += 1
    except WeightshareError as e:
        stats.rejected += 1
        line = e.line()
        left = sorted(p.name for p in out.iterdir()) if out.exists() else []
        if "\n" in line or not e.path or left or "internal error" in line:
            raise Finding(f"{kind}: bad rejection {line!r}, left behind {left}") from None
        converted = False
    except Exception as e:
        stats.internal_errors += 1
        raise Finding(f"{kind}: internal error {type(e).__name__}: {e}\n{traceback.format_exc()}") from None
    if fmt == "tflite" and tflite_reads_unset(model):
        if runner.run(fmt, src)[0] == "ok":
            stats.unset_reads += 1  # the original computes with whatever memory held: nothing to compare
        return
    ran = False
    for converted_name, config in _comparisons(fmt, name, mode):
        if fmt == "tflite" and mode == "prepack":  # XNNPACK without a cache vs the helper with the cache
            status, before = runner.run("tflite-xnnpack", src)
            if status == "ok":
                ran = True
                if converted:
                    status_after, after = runner.run("tflite-xnnpack", out / name, config={"helper": "1"})
                    stats.compared += 1
                    if status_after != "ok" or after != before:
                        stats.mismatches += 1
                        why = after if status_after != "ok" else _first_difference(before, after)
                        raise Finding(f"{kind}: original ran under XNNPACK, converted+cache {status_after}: {why}")
            continue
        status, before = runner.run(fmt, src, config=config)
        if status != "ok":
            continue
        ran = True
        if not converted:
            continue
        status_after, after = runner.run(fmt, out / converted_name, config=config)
        stats.compared += 1
        if status_after != "ok" or after != before:
            stats.mismatches += 1
            why = after if status_after != "ok" else _first_difference(before, after)
            raise Finding(f"{kind}: original ran, converted {converted_name} {config or ''} {status_after}: {why}")
    stats.original_ran += ran


OFF = {"session.disable_prepacking": "1"}
MODES = {
    "plain": None,
    "prepack": ConvertOptions(prepack=True),  # ONNX: ORT prepacking; TFLite: the XNNPACK weight cache
    "ort-cpu": ConvertOptions(unpack=frozenset({"ort-cpu"})),
}


def _comparisons(fmt: str, name: str, mode: str) -> list[tuple[str, dict[str, str] | None]]:
    """(converted file, session config) pairs to compare with the original under the same config."""
    if fmt != "onnx" or mode == "plain":
        return [(name, None)]
    if mode == "prepack":
        from weightshare.formats.onnx.ort.prepack import portable_name

        return [(name, None), (portable_name(name), OFF)]
    return [(name, None), (name, OFF)]


def tflite_reads_unset(m) -> bool:
    """Whether an operator reads a tensor nothing has set: no buffer data, not an input, not yet produced.

    LiteRT runs such a model and computes with whatever the arena held, so two runs of the same file can
    differ; comparing them would report noise.
    """
    buffers = m.buffers or []
    for g in m.subgraphs or []:
        tensors = g.tensors or []
        ready = {int(i) for i in (g.inputs if g.inputs is not None else [])}
        for i, t in enumerate(tensors):
            b = buffers[t.buffer] if 0 <= t.buffer < len(buffers) else None
            if t.isVariable or (b is not None and (b.data is not None and len(b.data) or b.offset > 1)):
                ready.add(i)
        for op in g.operators or []:
            if any(int(i) >= 0 and int(i) not in ready for i in (op.inputs if op.inputs is not None else [])):
                return True
            ready.update(int(o) for o in (op.outputs if op.outputs is not None else []))
        if any(int(o) not in ready for o in (g.outputs if g.outputs is not None else [])):
            return True  # a graph output nothing writes (e.g. its producer dropped): the arena's leftovers
    return False


def _first_difference(before, after) -> str:
    if len(before) != len(after):
        return f"{len(before)} outputs vs {len(after)}"
    for i, (a, b) in enumerate(zip(before, after)):
        if a != b:
            return f"output {i}: {a[0]}{list(a[1])} vs {b[0]}{list(b[1])}, bytes equal: {a[2] == b[2]}"
    return "?"


def tflite_concat_seed(path: Path, n: int = 1000) -> Path:
    """fp16 constant -> DEQUANTIZE -> CONCATENATION with the input: the dequantized bits reach the output
    untouched (no arithmetic to quiet a NaN), so a fold that changes any bit shows."""
    from ai_edge_litert import schema_py_generated as s
    from tflite_fixtures import OP, ModelBuilder

    mb = ModelBuilder()
    g = mb.subgraph("main")
    x = g.input("x", [4])
    w = g.dequantize("w", np.random.default_rng(3).standard_normal(n).astype(np.float16))
    y = g.tensor("y", [4 + n], "float32")
    g.op(OP.CONCATENATION, [x, w], [y], s.BuiltinOptions.ConcatenationOptions, s.ConcatenationOptionsT(axis=0))
    g.outputs = [y]
    mb.signature("serving_default", g)
    return mb.save(path)


def seeds(fmt: str, d: Path, mode: str = "plain") -> list[tuple[str, object, dict[str, bytes]]]:
    """(file name, parsed seed model, extra files next to it) per seed; ``mode`` adds seeds that exercise it
    (prepack: MatMul + Gemm + Conv; ort-cpu: the same with fp16 weights fed straight to the ops)."""
    if fmt == "onnx" and mode != "plain":
        (d / "plain").mkdir(parents=True)
        return _mode_seeds(d, mode) + seeds(fmt, d / "plain")
    if fmt == "onnx":
        from onnx_fixtures import fuzz_seed_model, kitchen_sink

        out = []
        for build in (fuzz_seed_model, kitchen_sink):
            sub = d / build.__name__
            sub.mkdir()
            m = build(sub)
            extra = {p.name: p.read_bytes() for p in sub.iterdir() if p.suffix == ".data"}
            out.append((m.name, load_seed(fmt, m), extra))
        return out
    from tflite_fixtures import sample_model

    d.mkdir(parents=True, exist_ok=True)
    if mode == "prepack":  # CONV_2D / FULLY_CONNECTED, fp32 and fp16+DEQUANTIZE: what --prepack packs
        return [(p.name, load_seed(fmt, p), {}) for p in (sample_model(d / "m.tflite", fc_out=64),)]
    return [
        (p.name, load_seed(fmt, p), {})
        for p in (sample_model(d / "m.tflite", fc_out=64), tflite_concat_seed(d / "c.tflite"))
    ]


def _mode_seeds(d: Path, mode: str) -> list[tuple[str, object, dict[str, bytes]]]:
    import warnings

    import onnx
    from onnxconverter_common import float16
    from prepack_samples import mixed_onnx

    d.mkdir(parents=True, exist_ok=True)
    m = mixed_onnx(d / "mixed.onnx", conv_layers=1, channels=8, mm_layers=2, dim=16)
    model = onnx.load(str(m))  # weights inline: the mutations reach them
    if mode == "ort-cpu":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = float16.convert_float_to_float16(model, keep_io_types=True)
    return [("mixed.onnx", model, {})]
