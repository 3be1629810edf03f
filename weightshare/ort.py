"""Open a model converted with ``--prepack`` so that every session shares its weights.

    import weightshare.ort
    sess = weightshare.ort.session("out/model.onnx")   # an onnxruntime.InferenceSession

``convert --prepack`` writes MODEL.onnx, whose pre-packed MatMul/Gemm weights and NCHWc Conv
weights are exact only inside the envelope they were made in: the onnxruntime version, the CPU kind
(the ISA level MLAS dispatches on) and the session-option class (ORT_ENABLE_ALL, CPU provider, no option
that changes kernels: ``KEEPS_PACKED``), all recorded in the blob. It also writes MODEL.portable.onnx,
which references only the plain payloads. ``session`` opens the prepacked model inside the envelope when
its packed payloads pass their recorded checksums, and otherwise the portable one at the caller's own
options (the original's outputs at those options; each session then pre-packs its own copy, a cost the
one logged line states). ``share_with_other_numerics=True`` opens the portable model with
``session.disable_prepacking=1`` instead: shared, but MLAS's unpacked kernels round otherwise (docs/guide.md).

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
from .formats.onnx.ort.prepack_record import METADATA_KEY, PAIR_KEY, name_from_prefix, portable_of
from .report import JsonDict

if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger("weightshare.ort")

__all__ = [
    "KEEPS_PACKED",
    "METADATA_KEY",
    "check_packed_payloads",
    "envelope_problem",
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
        # a zoo's (--shared-blob) are "<model stem>/ort.prepacked/...": every model's, checked alike
        if not isinstance(name, str) or name_from_prefix(name, prefixes) is None:
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
        Why it cannot (naming the onnxruntime version and CPU kind it was packed for and this machine's), or
        None when it can.
    """
    from .formats.onnx.ort.probe import cpu_kind

    here = this_machine()
    for key in ("onnxruntime", "machine", "nchwc_block", "cpu_features"):
        if info.get(key) != here[key]:
            kind = cpu_kind(info.get("cpu_features", []), str(info.get("machine")))
            made = f"onnxruntime {info.get('onnxruntime')} on {kind}"
            runs = f"onnxruntime {here['onnxruntime']} on {cpu_kind(here['cpu_features'], str(here['machine']))}"
            detail = "" if key == "onnxruntime" else f"; {key} {info.get(key)!r} here {here[key]!r}"
            return f"it was packed for {made}, this machine runs {runs}{detail}"
    return None


# SessionOptions attributes any value of which keeps the packed graph exact (each tested in
# tests/test_ort_envelope.py): memory planning, threads, logging, profiling. Every other attribute must keep
# its default, graph_optimization_level must be ORT_ENABLE_ALL (what --prepack optimized at).
KEEPS_PACKED = (
    "enable_cpu_mem_arena",
    "enable_mem_pattern",
    "enable_mem_reuse",
    "enable_profiling",
    "execution_mode",
    "inter_op_num_threads",
    "intra_op_num_threads",
    "log_severity_level",
    "log_verbosity_level",
    "logid",
    "profile_file_prefix",
    "use_per_session_threads",
)
# config entries that change no kernel (any value), and those known to change kernels or the graph (their
# default, or unset, keeps the packed graph). ORT's Python API cannot list the entries a SessionOptions holds,
# so an entry named in neither list cannot be seen here (docs/guide.md says so).
_CONFIG_KEEPS = (
    "session.use_env_allocators",
    "session.intra_op.allow_spinning",
    "session.inter_op.allow_spinning",
    "session.model_external_initializers_file_folder_path",
)
_CONFIG_CHANGES = {
    "session.disable_prepacking": "0",
    "session.set_denormal_as_zero": "0",
    "optimization.enable_gelu_approximation": "0",
    "optimization.enable_cast_chain_elimination": "0",
    "optimization.disable_specified_optimizers": "",
    "optimization.minimal_build_optimizations": "",
    "session.enable_quant_qdq": "1",
    "session.disable_quant_qdq": "0",
    "session.enable_quant_qdq_cleanup": "0",
    "session.disable_double_qdq_remover": "0",
    "session.qdqisint8allowed": "",
    "session.x64quantprecision": "0",
    "session.qdq_matmulnbits_accuracy_level": "",
    "session.disable_aot_function_inlining": "0",
    "mlas.enable_gemm_fastmath_arm64_bfloat16": "0",
    "mlas.disable_kleidiai": "0",
    "mlas.use_lut_gemm": "0",
    "session.load_model_format": "",
    "session.use_ort_model_bytes_directly": "0",
}


