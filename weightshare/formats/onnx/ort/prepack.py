"""``convert --prepack`` for ONNX: ONNX Runtime's pre-packed and NCHWc weights in the shared blob.

Without it, a default-option ORT session copies every MatMul/Gemm weight into a private pre-packed
buffer and, at ORT_ENABLE_ALL, every Conv weight into an NCHWc-reordered one, so
converted models share nothing at default settings. ORT can save both: the level-ALL optimized
graph with reordered Conv weights as initializers, and each pre-packed copy as a ``prepacked_N``
external-data entry that later sessions map instead of packing.

Steps:
1. stage: the ordinary conversion into a staging directory (the portable model and its blob, whose header
   room is reserved for the final blob's: ``StagedBlob``).
2. ort: a child process lets ORT optimize and pre-pack the staged model and save the result
   (``child.py``), segment by segment for large graphs (``segments.py``). It appends the packed buffers and
   the initializers ORT changed to the staged blob, each where the final blob keeps it; ORT's own files (a copy
   of every weight a session saves) go to a memory-backed scratch, one segment's or node's at a time.
3. final: the staged blob becomes the final one in place (``StagedBlob.write``): the plain payloads and the
   child's appended bytes are hashed where they are, never copied; only packings an earlier model of the run
   made are copied in. Identical bytes are stored once. Where that cannot be (a header outgrowing its room),
   every payload is streamed into a new blob, as before. A ``--shared-blob`` zoo stages all its models into one
   blob, which becomes the zoo's in place (``prepack_zoo``).
4. emit: MODEL.onnx (prepacked, default options) and MODEL.portable.onnx (any CPU, with
   ``session.disable_prepacking=1``), both pointing into the blob.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from weakref import WeakKeyDictionary

from ...._atomic import OutputTransaction, locked_stage
from ...._checksum import DIGEST
from ...._container import BlobContainer
from ...._disk import DiskPeak
from ...._pipeline import DIGEST_CHARS, BlobPayload, Placements, PreparedModel, blob_target, write_blob, write_models
from ...._placement import BlobEntry, PlannedTensor
from ...._safetensors import CONTAINER, SafetensorsBlob
from ...._tensors import FileRange
from ...._write import account, write_payloads
from ....errors import InvalidModel, OutputError, Unsupported, UsageError
from ....options import ConvertOptions
from ....report import ConversionReport, JsonDict
from .. import dtypes
from .._proto import load_model, pb
from ..disk_use import ReleasedRange, mark_overlaps, memory_scratch
from ..graph import external_tensors
from .cpu import PREFIX as INSERTED_CAST
from .cpu import keep_casts_at_run, unpack_for_cpu
from .fold_bound import check_staged
from .limits import TARGET_ENV as TARGET_ENV  # the tests set it through this module
from .limits import budget_from_env, limits_for
from .names import LOAD, LoadRefused, apply_saved_hook, unknown_entry_message, unknown_keys
from .names import PACKED_FILE_KEY as PACKED_FILE_KEY  # the child's: the file its prepacked_N entries point into
from .names import PREPACKED_ENTRY as PREPACKED_ENTRY  # the tests read it here
from .opened import require_floor
from .prepack_record import METADATA_KEY, PACKED_PREFIX, PAIR_KEY
from .probe import STAMP_DOMAIN, packed_buffers
from .reload import inline_load_reads, load_probes, reload_change
from .server import OrtChild, run_child
from .unfuse import drop_unused, unfuse_scales

OPTIMIZED_PREFIX = "ort.optimized/"  # ORT initializers not identical to a plain payload (NCHWc Conv weights, fusions)
STAGE_FILE = "plain.safetensors"  # the staged blob, which becomes the final one
HEADER_SPARE = 3.0  # header room reserved in the staged blob for the packed and optimized entries
ORT_MODEL = "ort.onnx"  # its initializers: ort.bin, or ort.seg<a>-<b>.bin per segment
# ORT maps a saved pre-packed buffer only when its address is aligned (onnxruntime 1.32 on x86-64: 256 bytes);
# otherwise it preads the buffer into a private heap copy per session (a genai int4 folder with packed buffers
# at 64-byte offsets kept 10-12 MiB per session). A mapping starts on a page, so a page-aligned offset gives a
# page-aligned address, whatever alignment a kernel or a CPU asks for up to the page size.
PACKED_ALIGN = 4096


def portable_name(model_name: str) -> str:
    """File name of the portable model written next to the prepacked one."""
    stem = model_name[: -len(".onnx")] if model_name.endswith(".onnx") else model_name
    return f"{stem}.portable.onnx"


def _entries(tensor: pb.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


@dataclass
class PackedRef:
    """One ``prepacked_N`` entry: ``<kernel>+<hash>|<offset>;<size>;<alignment>[|...]``."""

    key: str
    buffers: list[list[str]]  # [offset, size, rest...] per packed buffer

    @classmethod
    def parse(cls, value: str, path: Path) -> PackedRef:
        if packed_buffers(value) is None:
            raise InvalidModel(f"unexpected pre-packed entry {value[:80]!r} from onnxruntime", path)
        key, *parts = value.split("|")
        return cls(key, [p.split(";") for p in parts])

    def render(self) -> str:
        return "|".join([self.key, *(";".join(b) for b in self.buffers)])


class Relocator:
    """Distinct byte ranges of the staged files -> blob payloads, and the model edits that follow. ``stage``: the
    staging whose blocks are freed as the blob takes them; ranges elsewhere (a packing an earlier model of the run
    made, in its staging or its blob) are only read."""

    def __init__(self, stage: Path | None = None, cache: PackCache | None = None) -> None:
        self.stage = stage
        self.cache = cache
        self.payloads: list[BlobPayload] = []
        self.order: dict[tuple[str, int, int], int] = {}  # (file, offset, length) -> its payload's position
        self.where: dict[tuple[str, int, int], int] = {}  # (file, offset, length) -> offset in the blob, once placed
        self.edits: list[Callable[[str], None]] = []

    def payload(self, path: Path, offset: int, length: int, planned: PlannedTensor) -> tuple[str, int, int]:
        rng = (str(path), offset, length)
        if rng not in self.order:
            self.order[rng] = len(self.payloads)
            source: FileRange
            if self.stage is None or path.is_relative_to(self.stage):
                source = ReleasedRange(str(path), offset, length)  # its blocks are freed once the blob holds them
            else:  # read only, never freed: an earlier model's, most likely already in a zoo's blob
                source = ReleasedRange(str(path), offset, length, releasable=False)
                if self.cache is not None:
                    self.cache.keep(rng)
            source.check_within(path.stat().st_size)
            self.payloads.append(BlobPayload(planned, source, length))
        return rng

    def rewrite(self, location: str, placements: Placements) -> None:
        """Point every tensor and packed buffer at the blob: ``placements`` are by ``payloads`` position."""
        self.where = {rng: placements.offset(i) for rng, i in self.order.items()}
        for edit in self.edits:
            edit(location)

    def add_tensor(
        self, tensor: pb.TensorProto, directory: Path, name: str, packed_elsewhere: Sequence[Sequence[str]] = ()
    ) -> None:
        """Place ``tensor``'s payload and its pre-packed buffers: its own ``prepacked_N`` entries (in its
        file) and ``packed_elsewhere`` ([entry value, file name in ``directory``], from node-by-node packing)."""
        e = _entries(tensor)
        unknown = unknown_keys(e, frozenset({PACKED_FILE_KEY}))
        if unknown:  # a packed copy under another ORT release's key would be dropped here, silently
            raise Unsupported(f"--prepack: {unknown_entry_message(unknown[0])}")
        path = directory / e["location"]
        offset, length = int(e.get("offset", "0")), int(e.get("length", "-1"))
        if length < 0:
            length = path.stat().st_size - offset
        dtype = dtypes.NAMES.get(tensor.data_type, "uint8")
        rng = self.payload(path, offset, length, PlannedTensor(name, dtype, tuple(tensor.dims), length))
        # ORT's own entries point into the tensor's file; those the child moved (PACKED_FILE_KEY) into that file
        packs = directory / e[PACKED_FILE_KEY] if PACKED_FILE_KEY in e else path
        found = [(PackedRef.parse(v, packs), packs) for k, v in e.items() if k.startswith(PREPACKED_ENTRY)]
        found += [(PackedRef.parse(v, directory / f), directory / f) for v, f in packed_elsewhere]
        packed, ranges, keys = [], [], set()
        for ref, where in found:
            if ref.key in keys:  # two nodes, one kernel: the same packed bytes under the same key
                continue
            keys.add(ref.key)
            packed.append(ref)
            for i, buf in enumerate(ref.buffers):
                size = int(buf[1])
                name = f"{PACKED_PREFIX}{tensor.name}/{ref.key}/{i}"
                planned = PlannedTensor(name, "uint8", (size,), size, min_align=PACKED_ALIGN)
                ranges.append(self.payload(where, int(buf[0]), size, planned))
        self.edits.append(lambda location: self._rewrite(tensor, location, rng, packed, ranges))

    def _rewrite(
        self,
        tensor: pb.TensorProto,
        location: str,
        rng: tuple[str, int, int],
        packed: list[PackedRef],
        ranges: Iterable[tuple[str, int, int]],
    ) -> None:
        ranges = iter(ranges)
        for ref in packed:
            for buf in ref.buffers:
                buf[0] = str(self.where[next(ranges)])
        values = {
            "location": location,
            "offset": str(self.where[rng]),
            "length": str(rng[2]),
            **{f"{PREPACKED_ENTRY}{i}": ref.render() for i, ref in enumerate(packed)},
        }
        del tensor.external_data[:]
        for k, v in values.items():
            entry = tensor.external_data.add()
            entry.key, entry.value = k, v


REUSE_ENV = "WEIGHTSHARE_PREPACK_REUSE"  # "0": no packing reused, every model packs its own (the bench's "before")


class PackCache:
    """The node packings one run made (``child.packing_key`` -> ``child.Packing`` as JSON, files absolute), so
    that a later model of the run (a folder's decoder, decoder_with_past and merged decoder hold the same
    weights) takes them instead of running ORT's sessions again.

    A packing points into the staging of the model that made it until that model's blob is written (a zoo's
    one blob is written last: its ranges then keep their blocks, ``keep``), then into that blob, which stays
    until the run commits (``rehome``)."""

    def __init__(self) -> None:
        self.packings: dict[str, JsonDict] = {}
        self.staged: dict[tuple[str, int, int], ReleasedRange] = {}  # ranges of a staging that packings read
        self.pending: list[tuple[str, Relocator]] = []  # packings still in a staging, and its model's relocator
        # (blob, offset, length) -> tagged digest of a packed buffer in a written blob: a later model's copy of it
        # is not hashed again (``StagedBlob.known``)
        self.digests: dict[tuple[str, int, int], str] = {}

    def keep(self, rng: tuple[str, int, int]) -> None:
        """A later model reads ``rng`` from an earlier model's staging: its blocks stay until the staging goes."""
        if rng in self.staged:
            self.staged[rng].releasable = False

    def add(self, made: dict[str, JsonDict], stage: Path, reloc: Relocator) -> None:
        """Record the packings a model's child made (files relative to ``stage``) and the ranges they read."""
        for key, packing in made.items():
            # absolute: the child reads them from its own directory (a relative OUTDIR named them twice over)
            entries = [[p, v, str((stage / f).absolute())] for p, v, f in packing["entries"]]
            self.packings[key] = {"entries": entries, "skip": packing["skip"]}
            self.pending.append((key, reloc))
            for _p, value, file in entries:
                for buf in PackedRef.parse(value, stage).buffers:
                    rng = (file, int(buf[0]), int(buf[1]))
                    source = reloc.payloads[reloc.order[rng]].source if rng in reloc.order else None
                    if isinstance(source, ReleasedRange) and source.releasable:
                        self.staged[rng] = source

    def rehome(self, blob: Path | None, digests: Sequence[str] = ()) -> None:
        """The blob holding the pending packings is written (at ``blob``, until the run commits): they point
        there now; None: it is not to be read (the packings are forgotten). ``digests``: the digests of that
        model's payloads by position (``StagedBlob.placed``)."""
        for key, reloc in self.pending:
            entries: list[list[object]] | None = []
            for p, value, file in self.packings[key]["entries"]:
                ref = PackedRef.parse(value, Path(file))
                places = [reloc.where.get((file, int(b[0]), int(b[1]))) for b in ref.buffers]
                if blob is None or entries is None or None in places:
                    entries = None
                    continue
                for b, at in zip(ref.buffers, places):
                    i = reloc.order.get((file, int(b[0]), int(b[1])))
                    if i is not None and i < len(digests) and at is not None:
                        self.digests[(str(blob), at, int(b[1]))] = digests[i]
                    b[0] = str(at)
                entries.append([p, ref.render(), str(blob)])
            if entries is None:
                self.packings.pop(key, None)
            else:
                self.packings[key]["entries"] = entries
        self.pending.clear()
        self.staged.clear()

    def known_file(self, path: Path) -> str:
        """The child's argument: ``path`` with the packings made so far written to it."""
        path.write_text(json.dumps(self.packings))
        return str(path)


