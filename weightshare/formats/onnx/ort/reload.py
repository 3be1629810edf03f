"""``--prepack``: the graph written must be one ONNX Runtime leaves as it is when it loads it.

The prepacked model is ORT's own optimization of the original, saved. ORT optimizes it again at every load, and
that second pass can find what the first could not: an fp16 model's Casts are explicit in the saved graph, so
constant folding turns ``Cast(fp16 scalar)`` into an fp32 scalar and MatMulScaleFusion then folds ``Mul``/``Div``
by it into ``FusedMatMul(alpha)`` (torch-dynamo fp16 decoders, ORT-optimizer fp16 ViTs: outputs differed by 0.002 to
0.006). In the original the scale was not a constant when the fusion ran, so ORT multiplied separately.

``reload_change`` lets ORT load the written graph as a session would (default level, in a bounded child, weights
above 64 KiB replaced by a sparse file of zeros so the check costs the same for any model size) and compares what it
runs with what was written (``cpu.rounding_change``). ``unfuse.unfuse_scales`` writes the form that computes the
original's bits where the fusion is MatMulScaleFusion: the scalar becomes a constant of the other operand's last
dimension, every element the same value (the same products, element by element), which the fusion does not take
(it wants a one-element constant). Anything else ORT would change is refused by the caller, naming the fusion.
"""

from __future__ import annotations

import os
from pathlib import Path

from ....errors import InvalidModel, Unsupported
from ....options import ConvertOptions
from .._proto import pb
from .cpu import _CHECK_CHILD, REAL_BYTES_MAX, _run_child, _saved_graph, add_input_like, rounding_change
from .limits import limits_for

PROBE = "reload.probe.onnx"
ZEROS = "reload.zeros.bin"
OUT = "reload.optimized.onnx"
OUT_DATA = "optimized.data"  # named by the check child, beside OUT


def _probe(model: pb.ModelProto, stage: Path) -> tuple[Path, int]:
    """A copy of ``model`` whose large external initializers map the zeros file; small ones keep their bytes
    (scales and shapes the optimizers read). Pre-packed entries are dropped (the child does not pack)."""
    probe = pb.ModelProto()
    probe.CopyFrom(model)
    from ..graph import external_tensors

    longest = 0
    for t in external_tensors(probe):
        e = {x.key: x.value for x in t.external_data}
        length = int(e.get("length", "-1"))
        if length < 0:
            length = (stage / e["location"]).stat().st_size - int(e.get("offset", "0"))
        keep = {"location": e["location"], "offset": e.get("offset", "0"), "length": str(length)}
        if length > REAL_BYTES_MAX:
            keep = {"location": ZEROS, "offset": "0", "length": str(length)}
            longest = max(longest, length)
        del t.external_data[:]
        for k, v in keep.items():
            entry = t.external_data.add()
            entry.key, entry.value = k, v
    _inputs_for_weights(probe.graph)
    with open(stage / ZEROS, "wb") as f:
        f.truncate(longest)  # a hole: no disk, mapped and never read
    path = stage / PROBE
    path.write_bytes(probe.SerializeToString())
    return path, longest


def _inputs_for_weights(graph: pb.GraphProto) -> None:
    """Large stand-ins of the main graph that no Cast reads become graph inputs of their type and shape.

    Saving the optimized graph makes ORT read every initializer it writes, and a read page of the zeros file is
    resident: the check would cost the model's size. What ORT can fuse on reload that it could not the first time
    comes from constants it did not have then, the Casts it inserted (``Cast(fp16 constant)`` folds on reload), so
    the Cast-fed stand-ins stay constants; every other large one was already a constant in the first pass, and as
    an input it can only make ORT fuse less, never more, so a difference found is one a session makes too."""
    cast_fed = {n.input[0] for n in graph.node if n.op_type == "Cast" and n.input}
    keep: list[pb.TensorProto] = []
    for t in graph.initializer:
        e = {x.key: x.value for x in t.external_data}
        if t.data_location != pb.TensorProto.EXTERNAL or e.get("location") != ZEROS or t.name in cast_fed:
            keep.append(_copy_tensor(t))
            continue
        add_input_like(graph, t)
    del graph.initializer[:]
    graph.initializer.extend(keep)


