"""``weightshare convert MODEL.tflite``: scan -> plan -> write -> emit.

scan: ``flatbuf`` locates every buffer's bytes and reads the graph without them.
plan: ``sparse`` (opt-in) and ``graph`` fold DENSIFY and fp16 DEQUANTIZE; each
output buffer is then empty, inline (below the inline threshold, and metadata
buffers) or moved.
write + emit, default: moved payloads go through the one write path
(``weightshare._write``) into an ``AppendedContainer``, after the flatbuffer, which is
rebuilt from the schema object API with the placements.
write + emit, ``--external``: ``prepare`` hands the payloads to the shared
pipeline (``weightshare._pipeline``), which also serves zoo mode (one blob for
many models); ``emit`` points tensors at ExternalBuffers in the blob.

Appending needs the flatbuffer's size before the first payload offset is known:
the model is built once with placeholder offsets, which makes every moved
Buffer's ``offset``/``size`` a present uint64 field, then built again with the
real values. Both builds write the same fields with the same widths, so they have
the same size, and the second one is written over the first at offset 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import flatbuffers
from ai_edge_litert import schema_py_generated as schema

from ..._atomic import OutputTransaction
from ..._paths import resolve_inside
from ..._pipeline import BlobPayload, Placements, PreparedModel, blob_target, write_models
from ..._placement import BlobEntry, BlobWriter, PlannedTensor, Progress
from ..._recorded import CheckedSource, recorded_payloads
from ..._safetensors import CONTAINER
from ..._tensors import ElementwiseSource, FileRange, InputFile, PayloadSource, fp16_to_fp32, open_input, read_all
from ..._write import write_payloads
from ...errors import InvalidModel, OutputError, Unsupported, UsageError
from ...options import ConvertOptions
from ...report import ConversionReport
from . import flatbuf
from .dequantize import plan_dequantize
from .graph import (
    NUMPY_DTYPES,
    TYPE_NAMES,
    Fp16Fold,
    apply_folds,
    plan_fp16_folds,
    referenced_buffers,
    tensor_name,
    validate,
)
from .sparse import apply_densify, plan_densify
from .unpack import UNPACK

INLINE_DATA_ALIGN = 16  # schema.fbs: Buffer.data has (force_align: 16); the Python builder ignores it
TRAILING_ZEROS = 16  # after the last appended payload, as the TFLite converter writes it
_PLACEHOLDER = flatbuf.OFFSET_PLACEHOLDER


@dataclass
class BufferPlan:
    """What output buffer ``index`` holds and where it goes."""

    index: int
    source: PayloadSource | None  # None: empty buffer
    inline: bool = False
    name: str = ""
    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    unpacked_from: int = 0  # input bytes of an fp16 payload this fp32 one was unpacked from


class _InlineBufferT(schema.BufferT):  # type: ignore[misc]  # the generated schema module is untyped
    """A Buffer whose data vector starts 16-byte aligned, as LiteRT kernels expect."""

    def Pack(self, builder: flatbuffers.Builder) -> int:
        data = bytes(self.data)
        builder.StartVector(1, len(data), INLINE_DATA_ALIGN)
        builder.head = builder.head - len(data)
        builder.Bytes[builder.head : builder.head + len(data)] = data
        builder.vectorNumElems = len(data)
        vector = builder.EndVector()
        schema.BufferStart(builder)
        schema.BufferAddData(builder, vector)
        end: int = schema.BufferEnd(builder)
        return end


def _describe(graph: schema.ModelT, nbuffers: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """Name, dtype and shape of each buffer, from the first tensor that uses it."""
    info: list[tuple[str, str, tuple[int, ...]]] = [(f"buffer{i}", "uint8", ()) for i in range(nbuffers)]
    seen = set()
    for si, sg in enumerate(graph.subgraphs):
        for t in sg.tensors or []:
            if t.buffer and t.buffer not in seen:
                seen.add(t.buffer)
                dtype = NUMPY_DTYPES.get(TYPE_NAMES.get(t.type, ""), "uint8")
                shape = tuple(int(d) for d in (t.shape if t.shape is not None else ()))
                info[t.buffer] = (tensor_name(t) if si == 0 else f"{si}/{tensor_name(t)}", dtype, shape)
    return info


def plan_buffers(
    graph: schema.ModelT,
    sources: list[PayloadSource | None],
    folds: list[Fp16Fold],
    detached: set[int],
    options: ConvertOptions,
) -> list[BufferPlan]:
    """Decide each output buffer: empty, inline or moved. Applies the fp16 folds to ``graph``.

    ``sources`` holds each buffer's payload (None when empty); ``detached`` the
    buffers whose tensor a fold cut loose: they are emptied when nothing uses them any more.
    """
    new_indices = apply_folds(graph, folds, len(sources))
    metadata_buffers = {m.buffer for m in graph.metadata or [] if m is not None}
    dropped = (detached | {f.fp16_buffer for f in folds}) - referenced_buffers(graph)
    info = _describe(graph, len(sources) + len(folds))
    plans = []
    for index, source in enumerate(sources):
        if source is None or source.nbytes == 0 or index in dropped:
            plans.append(BufferPlan(index, None))
            continue
        name, dtype, shape = info[index]
        plans.append(BufferPlan(index, source, name=name, dtype=dtype, shape=shape))
    for fold, index in zip(folds, new_indices):
        fp16 = sources[fold.fp16_buffer]
        assert fp16 is not None, "plan_fp16_folds folds only buffers that hold bytes"
        name, _dtype, shape = info[index]
        plans.append(
            BufferPlan(
                index,
                ElementwiseSource(fp16, 2, 4, fp16_to_fp32),
                name=name,
                dtype="float32",
                shape=shape,
                unpacked_from=fp16.nbytes,
            )
        )
    for p in plans:
        if p.source is not None:
            # Metadata stays in the flatbuffer: readers of Model.metadata (ReadAllMetadata, tflite_support) look
            # only at Buffer.data.
            p.inline = p.source.nbytes < options.inline_threshold or p.index in metadata_buffers
    return plans


def read_external_buffers(graph: schema.ModelT, src: Path, sources: list[PayloadSource | None]) -> None:
    """Turn the input's ExternalBuffer references into ordinary buffers (appended to ``sources``).

    A group name is a path from the model file (LiteRT joins it to the model's
    directory); it must stay inside that directory, and every slice inside its file.
    """
    groups = graph.externalBufferGroups or []
    by_id = {}
    for e in graph.externalBuffers or []:
        if e is None:
            continue
        if e.id in by_id or e.id == 0:
            raise InvalidModel(f"external buffer id {e.id} is zero or used twice", src)
        by_id[e.id] = e
    new_index: dict[int, int] = {}
    opened: dict[str, InputFile] = {}
    for sg in graph.subgraphs:
        for t in sg.tensors or []:
            if not t.externalBuffer:
                continue
            ext = by_id.get(t.externalBuffer)
            if ext is None:
                raise InvalidModel(
                    f"tensor {tensor_name(t)!r} uses external buffer {t.externalBuffer}, which the "
                    "model does not define",
                    src,
                )
            if ext.id not in new_index:
                if ext.group >= len(groups) or groups[ext.group] is None or not groups[ext.group].name:
                    raise InvalidModel(f"external buffer {ext.id} uses undefined group {ext.group}", src)
                if ext.packing and ext.packing not in (b"unpacked", "unpacked"):
                    raise Unsupported(f"external buffer {ext.id} has packing {ext.packing!r}", src)
                name = groups[ext.group].name
                name = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
                file = resolve_inside(src.parent, name, "external buffer group", src)
                if not file.exists():
                    raise InvalidModel(f"external buffer group file {name!r} does not exist", src)
                if str(file) not in opened:  # once per group file, read through the checked fd
                    opened[str(file)] = open_input(file, src.parent, src)
                in_file = FileRange(str(file), ext.offset, ext.length, opened[str(file)])
                in_file.check_within(opened[str(file)].size)
                source: PayloadSource = in_file
                digest = recorded_payloads(str(file)).get((ext.offset, ext.length))
                if digest is not None:  # a weightshare blob: a payload modified since must not be laundered
                    source = CheckedSource(in_file, digest, tensor_name(t), str(file))
                new_index[ext.id] = len(sources)
                sources.append(source if ext.length else None)
            t.buffer, t.externalBuffer = new_index[ext.id], 0
    graph.externalBuffers = graph.externalBufferGroups = None


def _build(graph: schema.ModelT) -> bytes:
    builder = flatbuffers.Builder(1 << 16)
    builder.Finish(graph.Pack(builder), file_identifier=flatbuf.FILE_IDENTIFIER)
    return bytes(builder.Output())


def _inline_buffers(plans: list[BufferPlan]) -> list[schema.BufferT]:
    buffers: list[schema.BufferT] = []
    for p in plans:
        if p.source is not None and p.inline:
            buffers.append(_InlineBufferT(data=read_all(p.source)))
        else:
            buffers.append(schema.BufferT())
    return buffers


def _open_output(tmp: Path) -> int:
    try:
        return os.open(tmp, os.O_WRONLY)
    except OSError as e:
        raise OutputError(f"cannot open output file: {e.strerror}", tmp) from None


class AppendedContainer:
    """``_write.Container``: payloads appended after a flatbuffer of ``start`` bytes, which the caller writes
    over the file's first bytes once the payloads have their offsets (``BlobWriter.pwrite``)."""

    def __init__(self, fd: int, start: int, options: ConvertOptions):
        self.writer = BlobWriter(fd, start, options.align)
        self.start = start
        self.placed = 0

    def place(self, payload: BlobPayload, progress: Progress | None = None) -> BlobEntry:
        self.placed += 1
        return self.writer.add(payload.source, progress=progress)

    def finish(self) -> int:
        """Fix the file length; return the size of the appended part (payloads, padding, trailing zeros)."""
        return self.writer.finish(TRAILING_ZEROS if self.placed else 0) - self.start


