"""ONNX: scan -> plan -> write -> emit.

1. scan: the wire-level scanner cuts every payload out of the model (``scan.py``).
2. fold + plan: on the small parsed skeleton, fold Cast(fp16 -> float) of constants
   (``fold.py``) and decide per payload: external, or inline (small, int64 shape
   tensor, or a typed field under ``--keep-packed``).
3. write: stream external payloads, unpacked to raw little-endian, into the
   page-aligned safetensors blob.
4. emit: point each tensor at its blob range and write the model file.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import DecodeError

from ..._atomic import OutputTransaction
from ..._inputs import open_fd
from ..._pipeline import BlobPayload, Placements, PreparedModel, blob_target, write_models
from ..._placement import PlannedTensor
from ..._platform import malloc_trim
from ..._safetensors import CONTAINER
from ..._tensors import ElementwiseSource, FileRange, PayloadSource, bf16_to_fp32, fp16_to_fp32, read_all
from ...errors import InvalidModel, UsageError
from ...options import ConvertOptions
from ...report import ConversionReport
from . import dtypes
from ._proto import pb
from .fold import LOAD_READ_INPUTS, fold_fp16_casts, protected_names, shape_tensor_names
from .fold_shape import Layout, TransposedSource, fold_shape_ops
from .graph import Site, check_unique_constants, collect_sites, iter_scopes
from .ort.prepack_record import refuse_prepacked_model
from .scan import RefTable, TensorRef, place_markers, scan_model
from .unpack import ORT_CPU, UNPACK
from .wire import encode_len_field

# A real shape tensor has a handful of elements; a "shape" this large is hostile or a mistake, and keeping
# it inline would mean holding it in memory, so it moves like any other payload.
MAX_INLINE_SHAPE = 64 << 10


@dataclass(slots=True)
class Placement:
    ref: TensorRef
    site: Site
    external: bool
    fold: bool  # fp16/bf16 -> fp32
    reason: str = ""  # why it stays inline
    out_nbytes: int = 0
    layout: Layout | None = None  # a folded Transpose's (fold_shape.py)

    @property
    def source(self) -> PayloadSource:
        return _source(self.ref, self.fold, self.layout)


def _source(ref: TensorRef, fold: bool, layout: Layout | None = None) -> PayloadSource:
    convert = (fp16_to_fp32 if ref.data_type == dtypes.FLOAT16 else bf16_to_fp32) if fold else None
    if layout is not None:  # a folded Transpose: one file range (fold_shape only folds those), rearranged
        size = dtypes.BITS[ref.data_type] // 8
        return TransposedSource(ref.parts[0], layout, size, 4 if convert else size, convert)
    src = ref.native_source()
    if convert is not None:
        src = ElementwiseSource(src, 2, 4, convert)
    return src


class _Payload(BlobPayload):
    """A ``BlobPayload`` that makes its source only when the blob asks for it: one small object per payload."""

    __slots__ = ("fold", "index", "layout", "refs")

    def __init__(self, tensor: PlannedTensor, refs: RefTable, index: int, fold: bool, layout: Layout | None = None):
        self.tensor, self.refs, self.index, self.fold, self.layout = tensor, refs, index, fold, layout

    @property
    def source(self) -> PayloadSource:  # type: ignore[override]  # a read-only view where the base stores a field
        return _source(self.refs[self.index], self.fold, self.layout)

    @property
    def nbytes_in(self) -> int:  # type: ignore[override]  # likewise
        return self.refs.nbytes_in(self.index)


def load_skeleton(skeleton: bytes, path: Path) -> pb.ModelProto:
    model = pb.ModelProto()
    try:
        model.ParseFromString(skeleton)
    except (DecodeError, RecursionError) as e:
        raise InvalidModel(f"not a valid ONNX model ({e})", path) from None
    # A cut at a field boundary still parses; a model without these is truncated or not a model.
    if not model.HasField("graph"):
        raise InvalidModel("not a valid ONNX model (no graph; truncated?)", path)
    if model.ir_version >= 3 and not model.opset_import:
        raise InvalidModel("not a valid ONNX model (no opset_import; truncated?)", path)
    _check_names_are_text(model, path)
    check_unique_constants(model, path)
    return model


def _check_names_are_text(model: pb.ModelProto, path: Path) -> None:
    """onnx.proto is proto2, so protobuf hands back invalid UTF-8 in string fields as bytes; refuse such names."""
    for scope in iter_scopes(model):
        names: list[str | bytes] = (
            [*scope.input, *scope.output]
            if isinstance(scope, pb.FunctionProto)
            else [
                *(v.name for v in (*scope.input, *scope.output, *scope.value_info)),
                *(t.name for t in scope.initializer),
                *(sp.values.name for sp in scope.sparse_initializer),
            ]
        )
        for node in scope.node:
            names += [*node.input, *node.output, node.op_type, node.domain]
            names += [t.name for a in node.attribute for t in ([a.t] if a.HasField("t") else [])]
        bad = next((n for n in names if not isinstance(n, str)), None)
        if bad is not None:
            raise InvalidModel(f"a name in the graph is not valid UTF-8 ({bytes(bad)[:40]!r})", path)


class _SignallingNanProbe:
    """Whether our fp16/bf16 -> fp32 conversion gives the bits ORT's own Cast gives, on every machine.

    bf16: ORT shifts the bits, as we do. fp16: ORT quiets a signalling NaN in its SIMD blocks of 16 and keeps
    it in the scalar tail and on CPUs without F16C (0x7c01 -> 0x7fc02000 or 0x7f802000), so no fixed
    conversion matches; a payload holding one stays fp16 behind its Cast. Costs one more read of each fp16
    fold candidate (from the page cache in practice), through one descriptor per file: thousands of small
    payloads must not cost an open() each.
    """

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._buffer = memoryview(bytearray(1 << 20))

    def keeps_bits(self, ref: TensorRef) -> bool:
        if ref.data_type != dtypes.FLOAT16:
            return True
        if ref.typed or ref.recorded_digest is not None or not all(isinstance(p, FileRange) for p in ref.parts):
            return not dtypes.fp16_has_signalling_nan(ref.native_source().chunks())
        return not dtypes.fp16_has_signalling_nan(self._raw_chunks(ref.parts))

    def _raw_chunks(self, parts: list[FileRange]) -> Iterator[memoryview]:
        # One reused cache-sized buffer: a fresh 4 MiB bytes per read faulted in as many new pages as the
        # payloads' size (0.2 CPU s per 512 MiB of fp16).
        view = self._buffer
        for part in parts:
            fd = self._fds.get(part.path)
            if fd is None:
                fd = self._fds[part.path] = open_fd(part.path)
            pos, end = part.offset, part.offset + part.length
            while pos < end:
                got = os.preadv(fd, [view[: min(len(view), end - pos)]], pos)
                if not got:
                    raise InvalidModel(f"file ended early at offset {pos} (expected data up to {end})", part.path)
                whole = got - got % 2  # whole elements; a split one is re-read next time
                if not whole:
                    raise InvalidModel("payload length is not a whole number of elements", part.path)
                yield view[:whole]
                pos += whole

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def plan(
    refs: Sequence[TensorRef],
    sites: Mapping[int, Site],
    folded: set[int],
    shape_names: set[str],
    options: ConvertOptions,
) -> list[Placement]:
    return list(iter_plan(refs, sites, folded, shape_names, options))


def iter_plan(
    refs: Sequence[TensorRef],
    sites: Mapping[int, Site],
    folded: set[int],
    shape_names: set[str],
    options: ConvertOptions,
    layouts: Mapping[int, Layout] | None = None,
) -> Iterator[Placement]:
    """``plan``, one placement at a time: ``prepare`` keeps only what the blob needs of each."""
    for ref in refs:
        site = sites.get(ref.index)
        if site is None:
            raise InvalidModel(f"tensor {ref.name!r} sits where weightshare cannot place it", ref.path)
        fold = ref.index in folded
        p = Placement(ref, site, external=False, fold=fold, layout=(layouts or {}).get(ref.index))
        p.out_nbytes = ref.native_nbytes * (2 if fold else 1)
        if ref.typed and options.keep_packed:
            p.reason = "typed field kept packed"
        elif site.name in shape_names and p.out_nbytes <= MAX_INLINE_SHAPE:
            # onnxruntime refuses to load a model whose shape inference reads external data, whatever its type
            p.reason = "int64 shape tensor" if ref.data_type == dtypes.INT64 else "read by onnxruntime at load"
        elif site.kind == "sparse indices":
            p.reason = "sparse indices (onnx.checker validates them and cannot read external data)"
        elif p.out_nbytes < options.inline_threshold:
            p.reason = "below the inline threshold"
        else:
            p.external = True
        yield p


def _set_external(tensor: pb.TensorProto, location: str, offset: int, length: int) -> None:
    del tensor.external_data[:]
    tensor.data_location = pb.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _set_inline(p: Placement, wire_bytes: bytes | None) -> None:
    tensor = p.site.tensor
    del tensor.external_data[:]
    tensor.ClearField("data_location")
    if wire_bytes is not None:  # the original typed fields, as they were
        tensor.MergeFromString(wire_bytes)
    else:
        tensor.raw_data = read_all(p.source)


def _read_wire(ref: TensorRef) -> bytes:
    with open(ref.path, "rb") as f:
        parts = []
        for start, end in ref.wire:
            f.seek(start)
            parts.append(f.read(end - start))
    return b"".join(parts)


# The ``--unpack ort-cpu`` step (``ort.cpu.unpack_for_cpu``): adopt ONNX Runtime CPU's Casts into the parsed model
# before the fold; returns metadata for the blob header. ONNX Runtime's room (ort/) sits above this module (it
# reads its skeletons and plans), so the callers above both hand it in (``ort.cpu_unpack_step``).
CpuUnpack = Callable[[pb.ModelProto, RefTable, Path, list[str], Path, ConvertOptions], dict[str, str]]


def prepare(src: Path, out_dir: Path, options: ConvertOptions, cpu_unpack: CpuUnpack | None = None) -> PreparedModel:
    """scan + fold + plan: everything but writing. Holds the skeleton, never a payload. ``cpu_unpack``: the
    ``--unpack ort-cpu`` step, required when the options ask for it."""
    report = ConversionReport(model=str(src), format="onnx")
    other = options.unpack - set(UNPACK)  # another format's values
    if other:
        report.notes.append(
            f"--unpack {','.join(sorted(other))} is not implemented for ONNX; sparse tensors were kept as they are"
        )
    skeleton, refs = scan_model(src)
    refuse_prepacked_model(src, refs.source_files())  # ORT's CPU-specific graph would pass for a portable one
    model = load_skeleton(skeleton, src)
    del skeleton
    blob_metadata = {}
    if ORT_CPU in options.unpack and not options.keep_packed:  # before the fold, which folds ORT's Casts
        if cpu_unpack is None:
            raise UsageError("--unpack ort-cpu is not available on this path (no ONNX Runtime step given)")
        blob_metadata = cpu_unpack(model, refs, src, report.notes, out_dir, options)
    sites = collect_sites(model)
    folded: set[int] = set()
    if not options.keep_packed:
        probe = _SignallingNanProbe()
        try:
            folded, report.ops_removed = fold_fp16_casts(model, sites, lambda site: probe.keeps_bits(refs[site.index]))
        finally:
            probe.close()
    # after the Cast fold, which renames what it folds: a shape-only op of a weight ORT would fold per session
    folds = fold_shape_ops(model, refs, folded, protected_names(model))
    if folds.removed:
        report.ops_removed += folds.removed
        report.notes.append(folds.note())
        sites = collect_sites(model)  # the folded tensors' own sites
    # What the blob needs of each external payload (ref index, fold, name), then the parsed model goes: while
    # the blob is written this model is its serialized skeleton, the ref table and one small object per
    # payload (200,000 tensors). The names go into one buffer while the model lives (the conversion's
    # peak): a str object each only once the model is gone.
    ext_index, ext_fold, ext_names, name_ends = array("q"), bytearray(), bytearray(), array("q")
    for p in iter_plan(refs, sites, folded, shape_tensor_names(model, LOAD_READ_INPUTS), options, folds.layouts):
        if p.fold or (p.ref.typed and not options.keep_packed):
            report.unpacked += 1
            report.unpacked_bytes_in += p.ref.nbytes_in
            report.unpacked_bytes_out += p.out_nbytes
        if not p.external:
            report.inline_kept += 1
            report.inline_kept_bytes += p.out_nbytes
            keep_wire = p.ref.typed and options.keep_packed
            _set_inline(p, _read_wire(p.ref) if keep_wire else None)
        else:
            ext_index.append(p.ref.index)
            ext_fold.append(p.fold)
            ext_names += p.site.name.encode()
            name_ends.append(len(ext_names))
    p = None  # type: ignore[assignment]  # the last placement would keep the model alive
    del sites
    skeleton = model.SerializeToString()
    del model
    malloc_trim()  # protobuf's arena went back to malloc; give it to the OS before the blob's objects arrive
    position = array("q", [-1]) * len(refs)  # ref index -> its payload's position in the blob's order
    payloads: list[BlobPayload] = []
    shared: dict[tuple[int, int, tuple[int, ...]], tuple[str, tuple[int, ...], int]] = {}
    for i, (index, fold) in enumerate(zip(ext_index, ext_fold)):
        name = ext_names[name_ends[i - 1] if i else 0 : name_ends[i]].decode()
        data_type = refs.data_types[index]
        dims = folds.dims.get(index) or refs.dims(index)
        key = (data_type, fold, dims)
        facts = shared.get(key)
        if facts is None:  # payloads of one type and shape share their dtype, shape and size objects
            nbytes = dtypes.raw_nbytes(data_type, dims) * (2 if fold else 1)
            facts = shared[key] = (dtypes.NAMES.get(dtypes.FLOAT if fold else data_type, "uint8"), dims, nbytes)
        dtype, dims, nbytes = facts
        position[index] = i
        tensor = PlannedTensor(name, dtype, dims, nbytes)
        payloads.append(_Payload(tensor, refs, index, bool(fold), folds.layouts.get(index)))
    del shared
    del ext_index, ext_fold, ext_names, name_ends

    def emit(blob_location: str, placements: Placements, tx: OutputTransaction) -> list[Path]:
        location = encode_len_field(13, encode_len_field(1, b"location") + encode_len_field(2, blob_location.encode()))
        offset_key, length_key = encode_len_field(1, b"offset"), encode_len_field(1, b"length")  # once, not per tensor

        def entries(index: int) -> bytes:  # what _set_external gives: location, offset, length
            at = position[index]
            if not 0 <= at < len(placements):
                raise InvalidModel(f"internal error: payload {index} was never written to the blob", src)
            offset, length = placements.offset(at), placements.nbytes(at)
            return (
                location
                + encode_len_field(13, offset_key + encode_len_field(2, b"%d" % offset))
                + encode_len_field(13, length_key + encode_len_field(2, b"%d" % length))
            )

        out_model = out_dir / src.name
        tmp = tx.new_file(out_model)
        with open(tmp, "wb") as f:
            f.write(place_markers(skeleton, entries))
        return [out_model]

    return PreparedModel(report, payloads, emit, extra={"blob_metadata": blob_metadata} if blob_metadata else {})


def convert_file(
    src: Path, out_dir: Path, options: ConvertOptions, tx: OutputTransaction, cpu_unpack: CpuUnpack | None = None
) -> ConversionReport:
    """One model without ``--prepack`` (``ort.prepack`` converts those): prepare, write the blob, emit."""
    target = blob_target(src, out_dir, options.blob_name, CONTAINER)
    prepared = prepare(src, out_dir, options, cpu_unpack)
    write_models([prepared], out_dir, target, options, tx)
    return prepared.report
