"""Shape-only ops of weights, folded into the blob: ``Transpose``, ``Reshape``, ``Squeeze``, ``Unsqueeze`` and
``Flatten`` of a constant weight whose shape inputs are constants.

ONNX Runtime constant-folds such a node into a new heap tensor in every session, whatever the session options:
onnxruntime-genai's Gemma2 fp32 reads its embedding as ``Transpose(lm_head.MatMul.weight)`` (the builder's tied
float embedding), and its portable model at ``session.disable_prepacking=1`` cost +63 MiB per session. Folded at
conversion, the result is a weight in the blob, shared by every session. Only the order of the elements and the
dims change, so the result is bit-exact. A weight read by nothing else is replaced by its folded form (the blob
holds what it held); a weight other nodes read as it is (a tied head) keeps its payload and the folded tensor is
a new one: a Transpose adds its size to the blob (Gemma2: the size of its embedding), a reshape adds nothing (the
same bytes, stored once by the blob's dedupe). ``ShapeFolds.added`` says what each added.

Streaming: a transposed payload is produced slab by slab of its first axis (``TransposedSource``), each slab
read from the source file by strided ``pread``s, so memory stays bounded by the slab (``SLAB_BYTES``), not by
the weight.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..._tensors import CHUNK_SIZE, FileRange, read_all
from . import dtypes
from ._proto import pb
from .graph import iter_scopes, ref_index, subgraphs

if TYPE_CHECKING:
    import numpy as np

    from .scan import RefTable

__all__ = ["SHAPE_ONLY", "Layout", "ShapeFolds", "TransposedSource", "fold_shape_ops"]

SHAPE_ONLY = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten")
SLAB_BYTES = 16 << 20  # what one slab of a transposed payload may hold in memory
# below this a constant is shape arithmetic (whatever --inline-threshold says: verify re-plans originals at 0)
FOLD_MIN_BYTES = 1024
_MAX_SHAPE_VALUES = 64  # a shape input with more values than a tensor has dims is not a shape


@dataclass(frozen=True)
class Layout:
    """How a payload's elements are rearranged: the source's dims (C order) and the permutation (output axis i
    is source axis ``perm[i]``)."""

    dims: tuple[int, ...]
    perm: tuple[int, ...]


@dataclass
class ShapeFolds:
    layouts: dict[int, Layout] = field(default_factory=dict)  # ref index -> transposition its payload gets
    dims: dict[int, tuple[int, ...]] = field(default_factory=dict)  # ref index -> the dims it is stored with
    added: dict[str, int] = field(default_factory=dict)  # folded tensor -> bytes it adds to the blob
    removed: int = 0  # nodes folded

    def note(self) -> str:
        """One line for the conversion report, "" when nothing was folded."""
        if not self.removed:
            return ""
        adds = sum(self.added.values())
        what = (
            f"; the blob holds {adds / (1 << 20):.1f} MiB more for "
            + ", ".join(f"{name!r} ({n / (1 << 20):.1f} MiB)" for name, n in list(self.added.items())[:3])
            + " (a transposed copy of a weight other nodes read as it is)"
            if adds
            else "; the blob holds nothing more"
        )
        return (
            f"{self.removed} shape-only ops of weights ({'/'.join(SHAPE_ONLY)}) folded into the blob, bit-exact: "
            f"onnxruntime no longer makes a copy of each per session{what}"
        )


def _ints(tensor: pb.TensorProto, refs: RefTable) -> list[int] | None:
    """The values of a small int64 constant (a cut payload or inline), else None."""
    if tensor.data_type != dtypes.INT64 or len(tensor.dims) > 1:
        return None
    count = math.prod(tensor.dims)
    if count > _MAX_SHAPE_VALUES:
        return None
    index = ref_index(tensor)
    if index is not None:
        raw = read_all(refs[index].native_source())
    elif tensor.raw_data:
        raw = tensor.raw_data
    else:
        return [int(v) for v in tensor.int64_data] if len(tensor.int64_data) == count else None
    if len(raw) != 8 * count:
        return None
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _attr_ints(node: pb.NodeProto, name: str) -> list[int] | None:
    a = next((a for a in node.attribute if a.name == name), None)
    if a is None:
        return None
    return [int(v) for v in a.ints] if a.ints or a.type == pb.AttributeProto.INTS else [int(a.i)]


def _out_dims(node: pb.NodeProto, dims: tuple[int, ...], shape: list[int] | None) -> tuple[int, ...] | None:
    """The dims ``node`` makes of a tensor of ``dims`` (``shape``: its constant second input), None when it
    cannot be told or is invalid (the node is then left for the runtime)."""
    rank = len(dims)
    if node.op_type == "Transpose":
        perm = _attr_ints(node, "perm") or list(range(rank))[::-1]
        return tuple(dims[p] for p in perm) if sorted(perm) == list(range(rank)) else None
    if node.op_type == "Flatten":
        axis = (_attr_ints(node, "axis") or [1])[0]
        axis += rank if axis < 0 else 0
        return (math.prod(dims[:axis]), math.prod(dims[axis:])) if 0 <= axis <= rank else None
    if node.op_type == "Reshape":
        if shape is None:
            return None
        allowzero = (_attr_ints(node, "allowzero") or [0])[0]
        out = [dims[i] if v == 0 and not allowzero and i < rank else v for i, v in enumerate(shape)]
        if out.count(-1) > 1 or any(v < -1 for v in out):
            return None
        if -1 in out:
            known = math.prod(v for v in out if v != -1)
            if not known or math.prod(dims) % known:
                return None
            out[out.index(-1)] = math.prod(dims) // known
        return tuple(out) if math.prod(out) == math.prod(dims) else None
    axes = shape if shape is not None else _attr_ints(node, "axes")
    if node.op_type == "Squeeze":
        if axes is None:
            axes = [i for i, d in enumerate(dims) if d == 1]
        axes = [a + rank if a < 0 else a for a in axes]
        if any(not 0 <= a < rank or dims[a] != 1 for a in axes):
            return None
        return tuple(d for i, d in enumerate(dims) if i not in set(axes))
    if node.op_type == "Unsqueeze" and axes is not None:
        out_rank = rank + len(axes)
        norm = {a + out_rank if a < 0 else a for a in axes}
        if len(norm) != len(axes) or any(not 0 <= a < out_rank for a in norm):
            return None
        it = iter(dims)
        return tuple(1 if i in norm else next(it) for i in range(out_rank))
    return None


class _Scope:
    """One graph's names: its initializers by name, every use (direct or in a nested subgraph), its outputs."""

    def __init__(self, graph: pb.GraphProto):
        self.graph = graph
        self.inits = {t.name: t for t in graph.initializer}
        self.protected = {v.name for v in graph.input} | {v.name for v in graph.output}
        self.uses: dict[str, int] = {}
        self.defs: dict[str, int] = {}
        self.shadowed: set[str] = set()
        for t in graph.initializer:
            self.defs[t.name] = self.defs.get(t.name, 0) + 1
        stack = [(n, True) for n in graph.node]
        while stack:
            node, direct = stack.pop()
            for name in node.input:
                if name:
                    self.uses[name] = self.uses.get(name, 0) + 1
            for out in node.output:
                if direct:
                    self.defs[out] = self.defs.get(out, 0) + 1
                else:
                    self.shadowed.add(out)
            for g in subgraphs(node):
                stack.extend((n, False) for n in g.node)
                self.shadowed.update(v.name for v in g.input)
                self.shadowed.update(t.name for t in g.initializer)
                for out_vi in g.output:
                    self.uses[out_vi.name] = self.uses.get(out_vi.name, 0) + 1