def _moved_payloads(plans: list[BufferPlan]) -> list[tuple[BufferPlan, BlobPayload]]:
    """The buffers that leave the flatbuffer, each with its payload (in buffer order)."""
    moved = []
    for p in plans:
        if p.source is not None and not p.inline:
            n = p.source.nbytes
            moved.append((p, BlobPayload(PlannedTensor(p.name, p.dtype, p.shape, n), p.source, p.unpacked_from or n)))
    return moved


def write_appended(
    graph: schema.ModelT, plans: list[BufferPlan], options: ConvertOptions, tmp: Path, report: ConversionReport
) -> None:
    """Payloads after the flatbuffer, addressed by Buffer.offset (from the start of the file) and Buffer.size."""
    buffers = _inline_buffers(plans)
    moved = _moved_payloads(plans)
    for p, _ in moved:
        buffers[p.index] = schema.BufferT(offset=_PLACEHOLDER, size=_PLACEHOLDER)
    graph.buffers = buffers
    size = len(_build(graph))
    fd = _open_output(tmp)
    try:
        container = AppendedContainer(fd, size, options)
        placements = write_payloads(container, (payload for _, payload in moved), report, options.progress)
        for i, (p, _) in enumerate(moved):
            buffers[p.index] = schema.BufferT(offset=placements.offset(i), size=placements.nbytes(i))
        report.blob_bytes = container.finish()
        model = _build(graph)
        if len(model) != size:  # same fields, same widths: a mismatch is a bug here, not bad input
            raise OutputError(f"rebuilt flatbuffer has {len(model)} bytes, planned {size}")
        container.writer.pwrite(model, 0)
    finally:
        os.close(fd)