_caches: WeakKeyDictionary[object, PackCache] = WeakKeyDictionary()


def run_cache(run: object) -> PackCache | None:
    """The packing cache of the run ``run`` stands for (its transaction, or a zoo's staging stack): kept while
    ``run`` lives. None when ``REUSE_ENV`` is "0"."""
    if os.environ.get(REUSE_ENV, "1") == "0":
        return None
    return _caches.setdefault(run, PackCache())


class StagedBlob:
    """The staged conversion's blob, kept open so that the final blob is written in its place: its header room
    reserved for the final header (``HEADER_SPARE``), its payloads already where the final blob keeps them,
    and the ORT child's packed and changed bytes appended after them (``child.Target``)."""

    def __init__(self, path: Path, fd: int, blob: SafetensorsBlob) -> None:
        self.path, self.fd, self.blob = path, fd, blob
        self.plain_end = blob.writer.end
        self.own: int | None = None  # a zoo's staging: the staged bytes of the model packed now (its child's bounds)
        self.known: dict[tuple[int, int], str] = {}  # (offset, length) -> digest of bytes the child copied in
        self.placed: list[str] = []  # once written: each payload's digest, by position
        w = blob.writer
        self.largest = max((w.nbytes(r) for r in range(w.rows)), default=0)

    def digests(self) -> list[list[int | str]]:
        """(offset, length, hex digest) of each payload the staging wrote, where the digests are of the kind the
        child hashes with (``child.Target.digests``); none from a writer of another kind."""
        w = self.blob.writer
        if w.digest != DIGEST:
            return []
        return [[w.offset(r), w.nbytes(r), w.hexdigest(r)] for r in range(w.rows) if w.offset(r) < self.plain_end]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def write(
        self,
        payloads: list[BlobPayload],
        metadata: dict[str, str],
        blob_path: Path,
        tx: OutputTransaction,
        report: ConversionReport,
    ) -> tuple[Path, int, str, Placements] | None:
        """The final blob in place: ``payloads`` (``Relocator``'s) found where they are in the staged blob,
        the child's appended ones adopted in offset order (hashed, not copied), the rest (a range of another
        file, or one ``adopt`` cannot keep where it is) copied in under a name of its own; renamed to a
        temporary of ``tx`` for ``blob_path``. None when the header would not fit its room: the caller streams
        a new blob from the staged one, which is left as it was but for bytes appended at its end."""
        blob, w = self.blob, self.blob.writer
        # by offset and length: a zero-length payload's row starts where the next payload's does (an empty
        # Resize roi stored first), and by offset alone it was copied in as a nameless alias
        staged = {(w.offset(r), w.nbytes(r)): r for r in range(w.rows)}
        entries: list[BlobEntry | None] = [None] * len(payloads)
        src_len = [p.tensor.nbytes for p in payloads]
        adopt, copy = [], []
        for i, p in enumerate(payloads):
            src = p.source
            if isinstance(src, FileRange) and Path(src.path) == self.path:
                row = staged.get((src.offset, src.length))
                if row is not None:
                    entries[i] = w.entry(row)
                    continue
                if src.offset >= self.plain_end:
                    adopt.append((src.offset, i))
                    continue
            copy.append(i)
        for offset, i in sorted(adopt):
            entries[i] = blob.adopt(payloads[i].tensor, offset, digest=self.known.get((offset, src_len[i])))
            if entries[i] is None:  # off the writer's alignment: copied as any other
                copy.append(i)
        w.end = max(w.end, os.fstat(self.fd).st_size)  # past whatever else the child appended
        for i in sorted(copy):
            blob.name_unplanned(payloads[i].tensor)  # not in the staged blob's plan: else its header name is ""
            entries[i] = blob.place(payloads[i])
        blob.metadata.update(metadata)
        if not blob.header_fits():
            return None
        placements = Placements()
        for p, e in zip(payloads, entries):
            assert e is not None
            placements.append(e)
            account(report, p.nbytes_in, e)
        if os.stat(self.path).st_dev != os.stat(blob_path.parent).st_dev:
            return None  # the blob's directory is another file system (a mount below OUTDIR): streamed anew
        tmp = tx.new_file(blob_path)
        os.replace(self.path, tmp)  # the staged blob is the temporary now
        self.placed = [e.digest for e in entries if e is not None]
        size = blob.finish()
        return tmp, size, blob.name_digest()[:DIGEST_CHARS], placements


