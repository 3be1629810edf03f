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
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ...atomic import TMP_PREFIX
from ...errors import InvalidModel, OutputError, Unsupported, WeightshareError
from ...paths import resolve_inside

CACHE_SUFFIX = ".xnnpack-cache"
DIGEST_HEX = 32  # 128 bits of SHA-256 in the name: collisions are not a practical concern
_HASH_CHUNK = 4 << 20
_NAME = re.compile(r"^(?P<model>.+)\.litert-(?P<version>[^/]+?)\.(?P<digest>[0-9a-f]{%d})%s$"
                   % (DIGEST_HEX, re.escape(CACHE_SUFFIX)))
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
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags = {v for v in value.split() if _ISA_FLAG.match(v)}
                    break
    except OSError:
        pass
    return platform.machine() + ":" + ",".join(sorted(flags))


def referenced_files(model: Path) -> list[Path]:
    """The ExternalBuffer group files ``model`` names, resolved inside its directory (in group order)."""
    from . import flatbuf

    with flatbuf.open_model(str(model)) as (reader, mapping):
        flatbuf.check_header(reader)
        graph = flatbuf.read_graph(reader, mapping)
    files = []
    for group in graph.externalBufferGroups or []:
        name = group.name if group is not None else None
        if not name:
            raise InvalidModel("an external buffer group has no name", model)
        name = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
        files.append(resolve_inside(model.parent, name, "external buffer group", model))
    return files


def _stat_key(path: Path) -> tuple:
    st = os.stat(path)
    return (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _hash_into(h, path: Path) -> None:
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        h.update(os.fstat(f.fileno()).st_size.to_bytes(8, "little"))
        while n := f.readinto(buf):
            h.update(view[:n])


_memo: dict[tuple, str] = {}


def content_digest(model: str | os.PathLike) -> str:
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


def expected_cache(model: str | os.PathLike) -> Path:
    """Where the cache that matches ``model``'s current content would be (it may not exist)."""
    model = Path(model)
    return model.parent / cache_name(model.name, content_digest(model))


def candidate_caches(model: str | os.PathLike) -> list[Path]:
    """Every file beside ``model`` named like one of its caches, matching or not."""
    model = Path(model)
    return sorted(Path(p) for p in glob.glob(os.path.join(glob.escape(str(model.parent)),
                                                          glob.escape(model.name) + ".*" + CACHE_SUFFIX)))


@dataclass
class CacheStatus:
    path: Path
    matches: bool
    reason: str


def cache_status(model: str | os.PathLike) -> list[CacheStatus]:
    """Each cache file beside ``model``: does it match the model's content, and if not, why not."""
    model = Path(model)
    found = candidate_caches(model)
    if not found:
        return []
    expected = expected_cache(model).name
    statuses = []
    for path in found:
        m = _NAME.match(path.name)
        if path.name == expected:
            ok = path.is_file() and path.stat().st_size > 0
            statuses.append(CacheStatus(path, ok, "matches the model" if ok else "empty or not a regular file"))
        elif m is None or m["model"] != model.name:
            statuses.append(CacheStatus(path, False, "not a weightshare cache name; never used"))
        elif m["version"] != litert_version():
            statuses.append(CacheStatus(path, False, f"built with LiteRT {m['version']}, installed "
                                                     f"{litert_version()}; never used"))
        else:
            statuses.append(CacheStatus(path, False, "built for other content (another or re-converted model, "
                                                     "another blob or CPU); never used"))
    return statuses


@dataclass
class BuildResult:
    cache: Path
    nbytes: int
    peak_rss_mib: float  # of the child process that built it
    wall_s: float


def build(model: Path, cache: Path) -> BuildResult:
    """Build the cache of ``model`` into the existing file ``cache`` in a child process.

    LiteRT loads the whole model to pack it, so this runs in a child: the converter's own peak RSS stays
    flat, and the child's peak is reported. The child opens the model twice; the second open must leave
    the cache untouched, which shows the cache is complete.
    """
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", __name__, str(model), str(cache)], capture_output=True,
                          text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
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


def prepack(final_model: Path, blob_name: str | None, tx) -> tuple[BuildResult, str]:
    """Build the cache of the staged model (and blob) of ``tx``; stage it beside ``final_model``.

    The staged files have temporary names, but the model names its blob by its final name: both are
    linked under their final names into a private directory for LiteRT. Returns the build and the cache
    file's final path. Older caches of the same model name are removed once the new outputs are in place.
    """
    out_dir = final_model.parent
    stage = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", suffix="-prepack", dir=out_dir))
    try:
        model = stage / final_model.name
        _link(tx.staged(final_model), model)
        if blob_name is not None:
            _link(tx.staged(out_dir / blob_name), stage / blob_name)
        final_cache = out_dir / cache_name(final_model.name, content_digest(model))
        result = build(model, tx.new_file(final_cache))
    except OSError as e:
        raise OutputError(f"cannot stage the model for the XNNPACK weight cache: {e.strerror}", out_dir) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    tx.after_commit(lambda: _remove_superseded(final_model, final_cache))
    return result, str(final_cache)


def _remove_superseded(model: Path, keep: Path) -> None:
    """Old caches of a re-converted model can never match it again: remove them (they are only disk)."""
    for path in candidate_caches(model):
        m = _NAME.match(path.name)
        if path != keep and m is not None and m["model"] == model.name:
            try:
                path.unlink()
            except OSError:
                pass  # a cache we cannot remove is still never used: it does not match


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def unpack_note(fp16_bytes: int, fp32_bytes: int, prepacked: bool) -> str:
    """What unpacking fp16 weights costs a user of LiteRT's default (XNNPACK) Interpreter."""
    extra = fp32_bytes - fp16_bytes
    advice = ("load it with weightshare.litert.compiled_model (uses the XNNPACK weight cache written here)"
              if prepacked else "convert with --prepack and load with weightshare.litert.compiled_model")
    return (f"fp16 weights were unpacked to fp32 ({_mib(fp16_bytes)} -> {_mib(fp32_bytes)}): LiteRT's default "
            f"Interpreter (XNNPACK) still packs a private copy per interpreter and now reads the fp32 file pages "
            f"to do it, +{_mib(extra)} per process; it gains nothing from this conversion. Instead, {advice}, "
            f"or use Interpreter(..., experimental_op_resolver_type=BUILTIN_WITHOUT_DEFAULT_DELEGATES)")


def _child(model: str, cache: str) -> int:
    """Runs in the build process: open the model with the cache twice, print the cache size and peak RSS."""
    import resource

    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.cpu_options import CpuOptions
    from ai_edge_litert.options import Options

    def open_model():
        return CompiledModel.from_file(model, options=Options(cpu_options=CpuOptions(
            num_threads=1, xnnpack_weight_cache_path=cache)))

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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"nbytes": again.st_size, "peak_rss_mib": round(peak, 1)}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_child(sys.argv[1], sys.argv[2]))
    except WeightshareError as e:
        print(f"ERROR: {e.line()}")
        sys.exit(3)
