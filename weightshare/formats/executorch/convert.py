"""``weightshare convert MODEL.pte`` / ``DATA.ptd``: the segments re-laid page-aligned, in the file itself.

What ExecuTorch's runtime maps (``MmapDataLoader``, which ``executorch.runtime.Runtime.load_program(path)`` uses:
``mmap(MAP_SHARED)`` of the pages around each segment it loads) are the file's segments: the constant segment
(tensors the portable kernels read in place), named data (weights a delegate such as XNNPACK reads, keyed by
their SHA-256), delegate blobs. The exporter writes them 128 bytes apart (``segment_alignment``), so segment
boundaries split pages between two payloads. The conversion keeps the flatbuffer byte for byte and writes every
segment after it at the alignment of ``--align`` (64 KiB for payloads of 1 MiB or more, 64 bytes below); the
constant segment is split so that each of its tensors gets that alignment too. Identical segments (the same named
data stored twice) are written once and both entries point at it.

Only fixed-width fields change, in place in the copied flatbuffer: the extended header's segment_base_offset and
segment_data_size, each ``DataSegment``'s offset (and the constant segment's size), and the entries of
``constant_segment.offsets``. A field the input omitted (flatbuffers leave out a default 0) cannot be written in
place: the payload it locates then stays at that value (relative 0 is the segment base, where the first
segment is placed), and anything else is refused before a byte is written.

A program converts with the ``.ptd`` files it reads (``inventory.locate_data_files``: by named-data key, as the
loader finds them, among the ``.ptd`` beside it and those named on the command line), each converted beside the
converted program, where the loader looks for it; a data file read by several programs of one run is written once.
"""

from __future__ import annotations

import os
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path

from ..._atomic import OutputTransaction
from ..._inputs import named_inputs
from ..._placement import BlobEntry, BlobWriter, PlannedTensor, Progress
from ..._tensors import FileRange, InputFile, open_input
from ..._write import BlobPayload, write_payloads
from ...errors import InvalidModel, OutputError, Unsupported, UsageError
from ...options import ConvertOptions
from ...report import ConversionReport
from . import flatbuf
from .inventory import data_files_beside, locate_data_files