def staged_options(options: ConvertOptions) -> ConvertOptions:
    """The staged (portable) conversion's options: the run's layout and unpacking, nothing else."""
    return ConvertOptions(
        align=options.align,
        inline_threshold=options.inline_threshold,
        keep_packed=options.keep_packed,
        unpack=options.unpack,
    )


def check_portable_name(src: Path) -> None:
    if portable_name(src.name) == src.name:
        raise UsageError(
            f"with --prepack the portable model {portable_name(src.name)!r} would overwrite the "
            "model; rename the model",
            src,
        )


def _stage_portable(
    src: Path, stage: Path, options: ConvertOptions
) -> tuple[ConversionReport, dict[str, str], StagedBlob]:
    """The ordinary conversion into ``stage``: the portable model and its blob (``StagedBlob``, left open and
    without its header: the final blob is written in its place)."""
    from ..convert import prepare

    prepared = prepare(src, stage, staged_options(options), unpack_for_cpu)
    metadata = prepared.extra.get("blob_metadata", {})
    path = stage / STAGE_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        planned = [p.tensor for p in prepared.payloads]
        blob = SafetensorsBlob(fd, planned, options.align, metadata=metadata, spare=HEADER_SPARE)
        if options.progress_total is not None:  # the bulk of the final blob's bytes: it is written in place of this
            options.progress_total(sum(t.nbytes for t in planned))
        placements = write_payloads(blob, prepared.payloads, prepared.report, options.progress)
        blob.writer.drop_buffers()
        prepared.payloads = []
        with OutputTransaction() as tx:
            prepared.emit(STAGE_FILE, placements, tx)
    except BaseException:
        os.close(fd)
        raise
    return prepared.report, metadata, StagedBlob(path, fd, blob)