def fold_shape_ops(
    model: pb.ModelProto,
    refs: RefTable,
    folded: set[int],
    protected: frozenset[str] | set[str] = frozenset(),
    min_bytes: int = FOLD_MIN_BYTES,
) -> ShapeFolds:
    """Fold every shape-only op of a weight of ``min_bytes`` or more in every graph (see the module doc; smaller
    constants are the graph's shape arithmetic, inline and never copied to speak of); ``folded``: the ref indices
    the fp16 fold converted (a new payload made from one is converted too: added to ``folded``). Rewrites
    ``model`` and appends a row to ``refs`` for each new payload."""
    out = ShapeFolds()
    for scope in list(iter_scopes(model)):
        if isinstance(scope, pb.GraphProto) and scope.initializer:
            _fold_scope(_Scope(scope), refs, folded, protected, out, min_bytes)
    return out


def _fold_scope(
    s: _Scope, refs: RefTable, folded: set[int], protected: frozenset[str] | set[str], out: ShapeFolds, min_bytes: int
) -> None:
    graph = s.graph
    doomed: list[int] = []
    stale: set[str] = set()  # names no longer defined: their value_info goes
    for pos, node in enumerate(graph.node):
        if node.op_type not in SHAPE_ONLY or node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            continue
        name, target = (node.input[0] if node.input else ""), node.output[0]
        w = s.inits.get(name)
        index = ref_index(w) if w is not None else None
        if w is None or index is None or name in s.protected | protected or s.defs.get(name, 0) != 1:
            continue
        if not target or target in s.protected | protected or s.defs.get(target, 0) != 1 or target in s.inits:
            continue
        ref = refs[index]
        bits = dtypes.BITS.get(ref.data_type)
        if bits is None or bits % 8 or ref.typed or len(ref.parts) != 1:  # sub-byte, strings, typed fields
            continue
        if ref.nbytes_in < min_bytes or ref.recorded_digest is not None:
            continue  # small: shape arithmetic; a digest weightshare recorded: checked as stored, left as stored
        shape: list[int] | None = None
        if len(node.input) > 1 and node.input[1]:
            shape_t = s.inits.get(node.input[1])
            shape = _ints(shape_t, refs) if shape_t is not None else None
            if shape is None:
                continue
        dims = tuple(w.dims)
        new_dims = _out_dims(node, dims, shape)
        if new_dims is None:
            continue
        perm = tuple(_attr_ints(node, "perm") or list(range(len(dims)))[::-1]) if node.op_type == "Transpose" else ()
        transposes = node.op_type == "Transpose" and perm != tuple(range(len(dims)))
        if transposes and index in out.layouts:
            continue  # a transpose of a transpose: left to the runtime
        sole = s.uses.get(name, 0) == 1 and name not in s.shadowed
        if sole:  # the weight becomes its folded form: renamed, re-dimmed, its payload rearranged
            new_index = index
            w.name = target
            del w.dims[:]
            w.dims.extend(new_dims)
            s.inits[target] = s.inits.pop(name)
        else:  # a tied weight: a new payload read from the same bytes
            new_index = len(refs)
            refs.append(ref.data_type, new_dims, ref.field, ref.parts, [], target, None)
            t = graph.initializer.add()
            t.name, t.data_type, t.data_location = target, w.data_type, pb.TensorProto.EXTERNAL
            t.dims.extend(new_dims)
            entry = t.external_data.add()
            entry.key, entry.value = "weightshare.ref", str(new_index)
            s.inits[target] = t
            if index in folded:
                folded.add(new_index)
            if transposes:
                out.added[target] = dtypes.raw_nbytes(w.data_type, new_dims)
        if sole:
            stale.add(name)
        if transposes:  # the payload's bytes are in C order of the weight's current dims (a reshape moves none)
            out.layouts[new_index] = Layout(dims, perm)
        elif index in out.layouts:
            out.layouts[new_index] = out.layouts[index]
        out.dims[new_index] = new_dims
        s.defs[target] = 1
        s.uses[name] = s.uses.get(name, 0) - 1
        doomed.append(pos)
    for pos in reversed(doomed):
        del graph.node[pos]
    out.removed += len(doomed)
    if stale & {v.name for v in graph.value_info}:
        kept = [v for v in graph.value_info if v.name not in stale]
        del graph.value_info[:]
        graph.value_info.extend(kept)