def envelope_problem(
    sess_options: ort.SessionOptions | None, providers: list[str] | None = None, **kwargs: Any
) -> str | None:
    """Why a ``--prepack`` model's packed graph would compute otherwise than the original at these options
    (the option outside the allow-list), or None when they keep it (``KEEPS_PACKED``, docs/guide.md).

    Args:
        sess_options: the caller's options (None: ORT's defaults).
        providers: the execution providers asked for (anything but the CPU provider alone is outside).
        **kwargs: the other ``InferenceSession`` keywords (``disabled_optimizers`` is outside).

    Returns:
        The first option outside the allow-list, in one phrase; None inside it.
    """
    import onnxruntime as ort

    if providers and list(providers) != ["CPUExecutionProvider"]:
        return f"providers {list(providers)} (the packed graph is ORT's CPU graph)"
    if kwargs.get("disabled_optimizers"):
        return "disabled_optimizers (the packed graph is ORT_ENABLE_ALL's)"
    if sess_options is None:
        return None
    if sess_options.graph_optimization_level != ort.GraphOptimizationLevel.ORT_ENABLE_ALL:
        return (
            f"graph_optimization_level {sess_options.graph_optimization_level.name} (the packed graph is "
            "ORT_ENABLE_ALL's; below it the original runs other kernels)"
        )
    default = ort.SessionOptions()
    for name in dir(sess_options):
        if name.startswith("_") or name in KEEPS_PACKED or name == "graph_optimization_level":
            continue
        value = getattr(sess_options, name)
        if callable(value):
            continue
        if value != getattr(default, name):
            return f"{name}={value!r} (not in the options that keep the packed graph)"
    for key, dflt in _CONFIG_CHANGES.items():
        try:
            value = sess_options.get_session_config_entry(key)
        except Exception:  # noqa: BLE001 - ORT raises a plain RuntimeError for a key that is not set
            continue
        if value != dflt:
            return f"{key}={value} (changes the kernels or the graph ORT runs)"
    return None


def _packed_bytes(data: bytes) -> int:
    """Bytes of the packed copies the model ``data`` maps (its own ``prepacked_N`` entries, not the blob's names: a
    zoo's blob holds every model's, under the stem of the model that packed them first): what each session of the
    portable model pre-packs for itself."""
    from .formats.onnx.ort.probe import WireError, packed_bytes, packed_entries

    try:
        return packed_bytes(packed_entries(data))
    except WireError:
        return 0


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
    share_with_other_numerics: bool = False,
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
            (scripts/bench_share_arena.py measures it). Sessions running at the same time grow it to their joint
            peak, and it is never returned to the system while the process lives.
        share_with_other_numerics: where a ``--prepack`` model falls back to its portable model, open it with
            ``session.disable_prepacking=1`` (weights shared, MLAS's unpacked kernels: other roundings, up to
            ~2x slower at batch > 1; docs/guide.md) instead of the default (the original's outputs at your
            options, each session pre-packing its own copy).
        **kwargs: passed on to ``InferenceSession``.

    Returns:
        The session. For a ``--prepack`` model: the prepacked graph when this machine runs the onnxruntime
        version and CPU kind it was packed for, your options keep the packed graph (``envelope_problem``) and
        its packed payloads are intact; else its portable model at your options (the original's outputs). For
        a plain conversion: ``session.disable_prepacking=1`` and, when the graph has Conv weights ORT would
        reorder into a private NCHWc copy, ``ORT_ENABLE_EXTENDED``. The choice is logged once.

    Raises:
        InvalidModel: the model, its blob, the blob's ``--prepack`` record or the portable twin (not the one
            converted with this model) cannot be trusted or read.

    The model and its external-data files are opened once, without following a final symlink, checked
    on those descriptors, and ORT is given the model's bytes from that descriptor: a commit renaming a new
    model over ``path`` while this runs cannot change what the session computes.
    """
    import onnxruntime as ort

    outside = envelope_problem(sess_options, providers, **kwargs)
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
        cost = _packed_bytes(opened.data)
        pair = _metadata_props(opened.data).get(PAIR_KEY)
        why = outside or mismatch(info) or check_packed_payloads(fd_path(opened.blobs[location]), info)
        if why is None:
            _advise_inputs(opened)
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
    if share_with_other_numerics:
        how = (
            "with session.disable_prepacking=1 (share_with_other_numerics: weights shared, outputs rounded by "
            "MLAS's unpacked kernels, not the original's)"
        )
    else:
        how = (
            "at your options (the original's outputs; each session pre-packs its own copy of the weights, "
            f"+{cost / 2**20:.1f} MiB per session)"
        )
    _say_once(
        Path(path),
        f"weightshare: {Path(path).name}: not using its pre-packed weights: {why}; opening {portable.name} {how}",
    )
    if share_with_other_numerics:
        sess_options = sess_options or ort.SessionOptions()
        _set_entry(sess_options, "session.disable_prepacking", "1")
    with _OpenedModel.open(portable) as twin:
        theirs = _metadata_props(twin.data).get(PAIR_KEY)
        if pair is not None and theirs != pair:
            raise InvalidModel(
                f"its portable model {portable.name} was not converted with it ("
                + ("it carries no pair id" if theirs is None else "another conversion's pair id")
                + "): re-run weightshare convert --prepack from the original model",
                Path(path),
            )
        return twin.session(sess_options, providers, kwargs)


def _metadata_props(data: bytes) -> dict[str, str]:
    from .formats.onnx.ort.probe import WireError, metadata_props

    try:
        return metadata_props(data)
    except WireError:
        return {}


def _advise_inputs(opened: _OpenedModel) -> None:
    """Say, before ORT advises removing them, why the prepacked model's overridable initializers must stay."""
    from .formats.onnx.ort.probe import WireError, overridable_initializers

    try:
        n = overridable_initializers(opened.data)
    except WireError:
        return
    if n and f"inputs:{opened.path}" not in _warned:
        _warned.add(f"inputs:{opened.path}")
        log.warning(
            "weightshare: %s: %d initializer(s) are graph inputs on purpose: they keep the Cast the original runs "
            "at every run; onnxruntime's advice to remove them from the inputs (remove_initializer_from_input.py) "
            "would let it fold that Cast and change the outputs (docs/guide.md)",
            opened.path.name,
            n,
        )


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
