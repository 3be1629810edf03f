"""Options every converter understands."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from enum import Enum
from typing import Any, cast

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


@dataclass(frozen=True)
class Opt:
    """How a user gives one ``ConvertOptions`` field: its keyword of the public functions and its CLI flag.

    This metadata is the one declaration of an option: ``weightshare convert``'s parameters, the keywords of
    ``weightshare.convert`` / ``convert_folder`` / ``convert_many`` / ``convert_zoo`` / ``merge`` (the TypedDict in
    ``_option_keywords.py``, generated from it by ``scripts/gen_option_keywords.py``), their docstrings' Args and the
    range checks are derived from it. Which formats read a field is what the formats declare
    (``Format.options.fields``); a field no format declares is read by every converter or by the driver.

    Attributes:
        help: what the option does (``--help`` text and the keyword's Args line).
        flag: the CLI flag; None for a keyword only Python can give (a callback).
        keyword: the keyword name (default: the field's name).
        keyword_type: the keyword's type, as Python source (default: the field's annotation).
        cli_type: the CLI parameter's type when it is not the keyword's (``--unpack`` repeatable: ``list[str]``).
        panel: the ``--help`` panel the flag is listed in.
        part: the field is a frozen dataclass and this keyword sets its attribute ``part`` (``--align-threshold``).
        bounds: (low, high, low allowed): a number outside is refused before anything is read; a NaN or an
            infinity always (a "timeout" that never fires, an integer limit that overflows).
        metavar: the CLI metavar (default: typer's, from the type).
        merge: ``merge`` takes it too (layout and progress options; the rest are about conversion only).
    """

    help: str
    flag: str | None = None
    keyword: str | None = None
    keyword_type: str | None = None
    cli_type: object = None
    panel: str | None = None
    part: str | None = None
    bounds: tuple[float, float, bool] | None = None
    metavar: str | None = None
    merge: bool = False


def _declare(*opts: Opt) -> dict[str, tuple[Opt, ...]]:
    return {"options": opts}


_MAX_SECONDS = 100 * 365 * 86400.0


@dataclass
class ConvertOptions:
    """Every option of a conversion, as one value (the public functions also take them as keywords).

    Each field declares how a user gives it (``Opt``, in the field's metadata): the flag of ``weightshare convert``
    and the keyword of ``weightshare.convert``, with its help text and the range it must lie in. The fields a
    format declares as its own (``Format.options.fields``: TFLite's ``external``, ONNX's ``ort_child_*`` and
    ``ort_max_growth``) are read only by the formats that declare them; the other formats ignore them. ``unpack``
    values are checked against what the registered formats declare (``Format.options.unpack``) before anything is
    read.

    Args:
        align: payload alignment (``--align``, ``--align-threshold``).
        inline_threshold: payloads smaller than this many bytes stay inline.
        keep_packed: do not unpack (no fp16->fp32 folding, typed fields stay as they are).
        unpack: opt-in unpackings, values a format declares (``Unpack``): {"sparse"}, {"ort-cpu"}.
        blob_name: file name of the external blob inside OUTDIR (ONNX, TFLite --external).
        blob_grace_s: an earlier blob that no model in OUTDIR references any more is removed by a later
            run once it has been unreferenced this many seconds (``--blob-grace``).
        external: TFLite only: write an external safetensors blob instead of appending.
        prepack: also store the runtime's pre-packed weights (``--prepack``).
        progress: called with a byte count as payload bytes are written (for progress bars).
        progress_total: called once with the payload bytes a converter is about to write.
        stage: called with a short description when a phase that writes no payload bytes starts (the
            onnxruntime child of ``prepack`` / ``unpack={"ort-cpu"}``), for a progress display to name it.
        ort_child_timeout_s: wall-time limit of the onnxruntime child (``--prepack``, ``--unpack ort-cpu``);
            None: derived from the model's size (``formats.onnx.ort.limits``). Its CPU-time limit follows.
        ort_child_memory_mib: address-space limit of that child; None: derived from the model's size.
        ort_max_growth: what the child may write (ORT's optimized and packed copies), as a multiple of the
            model's bytes; None: 4x, at least 16 MiB.
        shared_blob: zoo mode: every model references this one blob (``--shared-blob``); read by the driver.

    Example:
        >>> weightshare.convert("model.onnx", "out/", ConvertOptions(unpack=frozenset({"ort-cpu"})))
    """

    align: AlignPolicy = field(
        default_factory=AlignPolicy,
        metadata=_declare(
            Opt(
                help="Alignment in bytes of payloads of at least --align-threshold bytes.",
                flag="--align",
                keyword="align",
                keyword_type="int",
                panel="Blob layout",
                part="large",
                merge=True,
            ),
            Opt(
                help="Payload size from which --align applies; smaller payloads are --small-align aligned.",
                flag="--align-threshold",
                keyword="align_threshold",
                keyword_type="int",
                panel="Blob layout",
                part="threshold",
                merge=True,
            ),
            Opt(
                help="Alignment in bytes of payloads below --align-threshold (default 64, a cache line); 128 or "
                "256 for runtimes and DMA engines whose loads want wider alignment.",
                flag="--small-align",
                keyword="small_align",
                keyword_type="int",
                panel="Blob layout",
                part="small",
                bounds=(1.0, float(1 << 16), True),
                merge=True,
            ),
        ),
    )
    inline_threshold: int = field(
        default=INLINE_THRESHOLD,
        metadata=_declare(
            Opt(
                help="Payloads smaller than this many bytes stay inside the model file.",
                flag="--inline-threshold",
                panel="Blob layout",
                bounds=(0.0, float(1 << 62), True),
            )
        ),
    )
    keep_packed: bool = field(
        default=False,
        metadata=_declare(
            Opt(
                help="Do not unpack: keep fp16 + Cast/DEQUANTIZE and typed protobuf fields as they are.",
                flag="--keep-packed",
                panel="Unpacking",
            )
        ),
    )
    unpack: frozenset[str] = field(
        default=frozenset(),
        metadata=_declare(
            Opt(
                help="Opt-in unpacking: values the registered formats declare (``Unpack``), one or several.",
                flag="--unpack",
                keyword_type="str | Iterable[str]",
                cli_type=list[str],
                panel="Unpacking",
                metavar="<value>",  # the values are in the help text: a metavar of each cut cells at 80 columns
            )
        ),
    )
    blob_name: str | None = field(
        default=None,
        metadata=_declare(
            Opt(
                help="Blob name inside OUTDIR: the blob is written as `NAME.<digest12>.safetensors`, digest of its "
                "content (default NAME: MODEL.weights); one model only.",
                flag="--blob",
                keyword="blob",
                panel="Blob layout",
            )
        ),
    )
    blob_grace_s: float = field(
        default=BLOB_GRACE_S,
        metadata=_declare(
            Opt(
                help="Seconds an earlier blob that no model in OUTDIR references any more, or an output of an earlier "
                "run of the same inputs that this run no longer writes (a portable twin, a model gone from the "
                "folder), is kept, for readers that opened the old model.",
                flag="--blob-grace",
                keyword="blob_grace",
                panel="Blob layout",
                bounds=(0.0, _MAX_SECONDS, True),
            )
        ),
    )
    external: bool = field(
        default=False,
        metadata=_declare(
            Opt(
                help="TFLite: write weights to a safetensors blob referenced by ExternalBuffer groups. Only LiteRT "
                "CompiledModel loads these, the classic Interpreter does not.",
                flag="--external",
                panel="Runtime",
            )
        ),
    )
    prepack: bool = field(
        default=False,
        metadata=_declare(
            Opt(
                help="Share the runtime's packed weights too. ONNX: store ONNX Runtime's pre-packed "
                "MatMul/Gemm weights and NCHWc Conv weights (this CPU, this onnxruntime) in the blob, so plain "
                "default-option sessions share every byte; MODEL.portable.onnx is written as well for other CPUs "
                "(use weightshare.ort.session). Needs onnxruntime. TFLite: also write the XNNPACK weight cache of "
                "the converted model (its name carries a digest of the model, its blob and the LiteRT version); "
                "load with weightshare.litert.compiled_model.",
                flag="--prepack",
                panel="Runtime",
            )
        ),
    )
    progress: Callable[[int], object] | None = field(
        default=None,
        metadata=_declare(Opt(help="Called with a byte count as payload bytes are written.", merge=True)),
    )
    progress_total: Callable[[int], None] | None = field(
        default=None,
        metadata=_declare(Opt(help="Called once with the payload bytes a converter is about to write.", merge=True)),
    )
    stage: Callable[[str], None] | None = field(
        default=None,
        metadata=_declare(Opt(help="Called with a short description when a phase that writes no bytes starts.")),
    )
    ort_child_timeout_s: float | None = field(
        default=None,
        metadata=_declare(
            Opt(
                help="Seconds the onnxruntime child of --prepack / --unpack ort-cpu may run (CPU time follows); "
                "default: 30 plus 600 per GiB of model.",
                flag="--ort-child-timeout",
                keyword="ort_child_timeout",
                panel="ONNX Runtime child",
                bounds=(0.0, 30 * 86400.0, False),
            )
        ),
    )
    ort_child_memory_mib: int | None = field(
        default=None,
        metadata=_declare(
            Opt(
                help="Address space (MiB) of that child; default: 4096 plus 8x the model.",
                flag="--ort-child-memory",
                keyword="ort_child_memory",
                panel="ONNX Runtime child",
                bounds=(0.0, float(1 << 40), False),
            )
        ),
    )
    ort_max_growth: float | None = field(
        default=None,
        metadata=_declare(
            Opt(
                help="What that child may write (optimized and packed copies) as a multiple of the model's size; "
                "default 4 (at least 16 MiB).",
                flag="--ort-max-growth",
                panel="ONNX Runtime child",
                bounds=(0.0, 1e6, False),
            )
        ),
    )
    shared_blob: str | None = field(
        default=None,
        metadata=_declare(
            Opt(
                help="Zoo mode: every model in OUTDIR references this one blob (`NAME.<digest12>.safetensors`); "
                "identical payloads are stored once. Models are swapped in one by one, each with its blob. TFLite "
                "models join with --external.",
                flag="--shared-blob",
                panel="Blob layout",
            )
        ),
    )

    def __post_init__(self) -> None:
        # One value is a value, not its characters: unpack="ort-cpu" once became {"o", "r", "t", ...}.
        self.unpack = unpack_set(self.unpack)
        check_numbers(self)

    @classmethod
    def from_keywords(cls, keywords: Mapping[str, object], command: str = "convert") -> ConvertOptions:
        """The options the public functions' keywords (``ConvertKeywords``) give; a keyword that is no option
        (or none of ``merge``'s, for ``command="merge"``) is a ``TypeError``, as Python's own."""
        known = {k.name: k for k in keywords_of(command)}
        unknown = sorted(set(keywords) - set(known))
        if unknown:
            raise TypeError(f"{command}() got unexpected keyword arguments: {', '.join(unknown)}")
        values: dict[str, object] = {}
        for name, value in keywords.items():
            k = known[name]
            if k.opt.part is None:
                values[k.field] = value
            else:
                base = values.get(k.field, k.field_default())
                values[k.field] = replace(cast("Any", base), **{k.opt.part: value})
        return cls(**cast("dict[str, Any]", values))


def unpack_set(given: object) -> frozenset[str]:
    """``unpack`` as the set of its values: one value or any iterable of them, ``Unpack`` members or strings."""
    values = cast("Iterable[object]", (given,) if isinstance(given, str) else given)
    return frozenset(v.value if isinstance(v, Enum) else str(v) for v in values)


@dataclass(frozen=True)
class Keyword:
    """One keyword of the public conversion functions, derived from a ``ConvertOptions`` field's ``Opt``."""

    name: str
    field: str
    opt: Opt
    annotation: str

    def field_default(self) -> object:
        f = _FIELDS[self.field]
        return cast("Callable[[], object]", f.default_factory)() if f.default is MISSING else f.default

    @property
    def default(self) -> object:
        value = self.field_default()
        return getattr(value, self.opt.part) if self.opt.part is not None else value


_FIELDS = {f.name: f for f in fields(ConvertOptions)}


def keywords_of(command: str = "convert") -> list[Keyword]:
    """Every keyword ``command`` (``convert``, ``zoo`` or ``merge``) takes, in ``ConvertOptions``' field order."""
    found = []
    for f in fields(ConvertOptions):
        for opt in f.metadata.get("options", ()):
            if (command == "merge" and not opt.merge) or (command == "zoo" and f.name == "shared_blob"):
                continue  # convert_zoo takes its blob's name as its third argument
            annotation = opt.keyword_type or str(f.type)
            found.append(Keyword(opt.keyword or f.name, f.name, opt, annotation))
    return found


def check_numbers(options: ConvertOptions) -> None:
    """Refuse a number option that is not finite or out of its range (``UsageError``, before anything is read)."""
    for k in keywords_of():
        if k.opt.bounds is not None:
            value = getattr(options, k.field)
            check_number(
                k.opt.flag or k.name, value if k.opt.part is None else getattr(value, k.opt.part), k.opt.bounds
            )


def check_number(option: str, value: object, bounds: tuple[float, float, bool]) -> None:
    """Refuse ``value`` of ``option`` when it is not a finite number within ``bounds`` (low, high, low allowed):
    a NaN compares false with every bound, an infinity overflows the integer limits it becomes (setrlimit), a
    negative value means nothing. Upper bounds are far above any real use."""
    import math

    from .errors import UsageError

    if value is None:
        return
    low, high, low_ok = bounds
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"{option} takes a number, got {value!r}")
    if not math.isfinite(value) or value > high or value < low or (value == low and not low_ok):
        bound = f">= {low:g}" if low_ok else f"> {low:g}"
        raise UsageError(f"{option} must be a finite number {bound} and <= {high:g}, got {value!r}")


def render_keywords() -> str:
    """The source of ``_option_keywords.py``: the keywords as TypedDicts (PEP 692), so that a type checker checks
    ``weightshare.convert(src, out, prepack=True)``. Written by ``scripts/gen_option_keywords.py``; a test fails
    when the file is not what this returns."""
    lines = [
        '"""The keyword options of the public conversion functions, as TypedDicts (PEP 692 ``Unpack``).',
        "",
        "Generated from ``ConvertOptions``' field metadata by ``scripts/gen_option_keywords.py``: do not edit.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from collections.abc import Callable, Iterable",
        "from typing import TypedDict",
        "",
        '__all__ = ["ConvertKeywords", "MergeKeywords", "ZooKeywords"]',
    ]
    # each command's keywords are a superset of the one before: a class adds its own to those it inherits
    base, seen = "TypedDict", set[str]()
    for name, command in (("MergeKeywords", "merge"), ("ZooKeywords", "zoo"), ("ConvertKeywords", "convert")):
        own = [k for k in keywords_of(command) if k.name not in seen]
        lines += ["", "", f"class {name}({base}, total=False):"]
        lines += [f"    {k.name}: {k.annotation}" for k in own]
        base, seen = name, seen | {k.name for k in own}
    return "\n".join(lines) + "\n"
