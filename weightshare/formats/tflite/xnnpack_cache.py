"""XNNPACK weight caches bound to a TFLite model's content (``convert --prepack``, ``weightshare.litert``).

LiteRT's default CPU path hands FULLY_CONNECTED/CONV weights to XNNPACK, which packs a private copy per
interpreter. ``CompiledModel`` with ``CpuOptions(xnnpack_weight_cache_path=FILE)`` packs into FILE instead,
and every later instance (any process) maps FILE read-only and shares it. Measured with ai-edge-litert 2.3:

- LiteRT writes FILE itself, at exactly that path, in place (same inode), while ``CompiledModel.from_file``
  runs (not at the first run). An empty or damaged FILE is rebuilt; a directory is refused ("could neither be
  loaded from or saved to"). A finished FILE is used read-only (mode 0444 works, nothing is written).
- XNNPACK keys packed weights by buffer *index* (``PackIdentifier{seed, weights_id, bias_id}``, see
  tflite/delegates/xnnpack/weight_cache.cc), and its header only checks the XNNPACK build. A cache built for
  another model of the same structure is therefore used silently and yields that model's weights.

So the binding lives in the file name: ``<model file name>.litert-<version>.<digest>.xnnpack-cache`` where the
digest covers the model file, every ExternalBuffer group file it references, the LiteRT version and the CPU's
instruction-set flags (XNNPACK picks packing kernels by ISA). A stale or foreign cache has another name and is
never passed to LiteRT by ``weightshare.litert.compiled_model``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from ..._atomic import CommitHook, OutputTransaction, locked_stage
from ..._checksum import Hasher
from ..._findings import Finding
from ..._outputs_record import NEEDED
from ..._paths import resolve_inside
from ..._platform import own_peak_mib
from ...errors import InvalidModel, OutputError, Unsupported, WeightshareError
from . import cache_record
from .findings import TfliteCode

if TYPE_CHECKING:
    from ai_edge_litert import schema_py_generated as schema

    from ..._runtimes.bound import ChildMemory

CACHE_SUFFIX = ".xnnpack-cache"
DIGEST_HEX = 32  # 128 bits of SHA-256 in the name: collisions are not a practical concern
_HASH_CHUNK = 4 << 20
_NAME = re.compile(
    rf"^(?P<model>.+)\.litert-(?P<version>[^/]+?)\.(?P<digest>[0-9a-f]{{{DIGEST_HEX}}})"
    rf"{re.escape(CACHE_SUFFIX)}$"
)
# CPU flags that change which XNNPACK packing kernels run (x86 and Arm spellings in /proc/cpuinfo).
_ISA_FLAG = re.compile(r"^(sse|ssse|avx|fma|f16c|amx|gfni|vnni|asimd|fphp|sve|sme|dotprod|i8mm|bf16|fp16)")


@lru_cache(maxsize=1)
def litert_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ai-edge-litert")
    except PackageNotFoundError:
        return "unknown"


@lru_cache(maxsize=1)
def cpu_fingerprint() -> str:
    """Machine architecture and the ISA flags XNNPACK dispatches on (empty where /proc/cpuinfo is absent)."""
    from ..._runtimes.cpuinfo import cpu_flags

    flags = {v for v in cpu_flags() if _ISA_FLAG.match(v)}
    return platform.machine() + ":" + ",".join(sorted(flags))


_MODEL_EXTERNAL_BUFFER_GROUPS = 8  # Model field slot (schema.fbs); ExternalBufferGroup.name is slot 0


class _Preader:
    """Bounds-checked little-endian preads: just enough flatbuffer to find the group names.

    The schema's generated module costs each serving process ~3 MiB of Python objects; ``compiled_model`` runs
    in every process that loads the model, so this path does without it.
    """

    def __init__(self, fd: int, size: int, path: Path):
        self.fd, self.size, self.path = fd, size, path

    def read(self, pos: int, n: int) -> bytes:
        if pos < 0 or n < 0 or pos + n > self.size:
            raise InvalidModel(
                f"truncated or corrupt flatbuffer: {n} bytes at offset {pos} run past the end of the "
                f"file ({self.size} bytes)",
                self.path,
            )
        return os.pread(self.fd, n, pos)

    def u(self, pos: int, n: int, signed: bool = False) -> int:
        return int.from_bytes(self.read(pos, n), "little", signed=signed)

    def field(self, table: int, slot: int) -> int | None:
        """Position of the uoffset field ``slot`` of the table at ``table``, or None when absent."""
        vtable = table - self.u(table, 4, signed=True)
        entry = 4 + 2 * slot
        if entry + 2 > self.u(vtable, 2):
            return None
        off = self.u(vtable + entry, 2)
        return table + off if off else None

    def deref(self, pos: int) -> int:
        return pos + self.u(pos, 4)


def referenced_files(model: Path) -> list[Path]:
    """The ExternalBuffer group files ``model`` names, resolved inside its directory (in group order)."""
    fd = os.open(model, os.O_RDONLY)
    try:
        r = _Preader(fd, os.fstat(fd).st_size, model)
        if r.read(4, 4) != b"TFL3":
            raise InvalidModel("not a TFLite flatbuffer (no TFL3 identifier)", model)
        groups = r.field(r.deref(0), _MODEL_EXTERNAL_BUFFER_GROUPS)
        if groups is None:
            return []
        vector = r.deref(groups)
        files = []
        for i in range(r.u(vector, 4)):
            name = r.field(r.deref(vector + 4 + 4 * i), 0)
            if name is None:
                raise InvalidModel(f"external buffer group {i} has no name", model)
            start = r.deref(name)
            text = r.read(start + 4, r.u(start, 4)).decode("utf-8", "replace")
            files.append(resolve_inside(model.parent, text, "external buffer group", model))
        return files
    finally:
        os.close(fd)


def _stat_key(path: Path) -> tuple[str, int, int, int, int, int]:
    st = os.stat(path)
    return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _hash_into(h: Hasher, path: Path) -> None:
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        h.update(os.fstat(f.fileno()).st_size.to_bytes(8, "little"))
        while n := f.readinto(buf):
            h.update(view[:n])


_memo: dict[tuple[tuple[str, int, int, int, int, int], ...], str] = {}


def content_digest(model: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of the model file, its group files, the LiteRT version and the CPU fingerprint.

    Hashes stream in 4 MiB chunks. Within one process the result is remembered per (inode, size, mtime,
    ctime) of every file, so N instances of one model hash it once.
    """
    model = Path(model)
    files = [model, *referenced_files(model)]
    try:
        key = tuple(_stat_key(f) for f in files)
    except OSError as e:
        raise InvalidModel(f"cannot read {e.filename}: {e.strerror}", model) from None
    if key in _memo:
        return _memo[key]
    h = hashlib.sha256(b"weightshare xnnpack-cache v1\0")
    h.update(f"{litert_version()}\0{cpu_fingerprint()}\0".encode())
    for f in files:
        _hash_into(h, f)
    digest = h.hexdigest()
    _memo[key] = digest
    return digest


