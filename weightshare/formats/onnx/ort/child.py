"""Runs in a child process: let ONNX Runtime optimize and pre-pack a converted model and save the result.

    python -m weightshare.formats.onnx.ort.child MODEL OUT_MODEL MIN_EXTERNAL_BYTES SEGMENT_BYTES

1. ONNX Runtime writes OUT_MODEL, the ORT_ENABLE_ALL optimized graph (NCHWc Conv weights included),
   with its initializers in files next to it, pre-packing off. A graph with more than SEGMENT_BYTES
   of weights is optimized segment by segment and stitched (``segments``), so that memory does
   not grow with the model.
2. Each weight-bearing node of that graph runs alone in a session that saves its pre-packed copies
   (``session.save_external_prepacked_constant_initializers``) to ``node<i>.packed.bin``.
The last stdout line is JSON: what the packed data is bound to, and the ``prepacked_N`` entries per
initializer. A child process because ORT's heap must not stay in the converter's process, and so
that its peak RSS can be measured on its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO

import onnx

from ...._placement import AlignPolicy, align_up
from .names import LOAD, LoadRefused, apply_saved_hook, unknown_entries, unknown_entry_message
from .probe import cpu_features, cpu_kind, nchwc_block_size, opset_stamp


@dataclass
class SessionCount:
    """The ORT sessions this process created to optimize and pack (``optimize``, ``_pack_node``)."""

    count: int = 0


SESSIONS = SessionCount()


@dataclass
class Target:
    """Where the child puts the bytes it keeps when the parent writes the final blob in place of the staged one
    (``prepack``): ORT's packed copies and the initializers it changed are appended to the staged blob itself,
    each at the offset the blob's writer would give it (``policy``), so that they are written once; ORT's own
    files (a session's copy of every weight it saves, then its packed copies) go to ``scratch``, a directory of
    the staging linked to a memory-backed file system, and each is removed once settled: one segment's, one
    window's or one node's at a time, never the model's (the whole graph's one session keeps the disk)."""

    blob: str  # the staged blob's name in the staging
    policy: AlignPolicy
    scratch: str = ""  # the scratch link's name in the staging ("": none, ORT's files stay in the staging)
    stage: str = ""
    copy_reused: bool = False  # a packing an earlier model made is copied in too (the final blob is this one)
    scratch_peak: int = 0  # the most bytes the scratch held after a session
    # the parent's digests of the staged blob's payloads (offset, length, hex digest of kind DIGEST): the bytes the
    # writer hashed as it staged them, not read and hashed again here for the cut checks and the packing keys
    digests: tuple[tuple[int, int, str], ...] = ()
    # packings an earlier model made, copied in (``_reuse``): [offset here, length, their file, offset there]
    copies: list[list[Any]] = field(default_factory=list)

    @classmethod
    def from_env(cls, stage: str) -> Target | None:
        from .limits import TARGET_ENV

        doc = json.loads(os.environ.get(TARGET_ENV, "") or "null")
        if not isinstance(doc, dict):
            return None
        policy = AlignPolicy.parse(doc.get("align"))
        if policy is None or not isinstance(doc.get("blob"), str):
            return None
        digests = doc.get("digests")
        known = tuple(
            (d[0], d[1], d[2])
            for d in (digests if isinstance(digests, list) else [])
            if isinstance(d, list) and len(d) == 3 and [type(x) for x in d] == [int, int, str]
        )
        return cls(doc["blob"], policy, str(doc.get("scratch") or ""), stage, bool(doc.get("copy_reused")), 0, known)

    def scratch_name(self, bin_name: str) -> str:
        return f"{self.scratch}/{bin_name}" if self.scratch else bin_name

    def append_at(self, out: BinaryIO, nbytes: int, min_align: int = 0) -> int:
        """Move ``out`` (the staged blob, opened to append) to where the next payload of ``nbytes`` goes."""
        out.flush()
        end = out.seek(0, 2)
        at = align_up(end, max(self.policy.for_size(nbytes), min_align))
        if at > end:
            os.ftruncate(out.fileno(), at)  # the gap a hole: the final blob's padding entry covers it
            out.seek(at)
        return at

    def sample(self, drop: str = "") -> None:
        """Record what the scratch holds now; then remove its files whose names contain ``drop`` (a window's)."""
        if not self.scratch:
            return
        where = os.path.join(self.stage, self.scratch)
        held = 0
        for entry in os.scandir(where):
            held += entry.stat().st_blocks * 512
        self.scratch_peak = max(self.scratch_peak, held)
        if drop:
            for entry in os.scandir(where):
                if drop in entry.name:
                    os.unlink(entry.path)


def optimize(
    model: str, out_model: str, bin_name: str, min_external: str, prepack: bool = False, referenced: bool = False
) -> None:
    """The level-ALL graph (fusions, NCHWc Conv weights) of ``model``, without pre-packing.

    With pre-packing off ORT holds only the reordered Conv weights (1x, plus ~3x the Conv weight it
    is reordering, measured); the rest streams from the mapped file to BIN (156 MiB peak RSS for a
    1 GiB MatMul model). Conv-heavy graphs therefore go through ``optimize_bounded`` in segments.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    # one thread: a session that only optimizes and saves runs no kernel on its pool (constant folding runs without
    # one), and a pool of idle spinning threads cost more CPU than the saving (measured: 0.1-0.3 s per decoder family)
    so.intra_op_num_threads = 1
    # The default level: what a user's plain InferenceSession(path) runs, NCHWc included.
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = out_model
    if prepack:  # a segment: its packed copies saved by the session that optimizes it (bounded by the segment)
        so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    else:
        so.add_session_config_entry("session.disable_prepacking", "1")
    if not referenced:  # else unchanged external initializers are saved as their references, the rest inline
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", bin_name)
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", min_external)
    so.log_severity_level = 3  # ORT warns that a level-ALL graph is hardware-specific: we record that instead
    SESSIONS.count += 1
    ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _one_node_model(
    node: onnx.NodeProto, graph: onnx.ModelProto, inits: dict[str, onnx.TensorProto], types: Mapping[str, int]
) -> onnx.ModelProto | str:
    """``node`` alone, its constant inputs as (external) initializers, the others as inputs of the
    types ORT's schemas give them in the graph (``types``: those seen in the node's scope); or why it cannot be
    built."""
    from onnx import helper as h

    from .types import node_types

    opsets = {o.domain or "": o.version for o in graph.opset_import}
    known = {i: inits[i].data_type if i in inits else types[i] for i in node.input if i in inits or i in types}
    ins, outs = node_types(node, opsets, known)
    loose = [i for i in dict.fromkeys(node.input) if i and i not in inits]
    untyped = [i for i in loose if i not in ins]
    if untyped:
        return f"type of input {untyped[0]!r} unknown"
    inputs = [h.make_tensor_value_info(i, ins[i], None) for i in loose]
    outputs = [
        h.make_tensor_value_info(o, outs[o], None) if o in outs else onnx.ValueInfoProto(name=o)
        for o in node.output
        if o
    ]
    used = [inits[i] for i in dict.fromkeys(node.input) if i in inits]
    g = h.make_graph([node], "one_node", inputs, outputs, used)
    m = h.make_model(g, opset_imports=graph.opset_import)
    m.ir_version = _node_ir_version(m)
    return m


# IR versions that first carry an element type (float8: 9, 4-bit ints: 10, float4: 11, float8e8m0: 12)
_TYPE_IR = {17: 9, 18: 9, 19: 9, 20: 9, 21: 10, 22: 10, 23: 11, 24: 12}


def _node_ir_version(one: onnx.ModelProto) -> int:
    """The IR version a one-node model is stamped with: the lowest (from 8) its opsets and element types need,
    not its graph's. It is part of what ORT is given, hence of ``packing_key``: the same node in two exports of a
    family that differ only in their IR stamp (optimum's merged decoder: 9, its decoders: 8) gets one session."""
    from onnx.helper import find_min_ir_version_for

    used = [
        v.type.tensor_type.elem_type for v in [*one.graph.input, *one.graph.output] if v.type.HasField("tensor_type")
    ]
    used += [t.data_type for t in one.graph.initializer]
    floor = max([_TYPE_IR.get(int(t), 8) for t in used], default=8)
    return max(8, floor, find_min_ir_version_for(list(one.opset_import), ignore_unknown=True))


@dataclass
class OpTally:
    """Per op type of the optimized graph: weight-bearing nodes, those ORT packed, and why the rest were not."""

    nodes: int = 0
    packed: int = 0
    packed_bytes: int = 0
    sessions: int = 0  # one-node sessions run (``pack``)
    reused: int = 0  # nodes whose one-node model was packed before in this run (``packing_key``): no session
    not_packed: dict[str, int] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.not_packed[why] = self.not_packed.get(why, 0) + 1


def _scope_inits(scope: list[onnx.GraphProto]) -> dict[str, onnx.TensorProto]:
    """Initializers visible in the innermost graph of ``scope``: its own over its enclosing graphs'."""
    found: dict[str, onnx.TensorProto] = {}
    for g in scope:
        found.update({t.name: t for t in g.initializer})
    return found


Scopes = dict[tuple[int, ...], tuple[list[onnx.GraphProto], dict[str, onnx.TensorProto]]]


def _scoped(cache: Scopes, scope: list[onnx.GraphProto]) -> dict[str, onnx.TensorProto]:
    """``_scope_inits(scope)``, made once per graph of the model (a merged decoder's 1,000 nodes: 0.05 s). Keyed by
    the graphs' ids, so the entry holds the graphs: an id is only unique while its object lives (a freed branch's
    wrapper could hand its id to another branch's, which would then get the first one's initializers)."""
    key = tuple(map(id, scope))
    if key not in cache:
        cache[key] = (list(scope), _scope_inits(scope))
    return cache[key][1]


def _pack_node(path: str, packed_model: str, bin_name: str, min_external: int) -> str:
    """Open the one-node model at ``path`` with pre-packing saved: "" or why ORT refused it."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1  # as ``optimize``'s: a kernel packs its weight the same with or without a pool
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the node, as the graph has it
    so.optimized_model_filepath = packed_model
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", bin_name)
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", str(min_external))
    so.log_severity_level = 3
    SESSIONS.count += 1
    try:
        ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - a node ORT cannot run alone keeps no packed copy; its session packs it
        return f"onnxruntime cannot run it alone: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"
    return ""


BATCH_ENV = "WEIGHTSHARE_ORT_PACK_BATCH_BYTES"  # weight bytes per packing session ("0": each node alone)
PACKED_BIN = "packed.bin"  # packed buffers moved out of ORT's files (segments'; nodes' where no holes are made)
PACKED_ALIGN = 4096  # the final blob's alignment of a packed buffer (``prepack.PACKED_ALIGN``)


def _move_packed(value: str, src: BinaryIO, dst: BinaryIO, target: Target | None = None) -> tuple[str, int]:
    """Append the buffers of one ``prepacked_N`` entry (``key|offset;size;...|...``, offsets into ``src``)
    to ``dst``; the entry re-pointed at ``dst`` and the bytes moved. ORT's per-node file also holds the
    node's plain weights: only the packed bytes are kept. ``target``: ``dst`` is the staged blob, each buffer
    placed where the final blob keeps it."""
    key, *buffers = value.split("|")
    moved, total = [key], 0
    for buf in buffers:
        offset, size, *rest = buf.split(";")
        if target is not None:
            at = target.append_at(dst, int(size), PACKED_ALIGN)
            _copy_range(src, int(offset), int(size), dst, f"onnxruntime's packed file ends inside {key}")
            moved.append(";".join([str(at), size, *rest]))
            total += int(size)
            continue
        # at a block boundary (the gap is a hole): once the blob holds the buffer its whole blocks can be freed
        # (``disk_use.punch`` frees only whole blocks inside a range; unaligned small buffers kept every block)
        dst.flush()
        at = -(-dst.seek(0, 2) // 4096) * 4096
        os.ftruncate(dst.fileno(), at)  # the gap a hole; an append-mode file then writes at ``at`` too
        dst.seek(at)
        _copy_range(src, int(offset), int(size), dst, f"onnxruntime's packed file ends inside {key}")
        moved.append(";".join([str(at), size, *rest]))
        total += int(size)
    return "|".join(moved), total


def pack(
    opt_model: str,
    min_external: int,
    known: dict[str, Packing] | None = None,
    target: Target | None = None,
    digests: dict[tuple[str, int, int], str] | None = None,
    batch_bytes: int = 0,
) -> tuple[dict[str, list[list[str]]], dict[str, OpTally], dict[str, Packing]]:
    """Pre-pack node by node: each weight-bearing node of the optimized graph (subgraph bodies
    included, their outer-scope weights as the node's own) as if alone in a session.

    ``known``: packings of one-node models this run already made (``packing_key`` -> ``Packing``, files
    absolute), reused without a session; None: none reused, not even between this graph's own nodes (the
    bench's "before"). Returns (initializer name -> [[prepacked entry value, file], ...], per op type what was
    packed, the packings made here by a session, files relative to the staging).
    ``target``: the packed copies go straight to the staged blob, ORT's per-node files to its scratch; then the
    one-node models still to pack are opened together, up to ``batch_bytes`` of their weights per session
    (``_Batch``): a session costs ~7 ms whatever it packs, and a kernel packs its node the same beside others.
    Peak memory is one batch's weights and packed copies, whatever the model's size.
    """
    import os

    from .types import ScopeTypes, all_nodes

    model = onnx.load(opt_model, load_external_data=False)
    stage = os.path.dirname(opt_model)
    types = ScopeTypes(model)
    found: dict[str, list[list[str]]] = {}
    tally: dict[str, OpTally] = {}
    made: dict[str, Packing] = {}
    digests = {} if digests is None else digests  # (file, offset, length) -> content digest (``_content_digest``)
    packed_name = target.blob if target is not None else PACKED_BIN
    packed_bin = os.path.join(stage, packed_name)
    if not os.path.exists(packed_bin):
        open(packed_bin, "wb").close()
    work = _PackWork(stage, min_external, known, target, found, made, packed_bin, packed_name)
    batch = _Batch(work, batch_bytes if target is not None else 0)
    scopes: Scopes = {}  # per enclosing graphs: not per node
    for n, (node, scope) in enumerate(all_nodes(model.graph)):
        inits = _scoped(scopes, scope)
        weights = [i for i in node.input if i in inits and inits[i].data_location == onnx.TensorProto.EXTERNAL]
        if not weights:
            continue
        op = tally.setdefault(f"{node.domain}.{node.op_type}" if node.domain else node.op_type, OpTally())
        op.nodes += 1
        done = [  # packed by its segment's session (the others of a segmented graph come here)
            sum(int(b.split(";")[1]) for b in e.value.split("|")[1:])
            for i in weights
            for e in inits[i].external_data
            if e.key.startswith("prepacked_")
        ]
        if done:
            op.packed += 1
            op.packed_bytes += sum(done)
            continue
        one = _one_node_model(node, model, inits, types.of(scope))
        if isinstance(one, str):
            op.skip(one)
            continue
        key = packing_key(one, stage, digests) if known is not None else ""
        nbytes = sum(w[2] for i in dict.fromkeys(weights) if (w := _external(inits[i])))
        batch.add(_Node(n, node, op, one, key, nbytes))
    batch.flush()
    return found, tally, (made if known is not None else {})


@dataclass
class _Node:
    """A weight-bearing node waiting for its packing: its position in the graph, its one-node model and key."""

    n: int
    node: onnx.NodeProto
    op: OpTally
    one: onnx.ModelProto
    key: str
    nbytes: int  # its external weights' bytes
    # what a batch's session saved for it: per initializer (its name in the node, [prepacked entry values]), in
    # the order its own session saves them, in the batch's file ``saved_in``; None: packed alone
    saved: list[tuple[str, list[str]]] | None = None
    saved_in: str = ""


@dataclass
class _PackWork:
    """What ``pack`` settles node after node, in graph order (the staged blob's appends follow it)."""

    stage: str
    min_external: int
    known: dict[str, Packing] | None
    target: Target | None
    found: dict[str, list[list[str]]]
    made: dict[str, Packing]
    packed_bin: str
    packed_name: str

    def settle(self, item: _Node) -> None:
        """``item``'s packing: an earlier node's with its key, its batch's, or its own session's."""
        earlier = (self.made.get(item.key) or self.known.get(item.key)) if self.known is not None else None
        if earlier is not None:  # the same one-node model packed before in this run: its session's result
            _reuse(earlier, item.node, self.found, item.op, self.target)
            return
        item.op.sessions += 1  # nodes packed by a session (``SESSIONS``: the sessions themselves)
        if item.saved is not None:
            self._keep(item, item.saved, item.saved_in)
        else:
            self._alone(item)

    def _alone(self, item: _Node) -> None:
        import gc

        from ...._platform import malloc_trim

        stage, n = self.stage, item.n
        name, packed_model = os.path.join(stage, f"node{n}.onnx"), os.path.join(stage, f"node{n}.packed.onnx")
        target = self.target
        node_bin = target.scratch_name(f"node{n}.packed.bin") if target is not None else f"node{n}.packed.bin"
        with open(name, "wb") as f:
            f.write(item.one.SerializeToString())
        try:
            refused = _pack_node(name, packed_model, node_bin, self.min_external)
            if target is not None:
                target.sample()
        finally:
            os.unlink(name)
            # the session went with _pack_node's frame (refcount); a full collection per node cost 24 ms (a
            # merged decoder's 24 nodes: 0.57 of its child's 1.96 s CPU), the young generation catches the rest
            gc.collect(0)
            malloc_trim()
        if refused:
            item.op.skip(refused)
            self.made[item.key] = Packing(skip=refused)
            for left in (packed_model, os.path.join(stage, node_bin)):
                if os.path.exists(left):
                    os.unlink(left)
            return
        packed = _load_saved(packed_model)
        saved = [(t.name, _packed_values(t)) for t in packed.graph.initializer]
        self._keep(item, saved, node_bin, alone=True)

    def _keep(self, item: _Node, saved: list[tuple[str, list[str]]], node_bin: str, alone: bool = False) -> None:
        """Record (and move to the staged blob) what ``item``'s session saved: ``saved`` in ``node_bin``."""
        from ..disk_use import can_punch

        node, op, stage = item.node, item.op, self.stage
        packing = Packing()
        # ORT's file holds the node's weights, then their packed copies: where blocks can be freed, the packed
        # bytes stay where ORT wrote them (written once) and the weights' blocks go; else they are moved out
        # (into the staged blob with a ``target``: written there once, ORT's file in memory)
        in_place, kept = alone and can_punch() and self.target is None, []
        with open(os.path.join(stage, node_bin), "rb") as src, open(self.packed_bin, "ab") as dst:
            for init, values in saved:
                for value in values:
                    kernel = value.split("|")[0]
                    same = [(v, f) for v, f in self.found.get(init, []) if v.split("|")[0] == kernel]
                    if same:
                        # another node, one kernel (the branches of a merged decoder's If): the same packed
                        # bytes under the same key, which the blob keeps once; not written twice to the staging
                        packing.add(list(node.input).index(init), *same[0])
                        continue
                    if in_place:
                        file = node_bin
                        size = sum(int(b.split(";")[1]) for b in value.split("|")[1:])
                        kept.append(value)
                    else:
                        (value, size), file = _move_packed(value, src, dst, self.target), self.packed_name
                    self.found.setdefault(init, []).append([value, file])
                    packing.add(list(node.input).index(init), value, file)
                    op.packed_bytes += size
        if alone:
            if kept:
                _free_all_but(os.path.join(stage, node_bin), kept)
            else:
                os.unlink(os.path.join(stage, node_bin))  # its copy of the node's weights goes at once
        if not packing.entries:
            packing.skip = _packs_nothing(node)
        self.made[item.key] = packing
        _tally(op, packing, node)


def _load_saved(packed_model: str) -> onnx.ModelProto:
    """The model a packing session saved, removed once read; refused when ORT recorded an entry not read here."""
    packed = onnx.load(packed_model, load_external_data=False)
    os.unlink(packed_model)
    apply_saved_hook(packed)  # tests rename what ORT emits here (``names``)
    unknown = unknown_entries(packed)
    if unknown:  # what ORT packed under a key we do not read would be dropped: the parent's one line
        raise ValueError(unknown_entry_message(unknown[0]))
    return packed


def _packed_values(t: onnx.TensorProto) -> list[str]:
    return [e.value for e in t.external_data if e.key.startswith("prepacked_")]


_BATCH_SEP = "/"  # a batched node's names: "<its place in the batch>/<its name>"


class _Batch:
    """Nodes in graph order, settled a window at a time: the window's nodes that need a session of their own
    (a key neither this run nor this window packed) are first opened together, one session per IR version up to
    ``limit`` bytes of their weights, then every node of the window is settled in order (``_PackWork.settle``)
    as node-by-node sessions would be: the same appends to the staged blob, in the same order. Each node's names
    take a prefix of their own (``_BATCH_SEP``), so that no two nodes share a tensor; a node with a subgraph runs
    alone, and so does every node of a batch ORT refuses. ``limit`` 0: every node alone."""

    def __init__(self, work: _PackWork, limit: int) -> None:
        self.work = work
        self.limit = limit
        self.window: list[_Node] = []
        self.fresh: list[_Node] = []
        self.keys: set[str] = set()
        self.nbytes = 0

    def add(self, item: _Node) -> None:
        w = self.work
        new = w.known is None or not (item.key in w.made or item.key in w.known or item.key in self.keys)
        if new and self.fresh and self.nbytes + item.nbytes > self.limit:
            self.flush()
        self.window.append(item)
        if new:
            self.fresh.append(item)
            self.keys.add(item.key)
            self.nbytes += item.nbytes

    def flush(self) -> None:
        from .types import subgraphs

        by_ir: dict[int, list[_Node]] = {}
        for item in self.fresh:
            if self.limit > 0 and not any(True for _ in subgraphs(item.node)):
                by_ir.setdefault(item.one.ir_version, []).append(item)
        files = [f for group in by_ir.values() if len(group) > 1 and (f := self._open_together(group))]
        try:
            for item in self.window:
                self.work.settle(item)
        finally:
            for f in files:
                path = os.path.join(self.work.stage, f)
                if os.path.exists(path):
                    os.unlink(path)
        self.window, self.fresh, self.keys, self.nbytes = [], [], set(), 0

    def _open_together(self, group: list[_Node]) -> str:
        """One session packing every node of ``group``; its file's name in the staging, each node's ``saved``
        set; "" when ORT refused the batch (its nodes are packed alone)."""
        import gc

        from ...._platform import malloc_trim

        w, first = self.work, group[0].n
        name = os.path.join(w.stage, f"batch{first}.onnx")
        packed_model = os.path.join(w.stage, f"batch{first}.packed.onnx")
        bin_name = f"batch{first}.packed.bin"
        bin_name = w.target.scratch_name(bin_name) if w.target is not None else bin_name
        with open(name, "wb") as f:
            f.write(_together([i.one for i in group]).SerializeToString())
        try:
            refused = _pack_node(name, packed_model, bin_name, w.min_external)
            if w.target is not None:
                w.target.sample()
        finally:
            os.unlink(name)
            gc.collect(0)
            malloc_trim()
        if refused:
            for left in (packed_model, os.path.join(w.stage, bin_name)):
                if os.path.exists(left):
                    os.unlink(left)
            return ""
        saved: dict[str, list[tuple[str, list[str]]]] = {}
        for t in _load_saved(packed_model).graph.initializer:
            place, _, init = t.name.partition(_BATCH_SEP)
            saved.setdefault(place, []).append((init, _packed_values(t)))
        for j, item in enumerate(group):
            item.saved, item.saved_in = saved.get(str(j), []), bin_name
        return bin_name


def _together(ones: list[onnx.ModelProto]) -> onnx.ModelProto:
    """The one-node models ``ones`` (of one IR version and opsets) as one graph, each node's names prefixed with
    its place (``_BATCH_SEP``): no tensor is shared, each node reads and packs what it reads alone."""
    from onnx import helper as h

    nodes: list[onnx.NodeProto] = []
    inputs: list[onnx.ValueInfoProto] = []
    outputs: list[onnx.ValueInfoProto] = []
    inits: list[onnx.TensorProto] = []
    for j, one in enumerate(ones):

        def named(s: str, j: int = j) -> str:
            return f"{j}{_BATCH_SEP}{s}" if s else s

        g = one.graph
        node = onnx.NodeProto()
        node.CopyFrom(g.node[0])
        node.input[:] = [named(i) for i in node.input]
        node.output[:] = [named(o) for o in node.output]
        node.name = named(node.name)
        nodes.append(node)
        for src, dst in ((g.input, inputs), (g.output, outputs)):
            for v in src:
                copy = onnx.ValueInfoProto()
                copy.CopyFrom(v)
                copy.name = named(v.name)
                dst.append(copy)
        for t in g.initializer:
            copy_t = onnx.TensorProto()
            copy_t.CopyFrom(t)
            copy_t.name = named(t.name)
            inits.append(copy_t)
    m = h.make_model(h.make_graph(nodes, "batch", inputs, outputs, inits), opset_imports=ones[0].opset_import)
    m.ir_version = ones[0].ir_version
    return m


def _free_all_but(path: str, values: list[str]) -> None:
    """Free the blocks of ``path`` outside the packed buffers of ``values`` (``prepacked_N`` entries into it)."""
    from ..disk_use import punch

    spans = sorted((int(b.split(";")[0]), int(b.split(";")[1])) for v in values for b in v.split("|")[1:])
    at = 0
    for offset, size in [*spans, (os.path.getsize(path), 0)]:
        if offset > at:
            punch(path, at, offset - at)
        at = max(at, offset + size)


def _packs_nothing(node: onnx.NodeProto) -> str:
    if node.domain == "com.microsoft.nchwc":
        return "its kernel pre-packs nothing: the optimizer reordered its weights (stored as optimized tensors)"
    return "its kernel pre-packs nothing here"


def _tally(op: OpTally, packing: Packing, node: onnx.NodeProto) -> None:
    if packing.entries:
        op.packed += 1
    else:
        op.skip(packing.skip or _packs_nothing(node))


@dataclass
class Packing:
    """What a one-node model's session packed: per input position of its node, the ``prepacked_N`` entry
    values and the file they point into; or why nothing (``skip``)."""

    entries: list[tuple[int, str, str]] = field(default_factory=list)  # (input position, entry value, file)
    skip: str = ""

    def add(self, position: int, value: str, file: str) -> None:
        self.entries.append((position, value, file))

    def to_json(self) -> dict[str, Any]:
        return {"entries": [list(e) for e in self.entries], "skip": self.skip}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Packing:
        return cls([(int(p), str(v), str(f)) for p, v, f in doc["entries"]], str(doc["skip"]))


def _reuse(
    earlier: Packing,
    node: onnx.NodeProto,
    found: dict[str, list[list[str]]],
    op: OpTally,
    target: Target | None = None,
) -> None:
    """``earlier``'s entries for ``node``'s own initializer names (an earlier model's files by absolute path).
    ``target`` that copies reused packings: copied into the staged blob where this node's own session's would
    go, so that the blob is the same whether the packing was reused or made."""
    op.reused += 1
    for position, value, file in earlier.entries:
        name = node.input[position]
        kernel = value.split("|")[0]
        if any(v.split("|")[0] == kernel for v, _f in found.get(name, [])):
            continue
        if target is not None and target.copy_reused and file != target.blob:
            with open(file, "rb") as src, open(os.path.join(target.stage, target.blob), "ab") as dst:
                copied = _move_packed(value, src, dst, target)[0]
            for was, now in zip(value.split("|")[1:], copied.split("|")[1:]):  # the parent knows their digests
                target.copies.append([int(now.split(";")[0]), int(was.split(";")[1]), file, int(was.split(";")[0])])
            value, file = copied, target.blob
        found.setdefault(name, []).append([value, file])
        op.packed_bytes += sum(int(b.split(";")[1]) for b in value.split("|")[1:])
    _tally(op, earlier, node)


def packing_key(one: onnx.ModelProto, directory: str, digests: dict[tuple[str, int, int], str]) -> str:
    """What a one-node model's session can pack from, independent of tensor and node names: the node's op,
    domain and attributes; per input position an initializer's element type, dims and bytes (their digest), a
    loose input's type, or which earlier position it repeats; the outputs' types; the opsets and IR version.
    That is the whole model ``_pack_node`` gives ORT but for names (a kernel's PrePack sees the tensor, its
    shape and type, and the node's attributes: a MatMul of other dims or a Gemm with transB is another key).
    Two nodes with one key get the same session, hence the same packed bytes (same run: same onnxruntime, CPU
    and options)."""
    g = one.graph
    node = g.node[0]
    inits = {t.name: t for t in g.initializer}
    loose = {v.name: v.type.SerializeToString().hex() for v in g.input}
    seen: dict[str, int] = {}
    ins: list[tuple[Any, ...]] = []
    for position, name in enumerate(node.input):
        if name in seen:
            ins.append(("repeats", seen[name]))
            continue
        seen[name] = position
        if not name:
            ins.append(("absent",))
        elif name in inits:
            t = inits[name]
            ins.append(("init", t.data_type, tuple(t.dims), _content_digest(t, directory, digests)))
        else:
            ins.append(("input", loose.get(name, "")))
    outs = [v.type.SerializeToString().hex() for v in g.output]
    attrs = sorted(a.SerializeToString().hex() for a in node.attribute)
    opsets = sorted((o.domain, o.version) for o in one.opset_import)
    doc = (one.ir_version, opsets, node.op_type, node.domain, attrs, ins, outs)
    return hashlib.sha256(repr(doc).encode()).hexdigest()


def _content_digest(t: onnx.TensorProto, directory: str, digests: dict[tuple[str, int, int], str]) -> str:
    """The bytes of ``t``, streamed from its external file (each range read once per child) or, inline, its
    serialized form without its name."""
    from ...._checksum import new_hasher

    where = _external(t)
    if t.data_location != onnx.TensorProto.EXTERNAL:
        inline = onnx.TensorProto()
        inline.CopyFrom(t)
        inline.name = ""
        h = new_hasher()
        h.update(inline.SerializeToString())
        return "inline:" + h.hexdigest()
    if where is None:  # no length recorded: never equal to another tensor
        return f"unsized:{id(t)}"
    if where not in digests:
        h = new_hasher()
        with open(os.path.join(directory, where[0]), "rb") as f:
            f.seek(where[1])
            remaining = where[2]
            while remaining:
                chunk = f.read(min(remaining, 1 << 20))
                if not chunk:
                    raise OSError(f"{where[0]} ends inside an initializer")
                h.update(chunk)
                remaining -= len(chunk)
        digests[where] = h.hexdigest()
    return "bytes:" + digests[where]


def tally_packed(opt_model: str) -> dict[str, OpTally]:
    """Per op type, from the saved graph's ``prepacked_N`` entries: which weight-bearing nodes ORT packed."""
    from .types import all_nodes

    model = onnx.load(opt_model, load_external_data=False)
    tally: dict[str, OpTally] = {}
    scopes: Scopes = {}
    for node, scope in all_nodes(model.graph):
        inits = _scoped(scopes, scope)
        weights = [inits[i] for i in node.input if i in inits and inits[i].data_location == onnx.TensorProto.EXTERNAL]
        if not weights:
            continue
        op = tally.setdefault(f"{node.domain}.{node.op_type}" if node.domain else node.op_type, OpTally())
        op.nodes += 1
        sizes = [
            sum(int(b.split(";")[1]) for b in e.value.split("|")[1:])
            for t in weights
            for e in t.external_data
            if e.key.startswith("prepacked_")
        ]
        if sizes:
            op.packed += 1
            op.packed_bytes += sum(sizes)
        elif node.domain == "com.microsoft.nchwc":
            op.skip("its kernel pre-packs nothing: the optimizer reordered its weights (stored as optimized tensors)")
        else:
            op.skip("its kernel pre-packs nothing here")
    return tally


def optimize_bounded(
    model: str, out_model: str, min_external: str, budget: int, sharer: Sharer | None = None
) -> dict[str, Any]:
    """Step 1 in memory bounded by ``budget`` weight bytes per segment (``segments``): the
    optimized graph in ``out_model``, its initializers in files named after it (or, with ``sharer``,
    settled segment by segment into the staged payloads and ``ort.rest.bin``)."""
    from .segments import Segmenter

    target = sharer.target if sharer is not None else None
    whole = f"{os.path.basename(out_model).removesuffix('.onnx')}.bin"
    weights = sum(w[2] for t in sharer.plain.values() if (w := _external(t))) if sharer is not None else 0

    def place(bin_name: str) -> str:
        """A segment's or a window's file in the scratch (one at a time: a window's goes before the next
        session); the whole graph's too when its weights are within one segment's, else it stays in the staging
        (the whole model's weights)."""
        if target is None or (bin_name == whole and weights > budget):
            return bin_name
        target.sample(drop=".win")
        return target.scratch_name(bin_name)

    def run(src: str, dst: str, bin_name: str, prepack: bool = False) -> None:
        from ...._platform import malloc_trim

        optimize(src, dst, place(bin_name), min_external, prepack)
        if target is not None:
            target.sample()
        malloc_trim()  # the session's heap goes back before the next segment's session

    def run_packed(src: str, dst: str, bin_name: str) -> None:
        run(src, dst, bin_name, True)

    def run_referenced(src: str, dst: str, bin_name: str) -> None:
        from ...._platform import malloc_trim

        optimize(src, dst, bin_name, min_external, referenced=True)
        malloc_trim()

    segmenter = Segmenter(
        model,
        out_model,
        run,
        budget,
        settle=sharer.settle if sharer else None,
        reset=sharer.reset if sharer else None,
        optimize_packed=run_packed if sharer else None,
        optimize_referenced=run_referenced,
        settles_inline=sharer is not None and sharer.min_external > 0,
    )
    return segmenter.run().as_dict()


def _external(t: onnx.TensorProto) -> tuple[str, int, int] | None:
    e = {x.key: x.value for x in t.external_data}
    if t.data_location != onnx.TensorProto.EXTERNAL or "location" not in e or not e.get("length", "").isdigit():
        return None
    return e["location"], int(e.get("offset", "0")), int(e["length"])


def _same_bytes(a: str, a_at: int, b: str, b_at: int, length: int) -> bool:
    # two buffers read into again and again: a fresh 1 MiB bytes object per read cost 5x the CPU of the compare
    # itself (its pages faulted in each time; a decoder's weights: 0.28 s against 0.05 s)
    size = min(length, 1 << 20)
    ba, bb = bytearray(size), bytearray(size)
    with open(a, "rb", buffering=0) as fa, open(b, "rb", buffering=0) as fb:
        fa.seek(a_at)
        fb.seek(b_at)
        while length:
            n = min(length, size)
            if n < len(ba):
                ba, bb = bytearray(n), bytearray(n)
            got_a, got_b = _fill(fa, ba), _fill(fb, bb)
            if got_a != got_b or (ba if got_a == n else ba[:got_a]) != (bb if got_b == n else bb[:got_b]):
                return False
            length -= n
    return True


def _fill(f: Any, buf: bytearray) -> int:
    """``buf`` read full from ``f``'s position (fewer bytes only at its end): how many were read."""
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


class Sharer:
    """Points the optimized graph's initializers that ORT left as they were back at the staged model's
    payload, and keeps only the changed ones (reordered, fused) in ``ort.rest.bin``: ORT's own files, a
    second copy of the weights, leave OUTDIR as soon as each segment is optimized (``settle``), not once
    the whole graph is. Both models sit in one directory, so a location holds for either."""

    REST = "ort.rest.bin"

    def __init__(self, model: str, stage: str, min_external: int = 0, target: Target | None = None) -> None:
        self.stage = stage
        # the staged blob takes what is kept (``Target``); its size before each segment's bytes, by tag, so that a
        # dropped segment's are cut off again (``drop_settled``)
        self.target = target
        self.marks: dict[str, int] = {}
        self.start = os.path.getsize(os.path.join(stage, target.blob)) if target is not None else 0
        # > 0: what a session wrote inline from this size on is moved out (``externalize``), so the sessions that
        # pack nothing may save references instead of writing every weight again (``Segmenter.settles_inline``)
        self.min_external = min_external
        src = onnx.load(model, load_external_data=False)
        self.plain = {t.name: t for t in src.graph.initializer if _external(t)}
        self.kept = {self.REST} | {w[0] for t in self.plain.values() if (w := _external(t)) is not None}
        self.reset()

    def reset(self) -> None:
        """Nothing settled so far is kept (the graph is optimized in one piece after all)."""
        if self.target is not None:
            self._cut_off(self.start)
            for tag in self.marks:
                if os.path.exists(self._mark(tag)):
                    os.unlink(self._mark(tag))
            self.marks.clear()
            return
        open(os.path.join(self.stage, self.REST), "wb").close()
        open(os.path.join(self.stage, PACKED_BIN), "wb").close()

    def staged_digests(self, digests: dict[tuple[str, int, int], bytes]) -> dict[tuple[str, int, int], str]:
        """The cut checks' digests (``segments.fingerprint``) of the staged blob's payloads the parent wrote, for
        ``pack``'s keys: the same bytes hashed once (a decoder's weights: 0.15 s). Only below ``start``: past it
        the blob's bytes are this child's, cut off and written again when a cut is dropped."""
        if self.target is None:
            return {}
        blob = os.path.abspath(os.path.join(self.stage, self.target.blob))
        return {
            (self.target.blob, offset, length): digest.hex()
            for (path, offset, length), digest in digests.items()
            if os.path.abspath(path) == blob and 0 <= length and offset + length <= self.start
        }

    def _cut_off(self, size: int) -> None:
        """The staged blob cut back to ``size``; the cut checks' digests of what was past it forgotten (the bytes
        written there next are other bytes at the same offsets: a digest kept would vouch for them)."""
        from .segments import digested

        assert self.target is not None
        path = os.path.join(self.stage, self.target.blob)
        os.truncate(path, size)
        blob = os.path.abspath(path)
        for key in [k for k in digested if os.path.abspath(k[0]) == blob and (k[2] < 0 or k[1] + k[2] > size)]:
            del digested[key]

    def _mark(self, tag: str) -> str:
        return os.path.join(self.stage, f"ort.{tag}.kept")

    def drop_settled(self) -> None:
        """Cut off the staged blob's bytes of the segments the segmenter dropped (it removed their marks): they
        were appended last (segments are optimized in order, a dropped one with every one after it)."""
        dropped = [tag for tag in self.marks if not os.path.exists(self._mark(tag))]
        if not dropped or self.target is None:
            return
        cut = min(self.marks[tag] for tag in dropped)
        if all(self.marks[tag] < cut for tag in self.marks if tag not in dropped):
            self._cut_off(cut)
        for tag in dropped:  # else their bytes stay, unreferenced: the final blob's padding
            del self.marks[tag]

    def _append_at(self, out: BinaryIO, nbytes: int) -> int:
        if self.target is not None:
            return self.target.append_at(out, nbytes)
        return out.seek(0, 2)

    def externalize(self, opt: onnx.ModelProto, rest: str) -> None:
        """Move ``opt``'s inline initializers of ``min_external`` bytes or more (raw data), subgraphs' included,
        to ``rest``: a session that saved references wrote what it changed inline, where ORT's own file would have
        held it."""
        min_external = self.min_external
        graphs = [opt.graph]
        with open(os.path.join(self.stage, rest), "ab") as out:
            while graphs:
                g = graphs.pop()
                for n in g.node:
                    for a in n.attribute:
                        graphs += [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
                for t in g.initializer:
                    if t.data_location == onnx.TensorProto.EXTERNAL or len(t.raw_data) < max(min_external, 1):
                        continue
                    offset, length = self._append_at(out, len(t.raw_data)), len(t.raw_data)
                    out.write(t.raw_data)
                    t.ClearField("raw_data")
                    t.data_location = onnx.TensorProto.EXTERNAL
                    for k, v in (("location", rest), ("offset", str(offset)), ("length", str(length))):
                        entry = t.external_data.add()
                        entry.key, entry.value = k, v

    def settle(self, opt: onnx.ModelProto, tag: str = "") -> list[str]:
        """Re-point ``opt``'s external initializers (plain payload, or the changed bytes in a file of its
        own) and its packed buffers (``packed.bin``, or one of its own), and remove the files ORT wrote
        them to. ``tag``: a segment's, whose files go when the segment is dropped; the names returned."""
        from ..disk_use import punch
        from ..graph import external_tensors
        from .names import PACKED_FILE_KEY

        rest, packed = (f"ort.rest.{tag}.bin", f"packed.{tag}.bin") if tag else (self.REST, PACKED_BIN)
        if self.target is not None:  # one file, appended through one handle
            self.drop_settled()
            rest = packed = self.target.blob
            if tag:
                self.marks[tag] = os.path.getsize(os.path.join(self.stage, rest))
                open(self._mark(tag), "wb").close()
        self.kept |= {rest, packed}
        if self.min_external:
            self.externalize(opt, rest)
        old_files: set[str] = set()
        with (
            open(os.path.join(self.stage, rest), "ab") as out,
            nullcontext(out) if packed == rest else open(os.path.join(self.stage, packed), "ab") as packs_out,
        ):
            for t in external_tensors(opt):
                where = _external(t)
                if where is None or where[0] in self.kept:
                    continue
                old_files.add(where[0])
                twin = self.plain.get(t.name)
                mine = _external(twin) if twin is not None else None
                if (
                    twin is not None
                    and mine is not None
                    and (twin.data_type, list(twin.dims)) == (t.data_type, list(t.dims))
                    and mine[2] == where[2]
                    and _same_bytes(
                        os.path.join(self.stage, mine[0]),
                        mine[1],
                        os.path.join(self.stage, where[0]),
                        where[1],
                        where[2],
                    )
                ):
                    location, offset, length = mine
                else:
                    location, offset, length = rest, self._append_at(out, where[2]), where[2]
                    _append(os.path.join(self.stage, where[0]), where[1], where[2], out)
                values = [("location", location), ("offset", str(offset)), ("length", str(length))]
                ort_file = os.path.join(self.stage, where[0])
                with open(ort_file, "rb") as f:
                    moved = [
                        _move_packed(e.value, f, packs_out, self.target)[0]
                        for e in t.external_data
                        if e.key.startswith("prepacked_")
                    ]
                # ORT's file goes once settled; its blocks go as each tensor is: the copies made from it do
                # not sit beside it (the temporary disk peak stays at the staged model plus ORT's file)
                packs_out.flush()
                out.flush()
                punch(ort_file, where[1], where[2])
                for e in t.external_data:
                    if e.key.startswith("prepacked_"):
                        for buf in e.value.split("|")[1:]:
                            at, size = buf.split(";")[:2]
                            punch(ort_file, int(at), int(size))
                if moved:
                    values += [(PACKED_FILE_KEY, packed), *((f"prepacked_{i}", v) for i, v in enumerate(moved))]
                del t.external_data[:]
                for k, v in values:
                    entry = t.external_data.add()
                    entry.key, entry.value = k, v
        for name in old_files:
            if os.path.exists(os.path.join(self.stage, name)):
                os.unlink(os.path.join(self.stage, name))
        if self.target is not None:  # the segmenter removes the mark of a segment it drops
            return [os.path.basename(self._mark(tag))] if tag else []
        return [rest, packed] if tag else []


def _append(path: str, offset: int, length: int, out: BinaryIO) -> None:
    with open(path, "rb") as f:
        _copy_range(f, offset, length, out, f"onnxruntime's file {os.path.basename(path)} ends early")


def _copy_range(src: BinaryIO, offset: int, length: int, out: BinaryIO, short: str) -> None:
    """``length`` bytes of ``src`` from ``offset`` appended to ``out``; ``short``: the error when ``src`` ends first.

    Copied by the kernel (``sendfile``: ORT's file in the memory-backed scratch to the staged blob, a reused packing
    from an earlier blob), not through this process's buffers: a family's packed copies, read and written again
    here, were a tenth of its child's CPU. ``out`` is opened to append, which ``sendfile`` refuses: it writes through
    a second descriptor of the same file, at its end; in 1 MiB pieces where the kernel cannot."""
    out.flush()
    done = _sendfile_at_end(src, offset, length, out)
    if done == length:
        return
    offset, length = offset + done, length - done
    src.seek(offset)
    buf = bytearray(min(length, 1 << 20))  # one buffer read into again (``_same_bytes``)
    while length:
        n = min(length, len(buf))
        got = _fill(src, buf) if n == len(buf) else _fill(src, buf := bytearray(n))
        if got < n:
            raise OSError(short)
        out.write(buf)
        length -= n


def _sendfile_at_end(src: BinaryIO, offset: int, length: int, out: BinaryIO) -> int:
    """How many bytes of ``src`` from ``offset`` the kernel appended to ``out`` (fewer than ``length``: ``src``
    ended, or the kernel copies none between these files); ``out`` flushed, left at its end."""
    try:
        fd = os.open(f"/proc/self/fd/{out.fileno()}", os.O_WRONLY)  # not O_APPEND: sendfile's condition
    except OSError:
        return 0
    done = 0
    try:
        os.lseek(fd, 0, os.SEEK_END)
        while done < length:
            n = os.sendfile(fd, src.fileno(), offset + done, length - done)
            if not n:
                break
            done += n
    except OSError:
        pass  # the rest through this process's buffers, from where the kernel stopped
    finally:
        os.close(fd)
        out.seek(0, 2)
    return done


def share_unchanged(model: str, out_model: str, sharer: Sharer | None = None) -> None:
    """``Sharer.settle`` of the saved optimized model ``out_model`` (what segments left unsettled:
    the whole-graph session's file)."""
    sharer = sharer or Sharer(model, os.path.dirname(out_model))
    opt = onnx.load(out_model, load_external_data=False)
    sharer.settle(opt)
    with open(out_model, "wb") as f:
        f.write(opt.SerializeToString())


def load(argv: list[str]) -> dict[str, Any]:
    """PATH LABEL...: load each model as a session does, pre-packing off (a probe's packed entries are dropped:
    packing its stand-ins would only cost memory); the first that onnxruntime refuses raises ``LoadRefused`` naming
    its LABEL and ORT's reason (not PATH, a staging file)."""
    import onnxruntime as ort

    for path, label in zip(argv[0::2], argv[1::2]):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.add_session_config_entry("session.disable_prepacking", "1")
        try:
            ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        except Exception as e:
            why = " ".join(str(e).split())
            why = why.split(" failed:", 1)[1].strip() if " failed:" in why else why.replace(path, label)
            raise LoadRefused(f"{label}: {why[:300]}") from None
    return {}


def run(argv: list[str]) -> dict[str, Any]:
    """MODEL OUT_MODEL MIN_EXTERNAL_BYTES SEGMENT_BYTES [KNOWN]: KNOWN, a JSON file of the packings this run
    made before (``packing_key`` -> ``Packing``), or "-" to reuse none. The result ``main`` prints: what the
    packed data is bound to, the packed entries, the segments, per op type what was packed, the packings made."""
    if argv[:1] == [LOAD]:
        return load(argv[1:])
    model, out_model, min_external, budget, *rest = argv
    known: dict[str, Packing] | None = {}
    if rest and rest[0] == "-":
        known = None
    elif rest:
        with open(rest[0]) as f:
            known = {k: Packing.from_json(v) for k, v in json.load(f).items()}
    stage = os.path.dirname(os.path.abspath(out_model))
    target = Target.from_env(stage)  # the request's environment (``serve``) or the process's (``main``)
    sharer = Sharer(model, stage, int(min_external), target)
    from .segments import digested

    digested.clear()  # this model's files alone (a staging path of an earlier model holds other bytes)
    if target is not None:  # keyed as ``segments._digest_payload`` keys them
        from pathlib import Path

        blob = str(Path(out_model).parent / target.blob)
        digested.update({(blob, offset, length): bytes.fromhex(hex_) for offset, length, hex_ in target.digests})
    clock = _Phases()
    segments = optimize_bounded(model, out_model, min_external, int(budget), sharer)
    clock.lap("optimize")  # the graph's, its segments' and its cut checks' sessions, with their settling
    sharer.drop_settled()
    share_unchanged(model, out_model, sharer)
    clock.lap("settle")
    made: dict[str, Packing] = {}
    result_sessions = 0
    if segments["segments"] > 1 and not segments["segments_packed_node_by_node"]:
        packed: dict[str, list[list[str]]] = {}  # each segment's session saved its packed copies (Sharer moved them)
        tally = tally_packed(out_model)
    else:  # one piece, or segments too large to pack in their session: node by node, in bounded memory
        digests = sharer.staged_digests(digested)
        batch = os.environ.get(BATCH_ENV, "")
        before = SESSIONS.count
        packed, tally, made = pack(
            out_model, int(min_external), known, target, digests, int(batch) if batch.isdigit() else int(budget)
        )
        result_sessions = SESSIONS.count - before
    clock.lap("pack")  # node by node: keys, sessions, packed copies moved (or the segments' tallied)
    binding = _binding(os.path.dirname(os.path.abspath(out_model)))  # in the staging, not $TMPDIR
    ops = {k: asdict(v) for k, v in sorted(tally.items())}
    packings = {k: v.to_json() for k, v in made.items()}
    result: dict[str, Any] = {"binding": binding, "packed": packed, "segments": segments, "ops": ops}
    # one piece: a session of this child opened MODEL itself, whole, as a portable session does (level ALL,
    # pre-packing off; ``segments.Segmenter._whole``, or its fallback when cutting failed)
    result["loaded_whole"] = segments["segments"] == 1
    result["packings"] = packings
    result["pack_sessions"] = result_sessions  # the packing sessions (a batch of nodes is one)
    result["cpu_s"] = clock.laps
    if target is not None:
        result["copied"] = target.copies
    if target is not None and target.scratch:
        target.sample(drop=".win")
        result["scratch_peak_bytes"] = target.scratch_peak
    return result


class _Phases:
    """This process's CPU seconds (user + system) per phase of ``run``: where a model's packing cost goes."""

    def __init__(self) -> None:
        import time

        self._clock = time.process_time
        self._at = self._clock()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = self._clock()
        self.laps[name] = round(now - self._at, 3)
        self._at = now


_bindings: list[dict[str, Any]] = []  # this process's: measured once, whatever number of models it packs


def _binding(scratch: str) -> dict[str, Any]:
    """What the packed data is bound to: the runtime, the CPU and the options (the probes run once per process;
    ``scratch``: where the NCHWc probe writes its file)."""
    if not _bindings:
        import onnxruntime as ort

        _bindings.append(
            {
                "onnxruntime": ort.__version__,
                "optimization_level": "ORT_ENABLE_ALL",
                "machine": platform.machine(),
                "cpu_features": cpu_features(),
                "cpu_kind": cpu_kind(cpu_features(), platform.machine()),
                # the session-option class the packed graph is exact in (weightshare.ort.envelope_problem checks it)
                "session_options": "ORT_ENABLE_ALL, CPUExecutionProvider, kernel options at their defaults",
                "opset_stamp": opset_stamp(),
                "nchwc_block": nchwc_block_size(scratch),
            }
        )
    return dict(_bindings[0])


def main(argv: list[str]) -> int:
    """One model (``run``'s arguments), its result printed as the last stdout line."""
    from .limits import die_with_parent

    die_with_parent()  # its parent (run_child_peak's wrapper) dies with the converter: so does this child
    print(json.dumps(run(argv)))
    return 0


def serve() -> int:
    """Every model of a run, one request per stdin line (``server.OrtChild``): the interpreter, onnx and
    onnxruntime start once per run, not once per model.

    A request is ``{"argv": run's arguments, "limits": limits.ChildLimits.to_json(), "env": {...}}`` (``env``:
    variables set for this model alone, e.g. its ``Target``); the limits are this
    model's, set before its work (``limits.apply_limits``), and the peak RSS is this model's (``_reset_peak``).
    The answer is one line on the original stdout: ``run``'s result with ``"child"``: {peak_rss_mib, sessions}.
    Anything else written to stdout goes to stderr. A request that fails ends the process (one line on stderr,
    exit 1, as ``main``): the next model gets a new child, never one whose heap a failure left behind."""
    import gc

    from ...._platform import malloc_trim, own_peak_mib
    from .limits import apply_limits, die_with_parent

    die_with_parent()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        request = json.loads(line)
        apply_limits(request["limits"])
        _reset_peak()
        before = SESSIONS.count
        scoped = {str(k): str(v) for k, v in (request.get("env") or {}).items()}  # this model's alone
        os.environ.update(scoped)
        try:
            result = _profiled(run, [str(a) for a in request["argv"]])
        finally:
            for key in scoped:
                os.environ.pop(key, None)
        result["child"] = {"peak_rss_mib": own_peak_mib(), "sessions": SESSIONS.count - before}
        answers.write(json.dumps(result) + "\n")
        answers.flush()
        gc.collect()
        malloc_trim()  # the model's heap goes back before the next one
    return 0


PROFILE_ENV = "WEIGHTSHARE_CHILD_PROFILE"  # a directory: each model's cProfile stats written there (diagnostics)


def _profiled(fn: Any, argv: list[str]) -> dict[str, Any]:
    """``fn(argv)``, under cProfile when PROFILE_ENV names a directory (one ``<model>.prof`` per request)."""
    where = os.environ.get(PROFILE_ENV, "")
    if not where:
        return dict(fn(argv))
    import cProfile
    import time

    prof = cProfile.Profile(time.process_time)  # CPU, not wall: the figure the benchmarks compare
    try:
        return dict(prof.runcall(fn, argv))
    finally:
        prof.dump_stats(os.path.join(where, os.path.basename(argv[0]) + ".prof"))


def _reset_peak() -> None:
    """Start this process's RSS high-water mark afresh (Linux ``clear_refs`` 5): the peak is the next model's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # the peak then spans the earlier models too: an upper bound


if __name__ == "__main__":
    try:
        sys.exit(serve() if sys.argv[1:] == ["--serve"] else main(sys.argv[1:]))
    except Exception as e:  # the parent turns this one line into its own error
        print(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        sys.exit(1)