def _emit_external(graph: schema.ModelT, plans: list[BufferPlan], placements: Placements, blob_location: str) -> None:
    """Point every tensor of a moved buffer at an ExternalBuffer in the blob's group.

    LiteRT's weight loader joins the group name to the model's directory and maps
    ``offset`` (absolute in the group file) .. ``offset + length``; tensors name
    their ExternalBuffer by ``id`` (0 means none), groups are indexed by position.
    """
    moved = [p.index for p, _ in _moved_payloads(plans)]  # the order they were placed in
    ids = {index: k + 1 for k, index in enumerate(moved)}
    externals = [
        schema.ExternalBufferT(id=k + 1, group=0, offset=placements.offset(k), length=placements.nbytes(k))
        for k in range(len(moved))
    ]
    for sg in graph.subgraphs:
        for t in sg.tensors or []:
            if t.buffer in ids:
                t.externalBuffer, t.buffer = ids[t.buffer], 0
    graph.buffers = _inline_buffers(plans)
    if externals:
        graph.externalBufferGroups = [schema.ExternalBufferGroupT(name=blob_location)]
        graph.externalBuffers = externals


def scan_and_plan(src: Path, options: ConvertOptions) -> tuple[schema.ModelT, list[BufferPlan], ConversionReport]:
    """scan + fold + plan: the rewritten graph and where each buffer goes. Reads no payload (but sparse ones)."""
    path = str(src)
    with flatbuf.open_model(path) as (reader, mapping):
        flatbuf.check_header(reader)
        refs = flatbuf.read_buffer_refs(reader)
        graph = flatbuf.read_graph(reader, mapping)
    validate(graph, len(refs), path)
    report = ConversionReport(model=path, format="tflite")
    unknown = set(options.unpack) - set(UNPACK)  # another format's value
    if unknown:
        knows = " and ".join(repr(v) for v in UNPACK)
        raise UsageError(f"unknown --unpack value {', '.join(sorted(unknown))} (TFLite knows {knows})", src)
    sources: list[PayloadSource | None] = [ref.source(path) if ref.nbytes else None for ref in refs]
    read_external_buffers(graph, src, sources)
    detached: set[int] = set()
    densified = []
    if "sparse" in options.unpack:
        densified = plan_densify(graph, sources, path)
        apply_densify(graph, [f for f, _ in densified], len(sources))
        detached = {f.sparse_buffer for f, _ in densified}
        sources.extend(source for _, source in densified)
    if "dequantize" in options.unpack:  # weight-only int8/int4: the fp32 values stored once, for every instance
        dequantized, dq_notes = plan_dequantize(graph, sources, path)
        apply_densify(graph, [f for f, _ in dequantized], len(sources))
        detached |= {f.sparse_buffer for f, _ in dequantized}
        sources.extend(source for _, source in dequantized)
        report.notes.extend(dq_notes)
        densified += dequantized
    folds, notes = (
        ([], [])
        if options.keep_packed
        else plan_fp16_folds(graph, [s.nbytes if s is not None else 0 for s in sources], path)
    )
    report.notes.extend(notes)
    plans = plan_buffers(graph, sources, folds, detached, options)
    if options.external:
        _refuse_external_sparse(graph, plans, src)
    report.ops_removed = len(folds) + len(densified)
    for fold, source in densified:
        sparse = sources[fold.sparse_buffer]
        assert sparse is not None, "plan_densify folds only buffers that hold bytes"
        report.unpacked += 1
        report.unpacked_bytes_in += sparse.nbytes
        report.unpacked_bytes_out += source.nbytes
    for p in plans:
        if p.unpacked_from and p.source is not None:  # an unpacked buffer always has its fp32 source
            report.unpacked += 1
            report.unpacked_bytes_in += p.unpacked_from
            report.unpacked_bytes_out += p.source.nbytes
        if p.source is not None and p.inline:
            report.inline_kept += 1
            report.inline_kept_bytes += p.source.nbytes
    return graph, plans, report