class TransposedSource:
    """A payload rearranged by ``layout``, slab by slab of the output's first axis: each slab is read from
    ``base`` (one byte range of a file) by a ``pread`` per contiguous run of the source, converted elementwise
    when ``convert`` is given (fp16 -> fp32 of a folded Cast), transposed in memory and yielded. Memory: one slab
    (``SLAB_BYTES``) and its transposed copy, whatever the payload's size."""

    stable_chunks = False

    def __init__(
        self,
        base: FileRange,
        layout: Layout,
        in_itemsize: int,
        out_itemsize: int,
        convert: Callable[..., np.ndarray] | None = None,
    ):
        self.base, self.layout = base, layout
        self.in_itemsize, self.out_itemsize, self.convert = in_itemsize, out_itemsize, convert

    @property
    def nbytes(self) -> int:
        return self.base.length // self.in_itemsize * self.out_itemsize

    def chunks(self, chunk_size: int = CHUNK_SIZE) -> Iterator[memoryview]:
        import numpy as np

        dims, perm = self.layout.dims, self.layout.perm
        if not dims or math.prod(dims) == 0:
            yield from self.base.chunks(chunk_size)
            return
        axis = perm[0]  # the output's first axis is this source axis: a slab of it is contiguous in the output
        outer = math.prod(dims[:axis])  # contiguous runs of the source per slab
        inner = math.prod(dims[axis + 1 :])
        row = max(1, inner * self.out_itemsize * outer)  # output bytes of one index along the axis
        step = max(1, min(dims[axis], SLAB_BYTES // row))
        f = self.base.opened()
        try:
            for k0 in range(0, dims[axis], step):
                k1 = min(dims[axis], k0 + step)
                run = (k1 - k0) * inner * self.in_itemsize
                slab = bytearray(outer * run)
                view = memoryview(slab)
                for o in range(outer):
                    pos = self.base.offset + (o * dims[axis] + k0) * inner * self.in_itemsize
                    got = os.preadv(f.fd, [view[o * run : (o + 1) * run]], pos)
                    if got != run:
                        from ...errors import InvalidModel

                        raise InvalidModel(f"file ended early at offset {pos + max(got, 0)}", self.base.path)
                item = np.dtype(f"V{self.out_itemsize}")  # raw elements: any dtype, bits untouched
                if self.convert is None:
                    values = np.frombuffer(slab, item)
                else:
                    values = np.asarray(self.convert(memoryview(slab))).view(item)
                shaped = values.reshape(dims[:axis] + (k1 - k0,) + dims[axis + 1 :])
                yield np.ascontiguousarray(shaped.transpose(perm)).reshape(-1).view(np.uint8).data
        finally:
            if f is not self.base.file:
                f.close()
