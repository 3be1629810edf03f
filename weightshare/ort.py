"""Open a model converted with ``--prepack`` so that every session shares its weights.

    import weightshare.ort
    sess = weightshare.ort.session("out/model.onnx")   # an onnxruntime.InferenceSession

``convert --prepack`` writes MODEL.onnx, whose pre-packed MatMul/Gemm weights and NCHWc Conv
weights are valid only for the CPU kind and onnxruntime version that produced them, and
MODEL.portable.onnx, which references only the plain payloads. ``session`` opens the prepacked
model when it matches this machine and its packed payloads pass their recorded checksums, and the
portable one (with ``session.disable_prepacking=1``) otherwise, saying why once through logging.

Why the checks happen here and not only in ORT: ORT re-packs MatMul/Gemm weights at load and
refuses a mismatch, but it never validates NCHWc-reordered Conv weights, so a blob built on an
AVX-512 machine (block 16) would be read with the wrong layout on AVX2 (block 8), and a flipped
byte in a reordered weight would silently change results.

Memory: ORT's load-time validation frees large buffers into glibc's heap, which keeps them
(8-50 MiB per session). ``session`` calls ``malloc_trim(0)`` after creating a session; processes
that call ORT directly should start with ``MALLOC_MMAP_THRESHOLD_=1048576`` in the environment.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._platform import malloc_trim
from .errors import InvalidModel
from .formats.onnx.ort.opened import OpenedModel as _OpenedModel
from .formats.onnx.ort.opened import prepack_info
from .formats.onnx.ort.opened import set_entry as _set_entry
from .formats.onnx.ort.prepack_record import METADATA_KEY, portable_of
from .report import JsonDict

if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger("weightshare.ort")

__all__ = [
    "METADATA_KEY",
    "check_packed_payloads",
    "malloc_trim",
    "mismatch",
    "prepack_info",
    "session",
    "this_machine",
]
_verified: set[tuple[tuple[int, int, int, int, int], str]] = set()  # (identity, header digest) passed here
_warned: set[str] = set()
_machine: JsonDict | None = None


def this_machine() -> JsonDict:
    """What packed data depends on, measured here the way conversion measured it (cached per process).

    Returns:
        The CPU features and kernel facts ``--prepack`` records in a blob, as a JSON-able dict.
    """
    global _machine
    if _machine is None:
        import platform

        import onnxruntime as ort

        from .formats.onnx.ort.probe import cpu_features, nchwc_block_size

        _machine = {
            "onnxruntime": ort.__version__,
            "machine": platform.machine(),
            "cpu_features": cpu_features(),
            "nchwc_block": nchwc_block_size(),
        }
    return _machine


def check_packed_payloads(blob: str | os.PathLike[str], info: JsonDict) -> str | None:
    """Check the recorded digest (BLAKE3, or SHA-256 in older blobs) of every payload only the prepacked model uses.

    Args:
        blob: the blob's path (may be ``/proc/self/fd/N`` of an fd already opened).
        info: the record ``prepack_info`` returned for the model.

    Returns:
        Why the packed payloads cannot be trusted (the first mismatch, or such a payload without a digest), or
        None when all match.

    A blob that passed is remembered, in this process and in a per-user cache (``ort/verdict.py``), keyed by its
    (device, inode, size, mtime_ns, ctime_ns) and the SHA-256 of its header: the next process opening the
    same unchanged blob reads its header only. Any change to the file (ctime moves) hashes it again."""
    from .formats.onnx.ort import verdict as ort_verdict
    from .formats.onnx.ort.probe import fd_identity

    path = os.fspath(blob)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        return f"its blob cannot be opened ({e.strerror})"
    try:
        identity, digest = fd_identity(fd), ort_verdict.header_sha256(fd)
        if digest is None:
            return "its blob header cannot be read"
        if (identity, digest) in _verified or ort_verdict.is_intact(identity, digest):
            _verified.add((identity, digest))
            return None
        why = _hash_packed_payloads(path, info, identity[2])
        if why is None and fd_identity(fd) == identity and ort_verdict.header_sha256(fd) == digest:
            _verified.add((identity, digest))
            ort_verdict.remember_intact(identity, digest)
        return why
    finally:
        os.close(fd)


def _hash_packed_payloads(path: str, info: JsonDict, size: int) -> str | None:
    from ._checksum import split_digest
    from ._recorded import record_problem, recorded_records
    from ._safetensors import read_safetensors_metadata

    prefixes = (str(info["packed_prefix"]), str(info["optimized_prefix"]))
    try:
        _start, header, _meta = read_safetensors_metadata(path)
    except (InvalidModel, OSError, ValueError, RecursionError):
        return "its blob header cannot be read"
    records = {name: (offset, length, digest) for name, offset, length, digest in recorded_records(path)}
    for name in header:
        if not isinstance(name, str) or not name.startswith(prefixes):
            continue
        if name not in records:
            return f"{name} has no recorded digest"
        offset, length, recorded = records[name]
        if record_problem(path, offset, length, recorded, size):
            if offset + length > size:
                return f"{name} is truncated"
            return f"{name} does not match its recorded {split_digest(recorded)[0]} digest"
    return None


def mismatch(info: JsonDict) -> str | None:
    """Whether packed data built for the machine ``info`` describes can run on this one.

    Args:
        info: the record ``prepack_info`` returned for the model.

    Returns:
        Why it cannot (the first CPU feature or kernel fact that differs), or None when it can.
    """
    here = this_machine()
    for key in ("onnxruntime", "machine", "nchwc_block", "cpu_features"):
        if info.get(key) != here[key]:
            return f"it was packed for {key} {info.get(key)!r}, this machine has {here[key]!r}"
    return None


def _say_once(path: Path, message: str, level: int = logging.WARNING) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        log.log(level, "%s", message)


def session(
    path: str | os.PathLike[str],
    sess_options: ort.SessionOptions | None = None,
    providers: list[str] | None = None,
    *,
    share_arena: bool = False,
    **kwargs: Any,
) -> ort.InferenceSession:
    """An ``onnxruntime.InferenceSession`` of ``path`` that shares its weights with every other one.

    Args:
        path: a model written by ``weightshare convert`` (with or without ``--prepack``); any other ONNX
            model opens as it is.
        sess_options: your options; the sharing settings below are added to them.
        providers: ORT execution providers (default: CPU).
        share_arena: the sessions of this process that ask for it share one CPU activation arena (ORT's
            environment allocator, registered once per process, and ``session.use_env_allocators=1``) instead of
            one arena each: N sessions that run one at a time keep one arena's worth of activations, not N
            (docs/guide.md has the figures). Sessions running at the same time grow it to their joint peak, and
            it is never returned to the system while the process lives.
        **kwargs: passed on to ``InferenceSession``.

    Returns:
        The session. For a ``--prepack`` model: the prepacked graph at your options when this machine
        matches and its packed payloads are intact, else the portable model with
        ``session.disable_prepacking=1``. For a plain conversion: ``session.disable_prepacking=1`` and, when
        the graph has Conv weights ORT would reorder into a private NCHWc copy, ``ORT_ENABLE_EXTENDED``
        (outputs are those of the original model under the same settings). The choice is logged once.

    Raises:
        InvalidModel: the model, its blob or the blob's ``--prepack`` record cannot be trusted or read.

    The model and its external-data files are opened once, without following a final symlink, checked
    on those descriptors, and ORT is given the model's bytes from that descriptor: a commit renaming a new
    model over ``path`` while this runs cannot change what the session computes.
    """
    import onnxruntime as ort

    providers = providers or ["CPUExecutionProvider"]
    if share_arena:
        sess_options = sess_options or ort.SessionOptions()
        shared_arena()
        _set_entry(sess_options, "session.use_env_allocators", "1")
    with _OpenedModel.open(Path(path)) as opened:
        found = opened.record()
        if found is None:
            return _open_plain(opened, sess_options, providers, kwargs)
        info, location = found
        why = mismatch(info) or check_packed_payloads(fd_path(opened.blobs[location]), info)
        if why is None:
            try:
                sess = opened.session(sess_options, providers, kwargs)
                _say_once(
                    Path(path),
                    f"weightshare: {Path(path).name}: sharing its pre-packed weights (prepacked graph, your options)",
                    logging.INFO,
                )
                return sess
            except InvalidModel:
                raise
            except Exception as e:  # ORT's ValidatePrePackedWeights and friends: fall back, not fail
                why = f"onnxruntime refused it ({str(e).splitlines()[0][:200]})"
    portable = Path(path).parent / portable_of(info, Path(path).name)
    _say_once(
        Path(path),
        f"weightshare: {Path(path).name}: not using its pre-packed weights: {why}; "
        f"opening {portable.name} with session.disable_prepacking=1 instead",
    )
    sess_options = sess_options or ort.SessionOptions()
    _set_entry(sess_options, "session.disable_prepacking", "1")
    with _OpenedModel.open(portable) as opened:
        return opened.session(sess_options, providers, kwargs)


_ARENA_LOCK = threading.Lock()
_ARENA_REGISTERED: list[bool] = []


def shared_arena() -> None:
    """Register, once per process, the CPU arena allocator that sessions with ``session.use_env_allocators=1``
    share (ORT's environment allocator, default arena settings)."""
    import onnxruntime as ort

    with _ARENA_LOCK:
        if _ARENA_REGISTERED:
            return
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))  # ORT's defaults
        _ARENA_REGISTERED.append(True)


def fd_path(fd: int) -> str:
    """A path that opens the file held by ``fd`` itself, whatever is renamed over its name meanwhile."""
    return f"/proc/self/fd/{fd}"


def _open_plain(
    opened: _OpenedModel, so: ort.SessionOptions | None, providers: list[str], kwargs: dict[str, Any]
) -> ort.InferenceSession:
    """A model without a ``--prepack`` record: the settings under which its mapped payloads are shared."""
    import onnxruntime as ort

    if not opened.blobs:  # every weight inline: nothing to share, ORT's defaults are best
        return opened.session(so, providers, kwargs)
    so = so or ort.SessionOptions()
    _set_entry(so, "session.disable_prepacking", "1")
    chosen = "session.disable_prepacking=1"
    from .formats.onnx.ort.probe import nchwc_convs

    convs = nchwc_convs(opened.data)
    if (
        convs
        and this_machine()["nchwc_block"]
        and so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    ):
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        chosen += f" and ORT_ENABLE_EXTENDED (ORT_ENABLE_ALL would copy {convs} Conv weight(s) into NCHWc per session)"
    _say_once(opened.path, f"weightshare: {opened.path.name}: sharing its weights with {chosen}", logging.INFO)
    return opened.session(so, providers, kwargs)