def _copy_tensor(t: pb.TensorProto) -> pb.TensorProto:
    new = pb.TensorProto()
    new.CopyFrom(t)
    return new


def reoptimized(model: pb.ModelProto, stage: Path, src: Path, options: ConvertOptions) -> pb.GraphProto:
    """The graph ORT runs when a session loads ``model`` (its external data relative to ``stage``)."""
    stage = stage.absolute()  # the child runs in it: a relative OUTDIR must not be resolved twice
    probe, _ = _probe(model, stage)
    out = stage / OUT
    limits = limits_for(
        src.stat().st_size + sum(f.stat().st_size for f in stage.iterdir() if f.is_file() and f.name != ZEROS),
        src,
        options.ort_child_timeout_s,
        options.ort_child_memory_mib,
        options.ort_max_growth,
    )
    try:
        if options.stage is not None:
            options.stage("onnxruntime loads the written graph as a session would (child process)")
        try:
            _run_child(_CHECK_CHILD, [str(probe), str(out)], [out], limits, stage, src, "load")
        except InvalidModel as e:  # ORT names the probe it loaded: an internal path, not the user's
            why = e.message.replace(f"Load model from {probe} failed:", "").replace("stage: ", "", 1)
            raise Unsupported(f"--prepack: refused: {why}; convert without --prepack", src) from None
        return _saved_graph(out, src)
    finally:
        for name in (PROBE, ZEROS, OUT, OUT_DATA):
            (stage / name).unlink(missing_ok=True)


def reload_change(model: pb.ModelProto, stage: Path, src: Path, options: ConvertOptions) -> str | None:
    """What ORT fuses when it loads ``model`` that ``model`` does not hold (None: it runs ``model`` as written)."""
    return rounding_change(model.graph, reoptimized(model, stage, src, options))


def inline_load_reads(model: pb.ModelProto, stage: Path) -> int:
    """Write back inline (from their bytes in ``stage``) the external initializers ONNX shape inference reads when
    ORT loads ``model`` (``fold.LOAD_READ_INPUTS``: a Reshape's shape, Slice's starts, Resize's scales): ORT saves
    an optimized graph with every initializer above a size external, below ``--inline-threshold`` included, and
    refuses to load what it saved. The plain conversion keeps the same tensors inline whatever the threshold
    (``convert.MAX_INLINE_SHAPE`` bounds both). How many were written back."""
    from ..convert import MAX_INLINE_SHAPE
    from ..fold import LOAD_READ_INPUTS, shape_tensor_names
    from ..graph import iter_scopes

    read = shape_tensor_names(model, LOAD_READ_INPUTS)
    count = 0
    for scope in iter_scopes(model):
        for t in getattr(scope, "initializer", ()):
            if t.name not in read or t.data_location != pb.TensorProto.EXTERNAL:
                continue
            e = {x.key: x.value for x in t.external_data}
            if set(e) - {"location", "offset", "length"} or not e.get("length", "").isdigit():
                continue  # a packed or unsized entry: left as it is, the load check refuses it if ORT does
            length, offset = int(e["length"]), int(e.get("offset", "0"))
            if length > MAX_INLINE_SHAPE:
                continue
            with open(stage / e["location"], "rb") as f:
                f.seek(offset)
                data = f.read(length)
            if len(data) != length:
                continue
            del t.external_data[:]
            t.data_location = pb.TensorProto.DEFAULT
            t.raw_data = data
            count += 1
    return count


def load_probes(models: list[tuple[pb.ModelProto, str]], stage: Path) -> tuple[list[str], list[Path]]:
    """Probes of every (model, its file name), its external data relative to ``stage`` (large weights stood in for
    as in ``reload_change``, small ones read: what ORT reads at load): ``child.load``'s arguments, and the files
    to remove once it ran (the probes and the zeros file)."""
    stage = stage.absolute()
    args: list[str] = []
    files: list[Path] = [stage / ZEROS]
    longest = 0
    for k, (model, name) in enumerate(models):
        probe, size = _probe(model, stage)
        longest = max(longest, size)
        files.append(probe.rename(stage / f"load{k}.probe.onnx"))
        args += [str(files[-1]), name]
    os.truncate(stage / ZEROS, longest)  # each probe wrote its own: the longest serves every one
    return args, files
