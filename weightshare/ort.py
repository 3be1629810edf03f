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

import ctypes
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .blob import read_safetensors_metadata
from .errors import InvalidModel
from .report import JsonDict

if TYPE_CHECKING:
    import onnxruntime as ort

log = logging.getLogger("weightshare.ort")

METADATA_KEY = "weightshare.ort_prepack"
_verified: set[tuple[str, int, int, int]] = set()  # blobs whose ORT payloads passed their checksums in this process
_warned: set[str] = set()
_machine: JsonDict | None = None


def malloc_trim() -> bool:
    """Hand freed heap pages back to the OS (glibc); False where there is no malloc_trim."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def this_machine() -> JsonDict:
    """What packed data depends on, measured here the way conversion measured it (cached)."""
    global _machine
    if _machine is None:
        import platform

        import onnxruntime as ort

        from .formats.onnx.ort_child import cpu_features, nchwc_block_size

        _machine = {
            "onnxruntime": ort.__version__,
            "machine": platform.machine(),
            "cpu_features": cpu_features(),
            "nchwc_block": nchwc_block_size(),
        }
    return _machine


def _blob_paths(model_path: Path) -> list[Path]:
    import onnx

    from .formats.onnx.prepack import external_tensors

    model = onnx.load(str(model_path), load_external_data=False)
    locations = {e.value for t in external_tensors(model) for e in t.external_data if e.key == "location"}
    return [model_path.parent / loc for loc in sorted(locations)]


def prepack_info(model_path: str | os.PathLike[str]) -> tuple[JsonDict, Path] | None:
    """The ``--prepack`` record of the model's blob and the blob's path, or None for any other model."""
    for blob in _blob_paths(Path(model_path)):
        try:
            _start, header, _meta = read_safetensors_metadata(str(blob))
            with open(blob, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                raw = json.loads(f.read(n)).get("__metadata__", {}).get(METADATA_KEY)
        except (OSError, InvalidModel, ValueError):
            continue
        if raw:
            return json.loads(raw), blob
    return None


def check_packed_payloads(blob: Path, info: JsonDict) -> str | None:
    """Recorded digest (BLAKE3, or SHA-256 in older blobs) of every payload only the prepacked model uses;
    the first mismatch, or None."""
    from .blob import split_digest
    from .recorded import record_problem, recorded_records

    st = blob.stat()
    key = (str(blob.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _verified:
        return None
    prefixes = (info.get("packed_prefix", "ort.prepacked/"), info.get("optimized_prefix", "ort.optimized/"))
    for name, offset, length, recorded in recorded_records(str(blob)):
        if name.startswith(prefixes) and record_problem(str(blob), offset, length, recorded, st.st_size):
            if offset + length > st.st_size:
                return f"{name} is truncated"
            return f"{name} does not match its recorded {split_digest(recorded)[0]} digest"
    _verified.add(key)
    return None


def mismatch(info: JsonDict) -> str | None:
    """Why packed data built for ``info`` cannot run here, or None."""
    here = this_machine()
    for key in ("onnxruntime", "machine", "nchwc_block", "cpu_features"):
        if info.get(key) != here[key]:
            return f"it was packed for {key} {info.get(key)!r}, this machine has {here[key]!r}"
    return None


def _say_once(path: Path, message: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        log.warning("%s", message)


def session(
    path: str | os.PathLike[str],
    sess_options: ort.SessionOptions | None = None,
    providers: list[str] | None = None,
    **kwargs: Any,
) -> ort.InferenceSession:
    """An ``onnxruntime.InferenceSession`` of ``path`` that shares its weights with every other one.

    For a ``--prepack`` model: the prepacked graph when this machine matches and its packed payloads
    are intact, else the portable model with ``session.disable_prepacking=1``. The optimization level is
    left alone so that outputs stay those of the original model; at the default level ORT then copies
    Conv weights into NCHWc layout per session (set ORT_ENABLE_EXTENDED to share them at some speed cost).
    Any other model opens as it is (a model converted without ``--prepack`` shares only under
    ``session.disable_prepacking=1``; pass such options yourself). Extra arguments go to ``InferenceSession``.
    """
    import onnxruntime as ort

    path = Path(path)
    providers = providers or ["CPUExecutionProvider"]
    found = prepack_info(path)
    why = None
    if found is not None:
        info, blob = found
        why = mismatch(info) or check_packed_payloads(blob, info)
        if why is None:
            try:
                sess = ort.InferenceSession(str(path), sess_options, providers=providers, **kwargs)
                malloc_trim()
                return sess
            except Exception as e:  # ORT's ValidatePrePackedWeights and friends: fall back, not fail
                why = f"onnxruntime refused it ({str(e).splitlines()[0][:200]})"
        # A --shared-blob zoo's blob names every model's portable twin; a model's own blob names one.
        twins = info.get("portable_models")
        twin = twins.get(path.name) if isinstance(twins, dict) else None
        portable = path.parent / str(twin or info.get("portable_model", ""))
        _say_once(
            path,
            f"weightshare: {path.name}: not using its pre-packed weights: {why}; "
            f"opening {portable.name} with session.disable_prepacking=1 instead",
        )
        path = portable
        sess_options = sess_options or ort.SessionOptions()
        sess_options.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(str(path), sess_options, providers=providers, **kwargs)
    malloc_trim()
    return sess