def _run_ort(
    model: Path,
    src: Path,
    options: ConvertOptions,
    cache: PackCache | None = None,
    staged: StagedBlob | None = None,
    in_place: bool = False,
    child: OrtChild | None = None,
) -> tuple[JsonDict, float]:
    """ORT's optimized graph and node-by-node packed copies, in the run's child process (``child``; None: one
    for this model alone); (its result, its peak RSS). ``cache``: the run's packings, which the child reuses
    (None: it reuses none). ``staged``: the child appends what it keeps to that blob (``child.Target``);
    ``in_place``: that blob becomes the final one, so a reused packing is copied into it as well, where the
    child's own would go."""
    if importlib.util.find_spec("onnxruntime") is None:
        raise Unsupported("--prepack needs onnxruntime installed (it saves ONNX Runtime's packed weights)", src)
    require_floor(src)
    argv = [
        str(model),
        str(model.parent / ORT_MODEL),
        str(options.inline_threshold),
        str(budget_from_env()),
        cache.known_file(model.parent.parent / "packings.json") if cache is not None else "-",
    ]
    staged_model = load_model(model)  # parsed once for both checks
    check_staged(model, src, options.ort_max_growth, staged_model)  # a folding bomb is refused before the child
    widened = _half_bytes(staged_model)
    if options.stage is not None:
        options.stage("onnxruntime optimizes and packs the weights (child process)")
    runner = child if child is not None else OrtChild()
    try:
        if staged is None:
            res, fresh = _run_bounded(argv, model.parent, src, options, runner, widened=widened)
        else:
            with memory_scratch(model.parent, SCRATCH_HOLD * max(budget_from_env(), staged.largest)) as scratch:
                doc = {
                    "blob": STAGE_FILE,
                    "align": options.align.render(),
                    "scratch": scratch,
                    "copy_reused": in_place,
                    "digests": staged.digests(),
                }
                env = {TARGET_ENV: json.dumps(doc)}
                res, fresh = _run_bounded(
                    argv, model.parent, src, options, runner, env, staged.path, widened, staged.own
                )
    finally:
        if child is None:
            runner.close()
    if res.returncode != 0:
        why = (res.stderr.strip().splitlines() or ["no output"])[-1].replace(str(model.parent) + os.sep, "")
        raise Unsupported(f"onnxruntime could not optimize and pre-pack the model ({why})", src)
    result: JsonDict = json.loads(res.stdout.strip().splitlines()[-1])  # {"binding": ..., "packed": ...}
    served = result.pop("child")
    result["child"] = {"started": fresh, "sessions": served["sessions"]}
    return result, float(served["peak_rss_mib"])