def cache_name(model_name: str, digest: str) -> str:
    return f"{model_name}.litert-{litert_version()}.{digest[:DIGEST_HEX]}{CACHE_SUFFIX}"


def expected_cache(model: str | os.PathLike[str]) -> Path:
    """Where the cache that matches ``model``'s current content would be (it may not exist)."""
    model = Path(model)
    return model.parent / cache_name(model.name, content_digest(model))


def _matches_its_model(path: Path) -> bool:
    """A cache (or its record) that still matches the model beside it: the outputs record keeps it."""
    cache = path.with_name(path.name.removesuffix(cache_record.RECORD_SUFFIX))
    m = _NAME.match(cache.name)
    try:
        return (
            m is not None
            and (cache.parent / m["model"]).is_file()
            and expected_cache(cache.parent / m["model"]) == cache
        )
    except (OSError, WeightshareError):
        return False


NEEDED.append(_matches_its_model)


def candidate_caches(model: str | os.PathLike[str]) -> list[Path]:
    """Every file beside ``model`` named like one of its caches, matching or not."""
    model = Path(model)
    return sorted(
        Path(p)
        for p in glob.glob(os.path.join(glob.escape(str(model.parent)), glob.escape(model.name) + ".*" + CACHE_SUFFIX))
    )


@dataclass
class CacheStatus:
    path: Path
    matches: bool
    reason: str


