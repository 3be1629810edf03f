"""``convert --prepack --shared-blob``: a zoo's models staged into one blob, which becomes the zoo's blob in place.

Staged one by one, each model's plain payloads went into a staged blob of its own and were then copied into the
zoo's: a family whose members hold the same weights wrote them once per member and once more (three decoders:
2.99x the outputs). Here every model's plain payloads go into one staged blob, whose header room is reserved for
all of them; a payload the blob already holds (a family's shared weight) is recognised by its digest before it is
written (``BlobWriter.expect_duplicates``). Each model's ORT child then appends what it keeps to that blob, and
takes the packings an earlier model made there (``PackCache``: they are in the blob already, never copied).
What each child appended is adopted as soon as it is done (hashed where it is, rows kept in offset order), and
the staged blob becomes the zoo's blob in place (``write``), as one model's does (``prepack.StagedBlob``); where
its header outgrows the room, every payload is streamed into a new blob, as before.

Nothing in the staged blob is freed early (``ReleasedRange.releasable``): a range of it may be read by several
models. The staging is removed with the zoo's stack; the final blob is a temporary of the run's transaction
until the run commits.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from weakref import WeakKeyDictionary

from ...._atomic import OutputTransaction
from ...._container import BlobContainer
from ...._inputs import hold
from ...._pipeline import DIGEST_CHARS, BlobPayload, Placements, PreparedModel, write_blob
from ...._placement import BlobEntry
from ...._safetensors import SafetensorsBlob
from ...._tensors import FileRange
from ...._write import account, write_payloads
from ....errors import OutputError
from ....options import ConvertOptions
from ....report import ConversionReport
from ..disk_use import ReleasedRange
from .cpu import unpack_for_cpu
from .prepack import (
    HEADER_SPARE,
    STAGE_FILE,
    PackCache,
    PackedRef,
    StagedBlob,
    _plan,
    check_portable_name,
    run_cache,
    staged_options,
    staging,
)
from .server import run_child

__all__ = ["SharedStage", "prepare_staged", "stage_zoo"]


@dataclass
class SharedStage:
    """A zoo's one staging: its staged blob (``staged``, open), each model's staged report, blob metadata and size,
    the writer's row of every range of the blob it holds (by offset and length; ``plain``: how many rows the
    models' own payloads took), and the payloads the header names as they were staged or adopted (their tensor's
    ``id``)."""

    stage: Path
    staged: StagedBlob
    prefixes: dict[Path, str]
    models: dict[Path, tuple[ConversionReport, dict[str, str], int]]
    plain: int
    found: dict[tuple[int, int], int] = field(default_factory=dict)
    named: set[int] = field(default_factory=set)
    read: set[str] = field(default_factory=lambda: {STAGE_FILE})  # the staging's files payloads are read from

    def write(
        self,
        models: list[PreparedModel],
        blob_path: Path,
        options: ConvertOptions,
        tx: OutputTransaction,
        container: BlobContainer,
        shown: Path | None = None,
    ) -> tuple[Path, int, str, list[Placements]]:
        """``_pipeline.write_models``' blob writer for the zoo: each payload found where it is in the staged blob
        (the first model to take a row stores it, the others take it as a duplicate, under a name of theirs), any
        other one copied in; the staged blob renamed to a temporary of ``tx`` for ``blob_path``, its header
        written."""
        blob, w = self.staged.blob, self.staged.blob.writer
        claimed: set[int] = set()
        chosen: list[list[BlobEntry]] = []
        try:
            for m in models:
                entries = []
                for p in m.payloads:
                    row = self._row(p.source)
                    if row is None:  # not in the staged blob's rows (an off-alignment range): copied in
                        blob.name_unplanned(p.tensor, m.name_prefix)
                        entries.append(blob.place(p))
                        continue
                    if row in claimed and id(p.tensor) not in self.named:  # a packing an earlier model made
                        blob.alias(p.tensor, row, m.name_prefix)
                    entries.append(w.entry(row, row in claimed))
                    claimed.add(row)
                chosen.append(entries)
                blob.metadata.update(m.extra.get("blob_metadata", {}))
        except OSError as e:
            raise OutputError(f"cannot write the blob: {e.strerror or e}", shown or blob_path) from None
        if not blob.header_fits() or os.stat(self.staged.path).st_dev != os.stat(blob_path.parent).st_dev:
            # a header outgrowing its room, or the blob's directory another file system: streamed anew
            return write_blob(models, blob_path, options, tx, container, shown)
        placements = []
        for m, entries in zip(models, chosen):
            placed = Placements()
            for p, entry in zip(m.payloads, entries):
                placed.append(entry)
                account(m.report, p.nbytes_in, entry)
            placements.append(placed)
        tmp = tx.new_file(blob_path)
        os.replace(self.staged.path, tmp)  # the staged blob is the temporary now
        try:
            size = blob.finish()
        except OSError as e:
            raise OutputError(f"cannot write the blob: {e.strerror or e}", shown or blob_path) from None
        return tmp, size, blob.name_digest()[:DIGEST_CHARS], placements

    def _row(self, source: object) -> int | None:
        if isinstance(source, FileRange) and Path(source.path) == self.staged.path:
            return self.found.get((source.offset, source.length))
        return None

    def adopt(self, prepared: PreparedModel, prefix: str, start: int, cache: PackCache | None) -> None:
        """What the model's child appended past ``start`` (its packed copies, the initializers ORT changed), hashed
        where it is and named in the blob. A range equal to a stored one is read from there; when all the child
        appended repeats what is stored and no packing of the run reads it, it is cut off, so that the blob is
        the same whether a packing was reused or made again. No range of the staged blob is freed early."""
        blob = self.staged.blob
        w = blob.writer
        appended: dict[tuple[int, int], BlobPayload] = {}
        for p in prepared.payloads:
            src = p.source
            if isinstance(src, ReleasedRange):
                src.releasable = False  # another model may read the same range
            if isinstance(src, FileRange) and Path(src.path) == self.staged.path and src.offset >= start:
                appended.setdefault((src.offset, src.length), p)
            elif (row := self._row(src)) is not None and row < self.plain:
                self.named.add(id(p.tensor))  # named in the header when it was staged
        fresh = False
        for key in sorted(appended):  # in offset order: the writer's rows stay in it
            p = appended[key]
            entry = blob.adopt(p.tensor, key[0], prefix)
            if entry is None:
                continue
            self.named.add(id(p.tensor))
            fresh = fresh or not entry.duplicate
            self.found.setdefault((entry.offset, entry.nbytes), w.rows - 1)
            if entry.duplicate:  # read from the stored copy (by the streamed blob too, if it comes to that)
                p.source = ReleasedRange(str(self.staged.path), entry.offset, entry.nbytes, releasable=False)
        size = os.fstat(self.staged.fd).st_size
        if not fresh and size > start and not _reads_past(cache, self.staged.path, start):
            os.ftruncate(self.staged.fd, start)
            size = start
        w.end = max(w.end, size)  # past what else the child appended (the final blob's padding)


def _reads_past(cache: PackCache | None, path: Path, start: int) -> bool:
    """Whether a packing of the run reads ``path`` past ``start``."""
    for packing in (cache.packings if cache is not None else {}).values():
        for _p, value, file in packing["entries"]:
            if Path(file) == path and any(int(b[0]) + int(b[1]) > start for b in PackedRef.parse(value, path).buffers):
                return True
    return False


_shared: WeakKeyDictionary[object, SharedStage] = WeakKeyDictionary()


def stage_zoo(sources: list[Path], out_dir: Path, options: ConvertOptions, stages: ExitStack) -> None:
    """Stage every model of the zoo ``stages`` stands for: each one's portable conversion into one staging, their
    payloads into one staged blob (header room for all of them), each distinct payload written once."""
    held = stages.enter_context(staging(out_dir))
    stage = (held / "stage").absolute()  # the ranges of every model name the staged blob alike
    stage.mkdir()
    from ..convert import prepare

    plans = []
    for src in sources:
        check_portable_name(src)
        with hold(src):
            plans.append(prepare(src, stage, staged_options(options), unpack_for_cpu))
    path = stage / STAGE_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    stages.callback(os.close, fd)  # before the staging goes (the stack unwinds in reverse)
    prefixes = {src: f"{src.stem}/" if len(sources) > 1 else "" for src in sources}
    planned = [p.tensor for plan in plans for p in plan.payloads]
    metadata = {k: v for plan in plans for k, v in plan.extra.get("blob_metadata", {}).items()}
    names = [prefixes[src] for src, plan in zip(sources, plans) for _ in plan.payloads]
    blob = SafetensorsBlob(fd, planned, options.align, metadata=metadata, prefixes=names, spare=HEADER_SPARE)
    if options.progress_total is not None:  # the bulk of the zoo's blob: it is written in place of this one
        options.progress_total(sum(t.nbytes for t in planned))
    models = {}
    for src, plan in zip(sources, plans):
        placements = write_payloads(blob, plan.payloads, plan.report, options.progress)
        blob.expect_duplicates()  # a family's next model holds the same weights: hashed before written
        own = sum(p.nbytes_in for p in plan.payloads)
        plan.payloads = []
        with OutputTransaction() as tx:
            plan.emit(STAGE_FILE, placements, tx)
        models[src] = (plan.report, plan.extra.get("blob_metadata", {}), own + (stage / src.name).stat().st_size)
    blob.writer.drop_buffers()
    w = blob.writer
    shared = SharedStage(stage, StagedBlob(path, fd, blob), prefixes, models, w.rows)
    shared.found = {(w.offset(r), w.nbytes(r)): r for r in range(w.rows)}
    _shared[stages] = shared


def prepare_staged(src: Path, out_dir: Path, options: ConvertOptions, stages: ExitStack) -> PreparedModel | None:
    """``prepare_prepacked`` of a model ``stage_zoo`` staged (None: it staged none): its ORT child run on the
    zoo's staged blob, what the child appended adopted; its payloads are written by ``SharedStage.write``."""
    shared = _shared.get(stages)
    if shared is None or src not in shared.models:
        return None
    report, metadata, own = shared.models.pop(src)
    shared.staged.own = own
    start, cache, child = os.fstat(shared.staged.fd).st_size, run_cache(stages), run_child(stages)
    prepared = _plan(src, out_dir, options, shared.stage, shared.staged, report, metadata, cache, False, child)
    shared.adopt(prepared, shared.prefixes[src], start, cache)
    shared.read |= {Path(p.source.path).name for p in prepared.payloads if isinstance(p.source, FileRange)}
    keep = shared.read | {s.name for s in shared.models}  # and the models still to pack
    for f in shared.stage.iterdir():  # the child's files and the staged model, read: the next child's are its own
        if f.name not in keep and f.is_file() and not f.is_symlink():
            f.unlink()
    prepared.extra["write_blob"] = shared.write
    return prepared
