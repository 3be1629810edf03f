"""``weightshare convert MODEL.mlpackage``: the same package with a page-aligned, deduplicated weight.bin.

scan: walk the program spec for every ``BlobFileValue`` (const values, constexpr
attributes and input bindings, function/block/program attributes, nested blocks
of control-flow ops); write: copy each referenced payload in chunks into the new
weight.bin through the one write path (``weightshare._write``, with ``WeightFileWriter``
as the container); emit: point the ``BlobFileValue`` at the new record, write the
spec, copy every other file of the package byte for byte.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from google.protobuf.message import Message

from ..._atomic import OutputTransaction
from ..._placement import Progress, align_up
from ..._write import write_payloads
from ...errors import InvalidModel, OutputError
from ...options import ConvertOptions
from ...report import ConversionReport, JsonDict
from .milblob import (
    RECORD_ALIGN,
    RECORD_SIZE,
    BlobRecord,
    RecordPayload,
    WeightFile,
    WeightFileWriter,
    record_payload,
)
from .package import (
    MANIFEST,
    MODEL_PATH_PREFIX,
    WEIGHT_FILE,
    WEIGHTS_NAME,
    Package,
    copy_tree,
    dump_manifest,
    read_package,
    resolve_blob_file,
    stable_id,
    write_file,
)

if TYPE_CHECKING:
    from coremltools.proto import MIL_pb2

BLOB_FILE_VALUE = "CoreML.Specification.MILSpec.Value.BlobFileValue"
NEW_FILE_NAME = f"{MODEL_PATH_PREFIX}{WEIGHTS_NAME}/{WEIGHT_FILE}"
# Nested blocks (cond/while_loop bodies) add about six message levels each; protobuf's
# parser stops at 100 levels anyway, this guards specs built in memory.
MAX_DEPTH = 400


def iter_blob_file_values(
    message: Message, depth: int = 0, origin: Path | None = None
) -> Iterator[MIL_pb2.Value.BlobFileValue]:
    """Yield every ``BlobFileValue`` below ``message``, in field order (deterministic)."""
    if depth > MAX_DEPTH:
        raise InvalidModel(f"program nesting is deeper than {MAX_DEPTH} levels", origin)
    if message.DESCRIPTOR.full_name == BLOB_FILE_VALUE:
        yield message
        return
    for fd, value in message.ListFields():
        if fd.message_type is None:
            continue
        if fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            if value_fd.message_type is None:
                continue
            children: Iterable[Message] = [value[k] for k in sorted(value)]
        elif fd.is_repeated:
            children = value
        else:
            children = (value,)
        for child in children:
            yield from iter_blob_file_values(child, depth + 1, origin)


class BlobRelocator:
    """Moves the payloads programs reference into one ``WeightFileWriter``.

    ``collect`` checks every record a program references (nothing is written yet, so bad
    input fails before any data moves); ``write`` copies the payloads and points every
    ``BlobFileValue`` at its new record. The same (file, record offset) referenced twice is
    copied once; identical bytes under different records are stored once by content hash.
    """

    def __init__(self, writer: WeightFileWriter):
        self.writer = writer
        self._files: dict[Path, WeightFile] = {}
        self._records: dict[tuple[Path, int], BlobRecord] = {}  # first-seen order
        self._values: list[tuple[MIL_pb2.Value.BlobFileValue, tuple[Path, int]]] = []
        self.referenced: set[Path] = set()

    def collect(self, pkg: Package, message: Message) -> None:
        for bfv in iter_blob_file_values(message, origin=pkg.model_path):
            path = resolve_blob_file(pkg, bfv.fileName)
            key = (path, bfv.offset)
            if key not in self._records:
                wf = self._files.get(path)
                if wf is None:
                    wf = self._files[path] = WeightFile(path, pkg.model_dir)
                self._records[key] = wf.record(bfv.offset)
            self.referenced.add(path)
            self._values.append((bfv, key))

    def write(self, report: ConversionReport, progress: Progress | None = None) -> None:
        """Copy every payload (``_write.write_payloads``, which fills ``report``'s counters), then point every
        ``BlobFileValue`` at its new record."""
        order: list[tuple[Path, int]] = []

        def payloads() -> Iterator[RecordPayload]:
            for key in self._in_layout_order():  # lazily: the next payload depends on where the last one ended
                order.append(key)
                rec = self._records[key]
                yield record_payload(rec, self._files[key[0]].payload(rec), f"{key[0].name}@{key[1]}")

        placements = write_payloads(self.writer, payloads(), report, progress)
        moved = {key: placements.offset(i) for i, key in enumerate(order)}
        for bfv, key in self._values:
            bfv.fileName = NEW_FILE_NAME
            bfv.offset = moved[key]

    def _place(self, end: int, nbytes: int) -> tuple[int, int]:
        """(data offset, data end) of a payload appended after ``end``."""
        data = align_up(align_up(end, RECORD_ALIGN) + RECORD_SIZE, self.writer.blob.policy.for_size(nbytes))
        return data, data + nbytes

    def _in_layout_order(self) -> Iterator[tuple[Path, int]]:
        """Yield record keys so that small payloads fill the alignment gaps before large ones.

        Each record must sit at the 64-byte boundary after the previous payload (the
        ``GetAllOffsets`` walk), so a large payload's alignment gap can only lie between its
        record and its data. Small payloads that fit there, each with its own record, go
        first; the gap shrinks and the file is no larger than it must be. The order depends
        only on the input, so the output stays deterministic.
        """
        policy = self.writer.blob.policy
        large: list[tuple[Path, int]] = []
        small: list[tuple[Path, int]] = []
        for key, rec in self._records.items():
            (large if policy.for_size(rec.nbytes) > RECORD_ALIGN else small).append(key)
        for key in large:
            target, _ = self._place(self.writer.blob.end, self._records[key].nbytes)
            kept: list[tuple[Path, int]] = []
            for i, s in enumerate(small):
                end = self.writer.blob.end
                if align_up(end, RECORD_ALIGN) + 3 * RECORD_SIZE > target:  # not even a 1-byte payload fits
                    kept.extend(small[i:])
                    break
                _, s_end = self._place(end, self._records[s].nbytes)
                if self._place(s_end, self._records[key].nbytes)[0] == target:
                    yield s
                else:
                    kept.append(s)
            small = kept
            yield key
        yield from small

    @property
    def values(self) -> int:
        return len(self._values)


def open_weight_file(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
    except OSError as e:
        raise OutputError(f"cannot create the weight file: {e.strerror}", path) from None


def convert_file(src: Path, out_dir: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
    """Write ``out_dir/<src.name>``: ``src`` with its weights re-laid out page-aligned and deduplicated."""
    src = Path(src)
    pkg = read_package(src)
    final = Path(out_dir) / src.name
    report = ConversionReport(model=str(src), format="coreml", outputs=[str(final)])
    if options.unpack:
        report.notes.append("Core ML: constexpr decompression (--unpack) is not implemented; weights kept as stored")

    tmp = tx.new_dir(final)
    model_rel = Path(pkg.model_item_path())
    out_model_dir = tmp / "Data" / model_rel.parent
    (out_model_dir / WEIGHTS_NAME).mkdir(parents=True, exist_ok=True)
    weight_path = out_model_dir / WEIGHTS_NAME / WEIGHT_FILE
    fd = open_weight_file(weight_path)
    try:
        writer = WeightFileWriter(fd, options.align)
        relocator = BlobRelocator(writer)
        relocator.collect(pkg, pkg.spec.mlProgram)
        relocator.write(report, options.progress)
        report.blob_bytes = writer.finish() if relocator.values else 0
    finally:
        os.close(fd)

    manifest = pkg.manifest
    skip = set()
    if relocator.values:
        skip |= relocator.referenced | {pkg.model_path.resolve()}
        skip.add((pkg.model_dir / WEIGHTS_NAME / WEIGHT_FILE).resolve())  # replaced, referenced or not
        manifest = _manifest_with_weights(pkg, model_rel)
        if manifest is not pkg.manifest:
            skip.add((pkg.root / MANIFEST).resolve())
    else:  # no weights: the package is copied as it is
        weight_path.unlink()
        weight_path.parent.rmdir()
    copy_tree(pkg.root, tmp, skip)
    if manifest is not pkg.manifest:
        write_file(tmp / MANIFEST, dump_manifest(manifest))
    if relocator.values:
        write_file(tmp / "Data" / model_rel, pkg.spec.SerializeToString(deterministic=True))
    return report


def _manifest_with_weights(pkg: Package, model_rel: Path) -> JsonDict:
    """The source manifest, unchanged when it already lists the weights directory where we write it."""
    want = (model_rel.parent / WEIGHTS_NAME).as_posix()
    item = pkg.items.get(pkg.weights_id) if pkg.weights_id else None
    if item is not None and item["path"] == want:
        return pkg.manifest
    manifest = {**pkg.manifest, "itemInfoEntries": dict(pkg.items)}
    ident = pkg.weights_id or stable_id(pkg.root_id, WEIGHTS_NAME)
    manifest["itemInfoEntries"][ident] = {
        "author": "com.apple.CoreML",
        "description": "CoreML Model Weights",
        "name": WEIGHTS_NAME,
        "path": want,
    }
    return manifest