def cache_status(model: str | os.PathLike[str]) -> list[CacheStatus]:
    """Each cache file beside ``model``: does it match the model's content, and if not, why not."""
    model = Path(model)
    found = candidate_caches(model)
    if not found:
        return []
    expected = expected_cache(model).name
    statuses = []
    for path in found:
        m = _NAME.match(path.name)
        if m is not None and m["model"] != model.name:
            continue  # the cache of another model whose name starts with this one's ("a.tflite.b.tflite")
        if path.name == expected:
            fd, why = cache_record.open_verified(path, content_digest(model))
            if fd is not None:
                os.close(fd)
            statuses.append(CacheStatus(path, fd is not None, "matches the model" if fd is not None else why))
        elif m is None:
            statuses.append(CacheStatus(path, False, "not a weightshare cache name; never used"))
        elif m["version"] != litert_version():
            statuses.append(
                CacheStatus(path, False, f"built with LiteRT {m['version']}, installed {litert_version()}; never used")
            )
        else:
            statuses.append(
                CacheStatus(
                    path,
                    False,
                    "built for other content (another or re-converted model, another blob or CPU); never used",
                )
            )
    return statuses


@dataclass
class BuildResult:
    cache: Path
    nbytes: int
    peak_rss_mib: float  # of the child process that built it
    wall_s: float


def build(model: Path, cache: Path, memory: ChildMemory | None = None) -> BuildResult:
    """Build the cache of ``model`` into the existing file ``cache`` in a child process.

    LiteRT loads the whole model to pack it, so this runs in a child: the converter's own peak RSS stays
    flat, and the child's peak is reported. The child opens the model twice; the second open must leave
    the cache untouched, which shows the cache is complete. ``memory``: the child's bound (``check`` measuring
    what XNNPACK packs: ``_runtimes/bound.py``).
    """
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", __name__, str(model), str(cache)],
        capture_output=True,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        preexec_fn=memory.preexec() if memory is not None else None,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        errors = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if "ERROR" in ln or "rror:" in ln]
        detail = errors[-1] if errors else f"the build process exited with status {proc.returncode}"
        raise Unsupported(f"LiteRT could not build the XNNPACK weight cache: {detail}", model)
    result = json.loads(lines[-1])
    return BuildResult(cache, result["nbytes"], result["peak_rss_mib"], round(time.perf_counter() - start, 3))


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        os.symlink(os.path.abspath(src), dst)


def _staged(tx: OutputTransaction, final: Path) -> Path:
    staged = tx.staged(final)
    if staged is None:  # the converter stages the model and its blob before --prepack runs: a bug, not bad input
        raise OutputError(f"{final.name} was not staged before its XNNPACK weight cache was built", final)
    return staged


def prepack(final_model: Path, blob_name: str | None, tx: OutputTransaction, grace_s: float) -> tuple[BuildResult, str]:
    """Build the cache of the staged model (and blob) of ``tx``; stage it and its record beside ``final_model``.

    The staged files have temporary names, but the model names its blob by its final name: both are
    linked under their final names into a private, locked directory for LiteRT. Returns the build and the
    cache file's final path. Older caches of the same model name go ``grace_s`` seconds after they stopped
    matching (as old blobs do), so a reader that opened the old model just before the commit still finds its cache.
    """
    out_dir = final_model.parent
    try:
        with locked_stage(out_dir, "prepack") as stage:
            model = stage / final_model.name
            _link(_staged(tx, final_model), model)
            if blob_name is not None:
                _link(_staged(tx, out_dir / blob_name), stage / blob_name)
            digest = content_digest(model)
            final_cache = out_dir / cache_name(final_model.name, digest)
            cache_tmp = tx.new_file(final_cache)
            result = build(model, cache_tmp)
            cache_record.write_record(cache_tmp, tx.new_file(cache_record.record_path(final_cache)), digest)
    except OSError as e:
        raise OutputError(f"cannot stage the model for the XNNPACK weight cache: {e.strerror}", out_dir) from None
    if tx.record_dir is None:  # else the outputs record removes an old cache, only on proof
        tx.add_hook(SupersededCaches(final_model, final_cache, grace_s))
    return result, str(final_cache)