def _refuse_external_sparse(graph: schema.ModelT, plans: list[BufferPlan], src: Path) -> None:
    """LiteRT's CompiledModel cannot load a sparse tensor from an ExternalBuffer (it expects the dense size:
    "Insufficient buffer size"), so such an output would be unloadable; refuse it before writing anything."""
    from .graph import DENSIFY, builtin_code

    codes = [builtin_code(c) for c in graph.operatorCodes or []]
    for sg in graph.subgraphs:
        tensors = sg.tensors or []
        densified = {i for op in sg.operators or [] if codes[op.opcodeIndex] == DENSIFY for i in op.inputs or []}
        for i, t in enumerate(tensors):
            plan = plans[t.buffer] if 0 < t.buffer < len(plans) else None
            if t.sparsity is None or plan is None or plan.source is None or plan.inline:
                continue
            fix = "add --unpack sparse (stores it dense) or drop --external" if i in densified else "drop --external"
            raise UsageError(
                f"--external: tensor {tensor_name(t)!r} is sparse, and LiteRT's CompiledModel cannot load a sparse "
                f"tensor from an external buffer (the output would not load); {fix}",
                src,
            )


def prepare(src: Path, out_dir: Path, options: ConvertOptions) -> PreparedModel:
    """Zoo mode (``--shared-blob``): payloads go to a shared safetensors blob, the model references them."""
    if options.prepack:
        raise UsageError(
            "--prepack is not supported with --shared-blob for TFLite models; convert them one by "
            "one with --external --prepack",
            src,
        )
    return _prepare(src, out_dir, options)