SCRATCH_HOLD = 4  # a session's file in the scratch: its weights and packed copies (x 2), a window's two segments


def _half_bytes(model: pb.ModelProto) -> int:
    """The bytes of ``model``'s external fp16/bf16 tensors."""
    half = {pb.TensorProto.FLOAT16, pb.TensorProto.BFLOAT16}
    return sum(int(_entries(t).get("length", "0") or 0) for t in external_tensors(model) if t.data_type in half)


def _run_bounded(
    argv: list[str],
    stage: Path,
    src: Path,
    options: ConvertOptions,
    child: OrtChild,
    request_env: dict[str, str] | None = None,
    grows: Path | None = None,
    widened: int = 0,
    own: int | None = None,
) -> tuple[subprocess.CompletedProcess[str], bool]:
    """``argv`` (one model) by ``child`` under the limits of ``limits`` for the staged model; a limit hit is one
    Unsupported line. The result, and whether the child was started for it. ``request_env``: variables set in
    the child for this model alone; ``grows``: a file of the staging the child appends to (the staged blob),
    whose growth counts as written; ``widened``: the staged fp16/bf16 payload bytes, which the bounds count at
    their fp32 size (ORT's CPU provider casts them: the optimized graph holds an fp32 copy and its packing); ``own``:
    the staged model's bytes, where the staging holds other models' too (a zoo's)."""
    before = set(stage.iterdir())
    base = grows.stat().st_size if grows is not None else 0
    limits = limits_for(
        (own if own is not None else sum(f.stat().st_size for f in before if f.is_file())) + widened,
        src,
        options.ort_child_timeout_s,
        options.ort_child_memory_mib,
        options.ort_max_growth,
    )
    # glibc's own allocation thresholds: a fixed MALLOC_MMAP_THRESHOLD_ made every packing buffer a fresh mapping,
    # faulted in and zeroed page by page (an optimum BART folder: 0.15 s of the child's CPU), for no lower peak (the
    # child trims its heap after each session: ``malloc_trim``)
    env = dict(os.environ)
    # the file-size limit is per file: the staged blob may grow by what any one file may hold
    bounds = replace(limits, output_bytes=limits.output_bytes + base)
    try:
        res, fresh = child.request(argv, bounds, env, request_env)
    except subprocess.TimeoutExpired:
        raise Unsupported(limits.timeout_message(), src) from None
    written = [f for f in stage.iterdir() if f not in before]
    grown = grows.stat().st_size - base if grows is not None and grows.exists() else 0
    if res.returncode != 0 and (hit := bounds.failure(res.returncode, res.stderr, written)) is not None:
        raise Unsupported(hit, src)
    limits.check_output(written, grown)
    return res, fresh