def drop_stale_after_commit(final_model: Path, tx: OutputTransaction, grace_s: float) -> None:
    """Without --prepack: caches an earlier --prepack run left beside ``final_model`` that no longer match the
    new model go after the grace period (one that still matches, from identical output, stays)."""
    if tx.record_dir is None and candidate_caches(final_model):
        tx.add_hook(SupersededCaches(final_model, None, grace_s))


class SupersededCaches(CommitHook):
    """Old caches of a re-converted model can never match it again; they go like old blobs.

    ``before`` (under the OUTDIR lock, before the renames) notes the cache that matches the model still in
    place; ``after`` stamps that one's mtime (its grace period starts now) and removes every other stale one
    whose mtime is older than ``grace_s``. A cache that still matches the new model stays.
    """

    def __init__(self, model: Path, keep: Path | None, grace_s: float):
        self.model, self.keep, self.grace_s = model, keep, grace_s
        self.was_live: str | None = None

    def before(self) -> None:
        try:
            self.was_live = expected_cache(self.model).name if self.model.exists() else None
        except (WeightshareError, OSError):
            self.was_live = None

    def after(self) -> None:
        keep = self.keep
        if keep is None:
            try:
                keep = expected_cache(self.model)
            except (WeightshareError, OSError):
                return  # cannot tell which one matches: remove nothing
        now = time.time()
        for path in candidate_caches(self.model):
            m = _NAME.match(path.name)
            if path == keep or m is None or m["model"] != self.model.name or path.is_symlink():
                continue
            try:
                if path.name == self.was_live and self.grace_s > 0:
                    os.utime(path)
                elif path.name == self.was_live or now - path.stat().st_mtime >= self.grace_s:
                    path.unlink()
                    cache_record.record_path(path).unlink(missing_ok=True)
            except OSError:
                pass  # housekeeping: a stale cache we cannot remove is still never used


