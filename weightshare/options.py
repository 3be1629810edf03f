"""Options every converter understands."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import cast

from ._placement import AlignPolicy

__all__ = ["BLOB_GRACE_S", "INLINE_THRESHOLD", "ConvertOptions", "Unpack"]

BLOB_GRACE_S = 600.0  # an unreferenced old blob stays this long: readers that opened the old model still find it
INLINE_THRESHOLD = 1024  # payloads below this stay inside the model file: a page of padding would cost more


class Unpack(str, Enum):
    """``--unpack`` values: opt-in unpackings a converter does on request. Any other value is a usage error.

    Its members are the values the built-in formats declare (``Format.options.unpack``; ``tests/test_layout.py``
    holds the two lists equal), named by value (``Unpack.SPARSE`` is ``"sparse"``, ``Unpack.ORT_CPU`` is
    ``"ort-cpu"``); the API takes plain strings too, including the values of a format registered at run time.
    Declared here rather than built from the registry: options sit below the format protocol, which names them.
    """

    SPARSE = "sparse"
    DEQUANTIZE = "dequantize"
    ORT_CPU = "ort-cpu"


@dataclass
class ConvertOptions:
    """Every option of a conversion, as one value (``weightshare.convert`` also takes them as keywords).

    Every field is forwarded to the format of each model. The fields a format declares as its own
    (``Format.options.fields``: TFLite's ``external``, ONNX's ``ort_child_*`` and ``ort_max_growth``) are
    read only by the formats that declare them; the other formats ignore them. ``unpack`` values are checked
    against what the registered formats declare (``Format.options.unpack``) before anything is read.

    Args:
        align: payload alignment (``--align``, ``--align-threshold``).
        inline_threshold: payloads smaller than this many bytes stay inline.
        keep_packed: do not unpack (no fp16->fp32 folding, typed fields stay as they are).
        unpack: opt-in unpackings, values a format declares (``Unpack``): {"sparse"}, {"ort-cpu"}.
        blob_name: file name of the external blob inside OUTDIR (ONNX, TFLite --external).
        blob_grace_s: an earlier blob that no model in OUTDIR references any more is removed by a later
            run once it has been unreferenced this many seconds (``--blob-grace``).
        external: TFLite only: write an external safetensors blob instead of appending.
        prepack: also store the runtime's pre-packed weights. ONNX: ONNX Runtime's pre-packed MatMul/Gemm
            weights and NCHWc-reordered Conv weights in the blob, so default-option sessions share them;
            TFLite: an XNNPACK weight cache bound to the model's content (see ``weightshare.litert``).
        progress: called with a byte count as payload bytes are written (for progress bars).
        progress_total: called once with the payload bytes a converter is about to write.
        stage: called with a short description when a phase that writes no payload bytes starts (the
            onnxruntime child of ``prepack`` / ``unpack={"ort-cpu"}``), for a progress display to name it.
        ort_child_timeout_s: wall-time limit of the onnxruntime child (``--prepack``, ``--unpack ort-cpu``);
            None: derived from the model's size (``formats.onnx.ort.limits``). Its CPU-time limit follows.
        ort_child_memory_mib: address-space limit of that child; None: derived from the model's size.
        ort_max_growth: what the child may write (ORT's optimized and packed copies), as a multiple of the
            model's bytes; None: 4x, at least 16 MiB.

    Example:
        >>> weightshare.convert("model.onnx", "out/", ConvertOptions(unpack=frozenset({"ort-cpu"})))
    """

    align: AlignPolicy = field(default_factory=AlignPolicy)
    inline_threshold: int = INLINE_THRESHOLD
    keep_packed: bool = False
    unpack: frozenset[str] = frozenset()
    blob_name: str | None = None
    blob_grace_s: float = BLOB_GRACE_S
    external: bool = False
    prepack: bool = False
    progress: Callable[[int], object] | None = None
    progress_total: Callable[[int], None] | None = None
    stage: Callable[[str], None] | None = None
    ort_child_timeout_s: float | None = None
    ort_child_memory_mib: int | None = None
    ort_max_growth: float | None = None

    def __post_init__(self) -> None:
        # One value is a value, not its characters: unpack="ort-cpu" once became {"o", "r", "t", ...}.
        given: object = self.unpack  # the API takes one value or any iterable of them, Unpack members or strings
        values = cast("Iterable[object]", (given,) if isinstance(given, str) else given)
        self.unpack = frozenset(v.value if isinstance(v, Enum) else str(v) for v in values)
        check_numbers(self)


# Each number a user gives, with its option and the range it must lie in: a NaN compares false with every bound
# (a "timeout" that never fires, a grace period that never ends), an infinity overflows the integer limits it
# becomes (setrlimit), a negative value means nothing. Upper bounds are far above any real use.
_RANGES: dict[str, tuple[str, float, float, bool]] = {  # field: (option, low, high, low allowed)
    "blob_grace_s": ("--blob-grace", 0.0, 100 * 365 * 86400.0, True),
    "ort_child_timeout_s": ("--ort-child-timeout", 0.0, 30 * 86400.0, False),
    "ort_child_memory_mib": ("--ort-child-memory", 0.0, float(1 << 40), False),
    "ort_max_growth": ("--ort-max-growth", 0.0, 1e6, False),
    "inline_threshold": ("--inline-threshold", 0.0, float(1 << 62), True),
}


def check_numbers(options: ConvertOptions) -> None:
    """Refuse a number option that is not finite or out of its range (``UsageError``, before anything is read)."""
    import math

    from .errors import UsageError

    for name, (option, low, high, low_ok) in _RANGES.items():
        value = getattr(options, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{option} takes a number, got {value!r}")
        if not math.isfinite(value) or value > high or value < low or (value == low and not low_ok):
            bound = f">= {low:g}" if low_ok else f"> {low:g}"
            raise UsageError(f"{option} must be a finite number {bound} and <= {high:g}, got {value!r}")