def _prepare(src: Path, out_dir: Path, options: ConvertOptions) -> PreparedModel:
    """``--external``: payloads go to a safetensors blob, the model references them."""
    graph, plans, report = scan_and_plan(src, options)

    def emit(blob_location: str, placements: Placements, tx: OutputTransaction) -> list[Path]:
        _emit_external(graph, plans, placements, blob_location)
        final = out_dir / src.name
        tmp = tx.new_file(final)
        try:
            Path(tmp).write_bytes(_build(graph))
        except OSError as e:
            raise OutputError(f"cannot write the model: {e.strerror}", final) from None
        return [final]

    return PreparedModel(report, [payload for _, payload in _moved_payloads(plans)], emit, extra={"plans": plans})


def convert_file(src: Path, out_dir: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
    final = out_dir / src.name
    blob_name = None
    if options.external:
        target = blob_target(src, out_dir, options.blob_name, CONTAINER)
        prepared = _prepare(src, out_dir, options)
        write_models([prepared], out_dir, target, options, tx)
        report, plans = prepared.report, prepared.extra["plans"]
        blob = next((o for o in report.outputs if o.endswith(".safetensors")), None)
        blob_name = Path(blob).relative_to(out_dir).as_posix() if blob else None
    else:
        graph, plans, report = scan_and_plan(src, options)
        if options.progress_total is not None:
            options.progress_total(sum(p.source.nbytes for p in plans if p.source is not None and not p.inline))
        write_appended(graph, plans, options, tx.new_file(final), report)
        report.outputs.append(str(final))
    _xnnpack_accounting(final, blob_name, plans, options, tx, report)
    return report


def _xnnpack_accounting(
    final: Path,
    blob_name: str | None,
    plans: list[BufferPlan],
    options: ConvertOptions,
    tx: OutputTransaction,
    report: ConversionReport,
) -> None:
    """--prepack: stage the XNNPACK weight cache; and say what unpacking fp16 costs default-XNNPACK users."""
    from . import xnnpack_cache

    if options.prepack:
        if options.stage is not None:
            options.stage("LiteRT builds the XNNPACK weight cache (child process)")
        built, cache = xnnpack_cache.prepack(final, blob_name, tx, options.blob_grace_s)
        report.outputs.append(cache)
        report.notes.append(
            f"XNNPACK weight cache {Path(cache).name} ({built.nbytes:,} bytes) built in a child "
            f"process: peak RSS {built.peak_rss_mib:.1f} MiB, {built.wall_s:.2f} s"
        )
        if "dequantize" not in options.unpack:
            note = xnnpack_cache.weight_only_note(final, tx)
            if note:
                report.notes.append(note)
    else:
        xnnpack_cache.drop_stale_after_commit(final, tx, options.blob_grace_s)
    fp16_in = sum(p.unpacked_from for p in plans if p.unpacked_from)
    if fp16_in and not options.external:  # the classic Interpreter does not load --external models at all
        fp32_out = sum(p.source.nbytes for p in plans if p.unpacked_from and p.source is not None)
        report.notes.append(xnnpack_cache.unpack_note(fp16_in, fp32_out, options.prepack))