def _mib(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def unpack_note(fp16_bytes: int, fp32_bytes: int, prepacked: bool) -> str:
    """What unpacking fp16 weights costs a user of LiteRT's default (XNNPACK) Interpreter."""
    extra = fp32_bytes - fp16_bytes
    advice = (
        "load it with weightshare.litert.interpreter (the Interpreter API) or weightshare.litert.compiled_model, "
        "which use the XNNPACK weight cache written here"
        if prepacked
        else "convert with --prepack and load with weightshare.litert.interpreter (the Interpreter API) or "
        "weightshare.litert.compiled_model"
    )
    return (
        f"fp16 weights were unpacked to fp32 ({_mib(fp16_bytes)} -> {_mib(fp32_bytes)}): LiteRT's default "
        f"Interpreter (XNNPACK) still packs a private copy per interpreter and now reads the fp32 file pages "
        f"to do it, +{_mib(extra)} per process; it gains nothing from this conversion. Instead, {advice}, "
        f"or use Interpreter(..., experimental_op_resolver_type=BUILTIN_WITHOUT_DEFAULT_DELEGATES)"
    )


@dataclass
class SettingCost:
    """Estimated weight memory of N instances of a model under one LiteRT setting: shared + N * per_instance."""

    setting: str
    shared_bytes: int  # file pages or cache pages mapped once per machine
    per_instance_bytes: int  # private copies each Interpreter / CompiledModel makes
    note: str = ""

    def total(self, instances: int) -> int:
        return self.shared_bytes + instances * self.per_instance_bytes


def _weight_use(graph: schema.ModelT, sizes: list[int]) -> tuple[int, int, int, int]:
    """(bytes DEQUANTIZE materialises per interpreter, packed bytes XNNPACK makes, file bytes it packs from, the
    part of the first that comes from integer weights: XNNPACK keeps its own fp32 unpacking of those per
    instance, next to the packed copy, even with a weight cache)."""
    from ai_edge_litert import schema_py_generated as schema

    from .graph import DEQUANTIZE, builtin_code, element_count, indices

    op = schema.BuiltinOperator
    packed_ops = {op.FULLY_CONNECTED, op.CONV_2D, op.DEPTHWISE_CONV_2D, op.TRANSPOSE_CONV, op.BATCH_MATMUL}
    ext = {e.id: e.length for e in graph.externalBuffers or [] if e is not None}
    codes = [builtin_code(c) for c in graph.operatorCodes or []]
    dequantized, packed, packed_from_file, from_int = 0, 0, 0, 0
    for sg in graph.subgraphs:
        tensors = sg.tensors or []

        def const_bytes(i: int) -> int:  # called in this iteration only, so it sees this subgraph's tensors
            t = tensors[i] if 0 <= i < len(tensors) else None  # noqa: B023
            return 0 if t is None else sizes[t.buffer] if t.buffer else ext.get(t.externalBuffer, 0)

        made = {}  # DEQUANTIZE output tensor -> its fp32 bytes, when its input is a constant
        for o in sg.operators or []:
            ins, outs = indices(o.inputs), indices(o.outputs)
            if codes[o.opcodeIndex] == DEQUANTIZE and ins and outs and const_bytes(ins[0]):
                made[outs[0]] = 4 * (element_count(tensors[outs[0]]) or 0)
                if tensors[ins[0]].type != schema.TensorType.FLOAT16:
                    from_int += made[outs[0]]
        dequantized += sum(made.values())
        for o in sg.operators or []:
            if codes[o.opcodeIndex] in packed_ops:
                for i in indices(o.inputs)[1:3]:
                    packed += made.get(i, 0) or const_bytes(i)
                    packed_from_file += const_bytes(i)
    return dequantized, packed, packed_from_file, from_int


def weight_only_note(final_model: Path, tx: OutputTransaction) -> str | None:
    """``--prepack`` without ``--unpack dequantize`` on a weight-only int8/int4 model (DEQUANTIZE of integer
    constants): the weight cache does not stop each instance from unpacking them to fp32; say what does."""
    from . import flatbuf

    with flatbuf.open_model(str(_staged(tx, final_model))) as (reader, mapping):
        flatbuf.check_header(reader)
        refs = flatbuf.read_buffer_refs(reader)
        graph = flatbuf.read_graph(reader, mapping)
    from_int = _weight_use(graph, [r.nbytes for r in refs])[3]
    if not from_int:
        return None
    return (
        f"weight-only integer weights (DEQUANTIZE of int8/int4 constants): every instance still unpacks them to "
        f"fp32 ({_mib(from_int)} per instance), the XNNPACK weight cache does not cover that; convert with "
        "--prepack --unpack dequantize to store the fp32 values once and share them"
    )


def interpreter_costs(model: str | os.PathLike[str]) -> list[SettingCost]:
    """Weight memory per LiteRT setting for ``model``: no delegate, default XNNPACK, CompiledModel + cache.

    An estimate from the graph (XNNPACK packs FULLY_CONNECTED/CONV/DEPTHWISE/TRANSPOSE_CONV/BATCH_MATMUL
    weights to about their fp32 size); scripts/bench_tflite.py measures what it models.
    """
    from . import flatbuf
    from .graph import validate

    model = Path(model)
    with flatbuf.open_model(str(model)) as (reader, mapping):
        flatbuf.check_header(reader)
        refs = flatbuf.read_buffer_refs(reader)
        graph = flatbuf.read_graph(reader, mapping)
    validate(graph, len(refs), str(model))
    sizes = [r.nbytes for r in refs]
    in_file = sum(sizes) + sum(e.length for e in graph.externalBuffers or [] if e is not None)
    dequantized, packed, packed_from_file, from_int = _weight_use(graph, sizes)
    matching = [s.path for s in cache_status(model) if s.matches]
    cache = matching[0].stat().st_size if matching else packed
    cache_note = (
        f"cache {matching[0].name}"
        if matching
        else ("no matching cache beside the model (convert --prepack writes one); size estimated")
    )
    costs = [
        SettingCost(
            "Interpreter, no delegate",
            in_file,
            dequantized,
            "fp32 copies of DEQUANTIZE outputs per interpreter" if dequantized else "",
        ),
        SettingCost(
            "Interpreter, default XNNPACK",
            in_file,
            packed + from_int,
            "XNNPACK packs a private copy per interpreter, reading the file pages to do it"
            + ("; and unpacks int8 weights to fp32 per interpreter (convert --unpack dequantize)" if from_int else ""),
        ),
        SettingCost(
            "CompiledModel + XNNPACK weight cache",
            cache + in_file - packed_from_file,
            from_int,
            cache_note
            + ("; int8 weights unpacked to fp32 per instance (convert --unpack dequantize)" if from_int else ""),
        ),
    ]
    if graph.externalBuffers:
        for c in costs[:2]:
            c.note = "the classic Interpreter does not load ExternalBuffer models"
    return costs


def inventory_notes(model: str | os.PathLike[str]) -> tuple[list[str], list[Finding]]:
    """Lines for ``inspect`` (weight memory per LiteRT setting, and every cache beside the model) and a
    finding for each cache beside it that does not match it."""
    notes: list[str] = []
    findings: list[Finding] = []
    try:
        for c in interpreter_costs(model):
            notes.append(
                f"{c.setting}: {_mib(c.shared_bytes)} shared + {_mib(c.per_instance_bytes)} per instance "
                f"(8 instances: {_mib(c.total(8))})" + (f"; {c.note}" if c.note else "")
            )
        for st in cache_status(model):
            notes.append(f"XNNPACK weight cache {st.path.name}: {st.reason}")
            if not st.matches:
                findings.append(
                    Finding.of(
                        TfliteCode.XNNPACK_CACHE_MISMATCH,
                        str(model),
                        f"XNNPACK weight cache {st.path.name} does not match the model: {st.reason}",
                    )
                )
    except WeightshareError as e:
        notes.append(f"LiteRT settings not estimated: {e.message}")
    return notes, findings


def _child(model: str, cache: str) -> int:
    """Runs in the build process: open the model with the cache twice, print the cache size and peak RSS.

    Its stdout is the protocol with ``build``: one JSON line, or a line with ERROR.
    """
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.cpu_options import CpuOptions
    from ai_edge_litert.options import Options

    def open_model() -> CompiledModel:
        return CompiledModel.from_file(
            model, options=Options(cpu_options=CpuOptions(num_threads=1, xnnpack_weight_cache_path=cache))
        )

    first = open_model()
    built = os.stat(cache)
    if built.st_size == 0:
        print("ERROR: LiteRT wrote no XNNPACK weight cache (does the model have XNNPACK-supported ops?)")
        return 3
    second = open_model()
    again = os.stat(cache)
    if (again.st_size, again.st_mtime_ns) != (built.st_size, built.st_mtime_ns):
        print("ERROR: the XNNPACK weight cache changed when the model was opened again (incomplete cache)")
        return 3
    del first, second
    print(json.dumps({"nbytes": again.st_size, "peak_rss_mib": round(own_peak_mib(), 1)}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_child(sys.argv[1], sys.argv[2]))
    except WeightshareError as e:
        print(f"ERROR: {e.line()}")
        sys.exit(3)


def find_cache(model: str | os.PathLike[str]) -> tuple[Path | None, str]:
    """The XNNPACK weight cache that matches ``model``'s current content and its own record.

    Args:
        model: a ``.tflite`` model written by ``weightshare convert --prepack``.

    Returns:
        (cache path, "") when one matches; (None, why none is used) otherwise."""
    cache, fd, why = open_cache(model)
    if fd is not None:
        os.close(fd)
    return cache, why


def open_cache(model: str | os.PathLike[str]) -> tuple[Path | None, int | None, str]:
    """(cache, an fd of it checked against its record, "matches"), or (None, None, why none is used)."""
    model = Path(model)
    if not candidate_caches(model):  # nothing to match: spare the hash of the model
        return None, None, "no XNNPACK weight cache beside the model (`weightshare convert --prepack` writes one)"
    digest = content_digest(model)
    expected = model.parent / cache_name(model.name, digest)
    if os.path.lexists(expected):
        fd, why = cache_record.open_verified(expected, digest)
        if fd is None:
            return None, None, f"{expected.name} is not used: {why}"
        return expected, fd, "matches"
    others = [s for s in cache_status(model) if not s.matches]
    if others:
        return None, None, f"{others[0].path.name} does not match the model ({others[0].reason})"
    return None, None, f"no XNNPACK weight cache beside the model (expected {expected.name})"