def convert_prepacked(src: Path, out_dir: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
    """Write OUT/MODEL.onnx (prepacked), OUT/MODEL.portable.onnx and one blob holding both models' payloads.
    The packings it makes are reused by the later models of the run (``tx``'s): read from this blob."""
    target = blob_target(src, out_dir, options.blob_name, CONTAINER)
    cache = run_cache(tx)
    with DiskPeak(out_dir) as disk:
        with staging(out_dir) as held:
            prepared, staged = _prepare(src, out_dir, options, held, cache, child=run_child(tx))
            disk.sample()
            try:
                write_models([prepared], out_dir, target, options, tx, _in_place(staged))
            finally:
                staged.close()
                if cache is not None:  # the staging goes now: what it held is in the blob (or forgotten)
                    blob = next((Path(o) for o in prepared.report.outputs if o.endswith(CONTAINER.suffix)), None)
                    cache.rehome(tx.staged(blob) if blob is not None else None, staged.placed)
            disk.sample()
    report_disk(prepared.report, disk.peak)
    return prepared.report


def report_disk(report: ConversionReport, peak: int) -> None:
    """The temporary disk peak next to the final outputs (``disk_use``)."""
    final = report.blob_bytes + report.prepack.pop("model_file_bytes", 0)  # not committed yet: sizes as written
    report.prepack["temp_disk_peak_bytes"] = peak
    report.prepack["final_output_bytes"] = final
    ratio = f", {peak / final:.2f}x" if final else ""
    report.notes.append(
        f"--prepack: temporary disk peak in the output directory {peak / 2**20:.1f} MiB "
        f"(final outputs {final / 2**20:.1f} MiB{ratio})"
    )


def staging(out_dir: Path) -> AbstractContextManager[Path]:
    """A temporary directory in ``out_dir`` (same file system as the outputs), uniquely named and flock-ed from
    creation to removal (``_atomic.locked_stage``): a concurrent run, in this PID namespace or another, neither
    reuses nor removes it."""
    return locked_stage(out_dir, "prepack")


def _in_place(staged: StagedBlob) -> Callable[..., tuple[Path, int, str, list[Placements]]]:
    """``write_models``' blob writer for one model: the staged blob made the final one (``StagedBlob.write``),
    or, where its header would not fit, every payload streamed into a new blob (``write_blob``)."""

    def write(
        models: list[PreparedModel],
        blob_path: Path,
        options: ConvertOptions,
        tx: OutputTransaction,
        container: BlobContainer,
        shown: Path | None = None,
    ) -> tuple[Path, int, str, list[Placements]]:
        (model,) = models
        metadata = model.extra.get("blob_metadata", {})
        try:
            done = staged.write(model.payloads, metadata, blob_path, tx, model.report)
        except OSError as e:
            raise OutputError(f"cannot write the blob: {e.strerror or e}", shown or blob_path) from None
        if done is None:
            return write_blob(models, blob_path, options, tx, container, shown)
        tmp, size, digest, placements = done
        return tmp, size, digest, [placements]

    return write


def prepare_prepacked(
    src: Path,
    out_dir: Path,
    options: ConvertOptions,
    held: Path,
    cache: PackCache | None = None,
    child: OrtChild | None = None,
) -> PreparedModel:
    """Stage, let ORT optimize and pre-pack, and plan both models' payloads (read from ``held`` until written).

    The returned model emits MODEL.onnx and MODEL.portable.onnx into ``out_dir``; its payloads go into
    whatever blob ``write_models`` is given, one model's own or a ``--shared-blob`` zoo's. ``cache``: the run's
    packings (``PackCache``), reused where a node's one-node model is one packed before, and added to. ``child``:
    the run's onnxruntime child (``server.run_child``), which serves every model of the run; None: one for this
    model alone.
    """
    prepared, staged = _prepare(src, out_dir, options, held, cache, in_place=False, child=child)
    staged.close()  # read by its ranges from here on
    return prepared


def _prepare(
    src: Path,
    out_dir: Path,
    options: ConvertOptions,
    held: Path,
    cache: PackCache | None = None,
    in_place: bool = True,
    child: OrtChild | None = None,
) -> tuple[PreparedModel, StagedBlob]:
    """``prepare_prepacked``, and the staged blob, still open, that the final blob may be written in place of
    (``in_place``: it will be)."""
    check_portable_name(src)
    # The staged conversion commits into its own directory and flocks it while renaming: that must be
    # another directory than the one held here, or the run would wait on its own lock.
    stage = held / "stage"
    stage.mkdir()
    report, staged_metadata, staged = _stage_portable(src, stage, options)
    try:
        prepared = _plan(src, out_dir, options, stage, staged, report, staged_metadata, cache, in_place, child)
    except BaseException:
        staged.close()
        raise
    return prepared, staged


def _plan(
    src: Path,
    out_dir: Path,
    options: ConvertOptions,
    stage: Path,
    staged: StagedBlob,
    report: ConversionReport,
    staged_metadata: dict[str, str],
    cache: PackCache | None,
    in_place: bool,
    child: OrtChild | None,
) -> PreparedModel:
    result, child_peak = _run_ort(stage / src.name, src, options, cache, staged, in_place, child)
    if cache is not None:  # the packings the child copied from an earlier model's blob: hashed there already
        for at, length, file, there in result.get("copied", []):
            if (digest := cache.digests.get((file, there, length))) is not None:
                staged.known[(at, length)] = digest
    binding = result["binding"]
    portable, optimized = load_model(stage / src.name), load_model(stage / ORT_MODEL)
    apply_saved_hook(optimized)  # tests rename what ORT emits here (``names``)
    inline_load_reads(optimized, stage)  # what ORT reads at load, inline whatever --inline-threshold says
    # a Cast of a constant left in ORT's graph ran at every run of the original (a shared fp16 weight or scalar):
    # a session loading the saved graph would fold it, and its readers would take a constant
    at_run = keep_casts_at_run(optimized.graph)
    if at_run:
        report.notes.append(
            f"--prepack: {at_run} fp16 weight(s) or constant(s) read by several nodes stay behind the Cast "
            "onnxruntime runs at every run in the original (overridable initializers, so that a session does not "
            "fold them; onnxruntime advises removing them from the graph inputs: do not, that folds the Cast and "
            "changes the outputs)"
        )
    _settle(optimized, stage, src, options, binding, report)
    _stamp(optimized, binding)
    # fail closed: a pair the installed onnxruntime refuses is never written. The portable model is the staged
    # one, which the child opened whole at level ALL with pre-packing off when it optimized it in one piece (the
    # probe would stand its weights in: it checks the graph, which that session loaded as written)
    pair = [(optimized, src.name)]
    if not result.get("loaded_whole"):
        pair.append((portable, portable_name(src.name)))
    _require_loads(pair, stage, src, options, str(binding["onnxruntime"]), child)
    reloc = Relocator(stage, cache)
    for t in external_tensors(portable):
        reloc.add_tensor(t, stage, t.name)
    plain = len(reloc.payloads)
    for t in external_tensors(optimized):
        reloc.add_tensor(t, stage, f"{OPTIMIZED_PREFIX}{t.name}", result["packed"].get(t.name, []))
    packed = [p for p in reloc.payloads[plain:] if p.tensor.name.startswith(PACKED_PREFIX)]
    mark_overlaps([p.source for p in reloc.payloads if isinstance(p.source, ReleasedRange)])
    if cache is not None:
        cache.add(result.get("packings", {}), stage, reloc)
    names = {
        "prepacked_model": src.name,
        "portable_model": portable_name(src.name),
        "portable_models": {src.name: portable_name(src.name)},
        "packed_prefix": PACKED_PREFIX,
        "optimized_prefix": OPTIMIZED_PREFIX,
    }
    for counter in ("tensors_moved", "bytes_in", "bytes_out", "bytes_written", "deduplicated", "deduplicated_bytes"):
        setattr(report, counter, 0)  # the final blob's figures replace the staged ones

    def emit(location: str, placements: Placements, tx: OutputTransaction) -> list[Path]:
        reloc.rewrite(location, placements)
        written = []
        pair_id(optimized, portable)
        for model, name in ((optimized, src.name), (portable, portable_name(src.name))):
            tmp = tx.new_file(out_dir / name)
            data = model.SerializeToString()
            tmp.write_bytes(data)
            written.append(out_dir / name)
            report.prepack["model_file_bytes"] = report.prepack.get("model_file_bytes", 0) + len(data)
        return written

    _report_packing(report, src, binding, packed, child_peak, result, _inserted_casts(optimized))
    # what the staged conversion recorded (``--unpack ort-cpu``): verify compares the portable model's payloads
    # with the original under the unpacking the blob says was used
    metadata = {**staged_metadata, METADATA_KEY: json.dumps({**binding, **names})}
    return PreparedModel(report, reloc.payloads, emit, extra={"blob_metadata": metadata})


def _require_loads(
    models: list[tuple[pb.ModelProto, str]],
    stage: Path,
    src: Path,
    options: ConvertOptions,
    version: str,
    child: OrtChild | None,
) -> None:
    """Every (model, its file name) loads in the installed onnxruntime (``version``), by the run's child
    (``child``; None: one for this check alone), or one Unsupported line names the model and ORT's reason."""
    args, files = load_probes(models, stage)
    runner = child if child is not None else OrtChild()
    try:
        if options.stage is not None:
            options.stage("onnxruntime loads the models to be written (child process)")
        res, _ = _run_bounded([LOAD, *args], stage, src, options, runner)
    finally:
        if child is None:
            runner.close()
        for f in files:
            f.unlink(missing_ok=True)
    if res.returncode != 0:
        why = (res.stderr.strip().splitlines() or ["no output"])[-1].removeprefix(f"{LoadRefused.__name__}: ")
        raise Unsupported(
            f"--prepack: refused: onnxruntime {version} cannot load the model it would write, {why}; "
            "convert without --prepack",
            src,
        )


def _stamp(optimized: pb.ModelProto, binding: JsonDict) -> None:
    """Import ``STAMP_DOMAIN`` at the converting onnxruntime's newest opset: a plain ``InferenceSession`` of the
    prepacked model under an older release (whose kernels and fusions compute otherwise) fails to load instead of
    computing other outputs. No node is in that domain: the release that converted runs the graph as verified."""
    version = binding.get("opset_stamp")
    if not isinstance(version, int) or version <= 0:
        return
    for o in optimized.opset_import:
        if o.domain == STAMP_DOMAIN:
            o.version = max(o.version, version)
            return
    stamp = optimized.opset_import.add()
    stamp.domain, stamp.version = STAMP_DOMAIN, version


def pair_id(optimized: pb.ModelProto, portable: pb.ModelProto) -> str:
    """Record in both models the digest of the two as converted (``PAIR_KEY``): ``weightshare.ort.session``
    refuses a portable twin of another conversion (stale, or copied from elsewhere)."""
    import hashlib

    for m in (optimized, portable):
        keep = [p for p in m.metadata_props if p.key != PAIR_KEY]
        del m.metadata_props[:]
        m.metadata_props.extend(keep)
    digest = hashlib.sha256(optimized.SerializeToString() + portable.SerializeToString()).hexdigest()[:32]
    for m in (optimized, portable):
        entry = m.metadata_props.add()
        entry.key, entry.value = PAIR_KEY, digest
    return digest


def _inserted_casts(optimized: pb.ModelProto) -> bool:
    """ORT inserted Casts for fp16/bf16 weights its CPU kernels do not take (``--unpack ort-cpu`` makes them
    explicit beforehand)."""
    return any(n.op_type == "Cast" and n.name.startswith(INSERTED_CAST) for n in optimized.graph.node)


def _settle(
    optimized: pb.ModelProto,
    stage: Path,
    src: Path,
    options: ConvertOptions,
    binding: JsonDict,
    report: ConversionReport,
) -> None:
    """Make ``optimized`` a graph ORT runs as written when a session loads it (``reload``): a fusion ORT would
    apply only to the saved graph is undone in the form that computes the original's bits, or refused. Only graphs
    holding the Casts ORT inserts for fp16/bf16 ops need it (what a reload can fold that the first pass could not):
    an fp32 graph skips the extra child."""
    if not _inserted_casts(optimized):
        return
    change = reload_change(optimized, stage, src, options)
    if change is None:
        return
    unfused = unfuse_scales(optimized)
    if unfused:
        drop_unused(optimized)
        change = reload_change(optimized, stage, src, options)
    if change is not None:
        raise Unsupported(
            f"--prepack: refused: loading the prepacked model, onnxruntime {binding['onnxruntime']} would not "
            f"compute what it computes on the original ({change}); convert without --prepack",
            src,
        )
    report.notes.append(
        f"--prepack: {unfused} Mul/Div by a scalar beside a MatMul written as Mul/Div by Expand(scalar, Shape(x)) "
        "(the same products; onnxruntime would fuse the scalar into FusedMatMul when loading the saved graph, "
        "which it did not do in the original)"
    )


def share_metadata(prepared: Sequence[PreparedModel]) -> None:
    """``--prepack --shared-blob``: one ``__metadata__`` record for the zoo's blob, naming every model's
    portable twin (``weightshare.ort.session`` looks its model up there)."""
    records = [json.loads(p.extra["blob_metadata"][METADATA_KEY]) for p in prepared]
    merged = {**records[0], "portable_models": {k: v for r in records for k, v in r["portable_models"].items()}}
    for p in prepared:
        p.extra["blob_metadata"] = {**p.extra["blob_metadata"], METADATA_KEY: json.dumps(merged)}


def _report_packing(
    report: ConversionReport,
    src: Path,
    binding: JsonDict,
    packed: list[BlobPayload],
    child_peak: float,
    result: JsonDict,
    casts: bool = False,
) -> None:
    report.notes.append(
        f"--prepack: {src.name} holds onnxruntime {binding['onnxruntime']}'s pre-packed weights for this CPU "
        f"({len(packed)} packed buffers, {sum(p.tensor.nbytes for p in packed) / 2**20:.1f} MiB; "
        f"NCHWc block {binding['nchwc_block']}); {portable_name(src.name)} runs anywhere with "
        f"session.disable_prepacking=1 (weightshare.ort.session picks). ORT child peak RSS {child_peak:.0f} MiB"
    )
    ops = result.get("ops", {})
    report.notes += [_op_note(op, tally) for op, tally in ops.items()]
    report.notes.append(_segments_note(result.get("segments", {}), casts))
    sessions, reused = (sum(t.get(k, 0) for t in ops.values()) for k in ("sessions", "reused"))
    if reused:
        report.notes.append(
            f"--prepack: {reused} node(s) took the packing of a node packed before in this run (the same op, "
            f"attributes, weight bytes, types and dims: the same one-node session); {sessions} packed by a session"
        )
    report.prepack = {
        "node_sessions": sessions,
        "pack_sessions": int(result.get("pack_sessions", sessions)),  # the sessions that packed them (batched)
        "nodes_reused": reused,
        "ops": ops,
        "packed_buffers": len(packed),
        "packed_bytes": sum(p.tensor.nbytes for p in packed),
        "ort_child_peak_rss_mib": round(child_peak, 1),
        # the cost drivers: whether this model started the run's onnxruntime child (the run's first model, or the
        # first after a failed one), and every ORT session it ran to optimize and pack (node sessions included)
        "ort_child_started": bool(result.get("child", {}).get("started", True)),
        "ort_sessions": int(result.get("child", {}).get("sessions", 0)),
        # the child's CPU seconds per phase (optimize: its graph/segment/cut-check sessions; settle; pack: node by node)
        "ort_child_cpu_s": dict(result.get("cpu_s", {})),
        "segments": result.get("segments", {}),
    }
    if "scratch_peak_bytes" in result:
        # memory the peak RSS does not show: ORT's files in the memory-backed scratch (``_scratch``)
        scratch = result["scratch_peak_bytes"] / 2**20
        report.prepack["ort_scratch_peak_mib"] = round(scratch, 1)
        report.notes.append(
            f"--prepack: onnxruntime's own files (a copy of the weights each session saves, then its packed "
            f"copies) held in memory, not written: at most {scratch:.1f} MiB at a time (one segment's or node's)"
        )


def _op_note(op: str, tally: JsonDict) -> str:
    """One op type's line: how many of its weight-bearing nodes ORT packed, and why the others were not."""
    why = "; ".join(f"{reason} ({n})" for reason, n in tally.get("not_packed", {}).items())
    return (
        f"--prepack: {op}: {tally['packed']} of {tally['nodes']} weight-bearing nodes pre-packed "
        f"({tally['packed_bytes'] / 2**20:.1f} MiB)" + (f"; not packed: {why}" if why else "")
    )


def _segments_note(seg: JsonDict, casts: bool = False) -> str:
    """How ORT's optimization was split (``segments``): what bounds the child's memory. ``casts``: ORT inserted
    Casts for fp16/bf16 weights, which keep a graph in one piece unless they are explicit (``--unpack ort-cpu``)."""
    largest = f"{seg.get('largest_segment_bytes', 0) / 2**20:.1f} MiB"
    unsafe = seg.get("unsafe_cuts", 0)
    merged = f"; {unsafe} cut(s) changed ORT's graph and were dropped" if unsafe else ""
    # a piece over the budget whose fp16 weights ORT cast: its child held their fp32 casts
    held = casts and seg.get("largest_segment_bytes", 0) > budget_from_env()
    hint = (
        "; its child held every fp16 weight of its largest piece cast to fp32: add --unpack ort-cpu to make the "
        "Casts explicit, which bounds the child (docs/performance.md)"
    )
    if seg.get("segments", 1) > 1:
        return (
            f"--prepack: onnxruntime optimized the graph in {seg['segments']} segments (largest {largest} of "
            f"weights), each cut checked against the two segments optimized together{merged}"
            + (
                f"; {n} packed node by node (each over a quarter of the weights: its session would hold its "
                "packed copies and write them beside the staged model)"
                if (n := seg.get("segments_packed_node_by_node", 0))
                else ""
            )
            + (hint if held else "")
        )
    return (
        f"--prepack: onnxruntime optimized the graph in one piece ({largest} of weights: "
        f"{seg.get('single_reason', '')}{merged})" + (hint if held or (casts and unsafe) else "")
    )