_U64 = struct.Struct("<Q")
COPY_CHUNK = 1 << 20
# per run: each data file written, by output path -> (device, inode, source path): written once, never two onto one
_DATA_WRITTEN: weakref.WeakKeyDictionary[OutputTransaction, dict[str, tuple[int, int, str]]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(slots=True)
class SegmentPayload(BlobPayload):
    """A payload with its dedupe scope: pieces of the constant segment dedupe only among themselves, so that each
    stays inside its segment; whole segments dedupe with each other."""

    tag: str = ""


class SegmentContainer:
    """``_write.Container``: payloads after a flatbuffer of ``start`` bytes, which is copied in before."""

    def __init__(self, fd: int, start: int, options: ConvertOptions):
        self.writer = BlobWriter(fd, start, options.align)

    def place(self, payload: BlobPayload, progress: Progress | None = None) -> BlobEntry:
        tag = payload.tag if isinstance(payload, SegmentPayload) else ""
        return self.writer.add(payload.source, tag=tag, progress=progress)


@dataclass
class _Plan:
    """The payloads in write order, and what each one's placement patches."""

    payloads: list[SegmentPayload]
    # per payload: ("segment", segment index) or ("constant", index into constant_segment.offsets)
    roles: list[tuple[str, int]]


def _segment_names(prog: flatbuf.Program) -> dict[int, str]:
    names: dict[int, str] = {}
    for nd in prog.named_data:
        names.setdefault(nd.segment, nd.key)
    for d in prog.delegates:
        if not d.inline:
            names.setdefault(d.index, f"{d.plan}/{d.backend} delegate")
    for i in prog.mutable_segments:
        names.setdefault(i, "mutable data")
    return names


def _constant_names(prog: flatbuf.Program) -> dict[int, flatbuf.ConstantTensor]:
    by_index: dict[int, flatbuf.ConstantTensor] = {}
    for c in prog.constants:
        if c.buffer_index:
            by_index.setdefault(c.buffer_index, c)
    return by_index


def plan_program(prog: flatbuf.Program, f: InputFile) -> _Plan:
    """Every segment of a ``.pte`` as payloads, in file order; the constant segment as one payload per tensor."""
    payloads: list[SegmentPayload] = []
    roles: list[tuple[str, int]] = []
    names = _segment_names(prog)
    constants = _constant_names(prog)
    for seg in sorted(prog.segments, key=lambda s: (s.file_offset, s.index)):
        if seg.index == prog.constant_segment:
            offs = prog.constant_offsets
            for j, start in enumerate(offs):
                end = offs[j + 1] if j + 1 < len(offs) else seg.nbytes  # ascending (checked by the reader)
                c = constants.get(j)
                name = c.name if c is not None else f"constant{j}"
                n = end - start
                tensor = PlannedTensor(name, c.dtype if c else "uint8", c.shape if c else (), n)
                source = FileRange(f.path, seg.file_offset + start, n, f)
                payloads.append(SegmentPayload(tensor, source, n, tag=f"constant-segment-{seg.index}"))
                roles.append(("constant", j))
            continue
        name = names.get(seg.index, f"segment{seg.index}")
        tensor = PlannedTensor(name, "uint8", (seg.nbytes,), seg.nbytes)
        payloads.append(SegmentPayload(tensor, FileRange(f.path, seg.file_offset, seg.nbytes, f), seg.nbytes))
        roles.append(("segment", seg.index))
    return _Plan(payloads, roles)


def plan_data_file(data: flatbuf.DataFile, f: InputFile) -> _Plan:
    payloads: list[SegmentPayload] = []
    roles: list[tuple[str, int]] = []
    names: dict[int, flatbuf.NamedData] = {}
    for each in data.named_data:
        names.setdefault(each.segment, each)
    for seg in sorted(data.segments, key=lambda s: (s.file_offset, s.index)):
        nd = names.get(seg.index)
        tensor = PlannedTensor(
            nd.key if nd else f"segment{seg.index}",
            nd.dtype if nd else "uint8",
            nd.shape if nd else (seg.nbytes,),
            seg.nbytes,
        )
        payloads.append(SegmentPayload(tensor, FileRange(f.path, seg.file_offset, seg.nbytes, f), seg.nbytes))
        roles.append(("segment", seg.index))
    return _Plan(payloads, roles)


def _write_prefix(f: InputFile, fd: int, nbytes: int) -> None:
    """The flatbuffer (and headers) byte for byte, in bounded chunks: inline constants may make it large."""
    pos = 0
    while pos < nbytes:
        chunk = os.pread(f.fd, min(COPY_CHUNK, nbytes - pos), pos)
        if not chunk:
            raise InvalidModel(f"file ended early at offset {pos} while copying the flatbuffer", f.path)
        written = 0
        while written < len(chunk):
            written += os.pwrite(fd, memoryview(chunk)[written:], pos + written)
        pos += len(chunk)


def _patches(
    plan: _Plan,
    offsets: list[int],
    sizes: list[int],
    segments: list[flatbuf.Segment],
    constant: flatbuf.Segment | None,
    constant_offsets_pos: int,
    path: str,
) -> tuple[int, list[tuple[int, int]]]:
    """(segment base, [(position of a u64 field, new value)]) for the placements; ``Unsupported`` when an omitted
    field would need a value other than its default."""
    by_segment: dict[int, tuple[int, int]] = {}  # segment index -> (absolute start, size)
    pieces: dict[int, tuple[int, int]] = {}  # constant index -> (absolute start, size)
    for (role, idx), off, n in zip(plan.roles, offsets, sizes):
        if role == "segment":
            by_segment[idx] = (off, n)
        else:
            pieces[idx] = (off, n)
    if constant is not None:
        # the segment starts at its first non-empty piece (an empty one may sit anywhere inside)
        filled = [off for off, n in pieces.values() if n] or [off for off, _ in pieces.values()] or [0]
        start = min(filled)
        end = max((off + n for off, n in pieces.values()), default=start)
        by_segment[constant.index] = (start, end - start)
    # an empty segment holds no byte: it may sit at the base whatever its field says, so it does not set the base
    filled = [s for s, n in by_segment.values() if n] or [s for s, _ in by_segment.values()]
    base = min(filled, default=0)
    fields: list[tuple[int, int]] = []
    for seg in segments:
        start, n = by_segment[seg.index]
        rel = start - base if n else 0
        if seg.offset_field is not None:
            fields.append((seg.offset_field, rel))
        elif rel:
            raise Unsupported(
                f"segment {seg.index} has no offset field (the default 0) and cannot be moved in place", path
            )
        if seg.size_field is not None:
            fields.append((seg.size_field, n))
        elif n:
            raise Unsupported(f"segment {seg.index} has no size field and cannot grow in place", path)
    if constant is not None:
        cstart = by_segment[constant.index][0]
        for j, (abs_off, _) in pieces.items():
            fields.append((constant_offsets_pos + 8 * j, max(abs_off - cstart, 0)))
    return base, fields


def convert_file(src: Path, out_dir: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
    """Convert one ``.pte`` or ``.ptd`` into ``out_dir`` (same name)."""
    path = str(src)
    if options.prepack:
        raise UsageError(
            "--prepack is not supported for ExecuTorch: XNNPACK packs at load; load with "
            "weightshare.executorch.program(path) to pack each weight once per process",
            src,
        )
    f = open_input(src)
    try:
        kind = flatbuf.kind_of(os.pread(f.fd, 8, 0))
        report = ConversionReport(model=path, format="executorch")
        if options.unpack:  # other formats' values: nothing of ExecuTorch's is unpacked
            report.notes.append(f"--unpack {','.join(sorted(options.unpack))} is not implemented for ExecuTorch")
        if kind == "pte":
            prog = flatbuf.read_program(f.fd, path)
            plan = plan_program(prog, f)
            prefix = prog.program_size
            segments = prog.segments
            constant = prog.segments[prog.constant_segment] if prog.constant_segment is not None else None
            constant_pos = prog.constant_offsets_pos
            header_pos, size_pos = prog.header_pos, prog.segment_data_size_pos
            if not segments:
                report.notes.append("the program has no segments: its data is inline in the flatbuffer (copied as is)")
        elif kind == "ptd":
            data = flatbuf.read_data_file(f.fd, path)
            plan = plan_data_file(data, f)
            prefix = data.flatbuffer_offset + data.flatbuffer_size
            segments, constant, constant_pos = data.segments, None, 0
            header_pos, size_pos = data.header_pos, data.header_pos + 8
        else:
            raise InvalidModel("not an ExecuTorch program or data file (no ET12/FT01 identifier)", path)
        final = out_dir / src.name
        carried: dict[Path, list[str]] = {}
        if kind == "pte":
            candidates = data_files_beside(src) + [p for p in named_inputs() if p.suffix == ".ptd"]
            carried = locate_data_files(src, prog, f.fd, candidates)
        elif _written_before(tx, final, src, os.fstat(f.fd)):
            report.notes.append(f"{src.name} is written once, with the program that reads it")
            report.outputs.append(str(final))
            return report
        if options.progress_total is not None:
            options.progress_total(sum(p.source.nbytes for p in plan.payloads))
        tmp = tx.new_file(final, os.fstat(f.fd).st_mode & 0o777)
        try:
            fd = os.open(tmp, os.O_WRONLY)
        except OSError as e:
            raise OutputError(f"cannot open output file: {e.strerror}", tmp) from None
        try:
            _write_prefix(f, fd, prefix)
            container = SegmentContainer(fd, prefix, options)
            placements = write_payloads(container, plan.payloads, report, options.progress)
            offsets = [placements.offset(i) for i in range(len(plan.payloads))]
            sizes = [placements.nbytes(i) for i in range(len(plan.payloads))]
            size = container.writer.finish()
            if segments and header_pos:  # no header: every segment is empty (read_program), nothing moved
                base, fields = _patches(plan, offsets, sizes, segments, constant, constant_pos, path)
                fields.append((header_pos, base))
                if size_pos is not None:
                    fields.append((size_pos, size - base))
                for pos, value in fields:
                    container.writer.pwrite(_U64.pack(value), pos)
            report.blob_bytes = size - prefix
        finally:
            os.close(fd)
        report.outputs.append(str(final))
        for ptd, keys in carried.items():
            report.outputs += convert_file(ptd, out_dir, options, tx).outputs
            report.notes.append(f"{ptd.name}: the data file it reads ({len(keys)} keys), converted beside it")
        return report
    finally:
        f.close()


def _written_before(tx: OutputTransaction, final: Path, src: Path, st: os.stat_result) -> bool:
    """Whether this run already wrote this data file to ``final`` (carried by a program, or named twice); a
    different file for the same output is refused, naming both."""
    written = _DATA_WRITTEN.setdefault(tx, {})
    before = written.get(str(final))
    if before is None:
        written[str(final)] = (st.st_dev, st.st_ino, str(src))
        return False
    if before[:2] == (st.st_dev, st.st_ino):
        return True
    raise UsageError(f"{before[2]} and {src} would both be written to {final}; convert them separately", src)
