"""What a model format provides: the ``Format`` protocol every format folder implements.

The pipeline is the same for every format (scan -> plan -> write -> emit); a format
supplies the format-specific ends of it and the tools around it. Every dispatch on the
format (convert, zoo mode, inspect/check, verify, bench) goes through a ``Format`` found
by ``weightshare.formats.detect``; nothing outside a format's folder names a format.

Adding a format: a folder ``weightshare/formats/<name>/`` whose ``__init__.py`` defines
``FORMAT`` (an object satisfying this protocol: its methods and its facts, the blob container,
what its runtime maps in place, its settings, finding codes and own options), and one line in
``formats/__init__.py``'s ``_BUILTIN``; docs/design.md lists every file a format touches.
Heavy imports (onnx, flatbuffers, coremltools, runtimes) belong inside the methods, so that
detecting a format costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .._container import BlobContainer, BlobFile
from ..errors import Unsupported

if TYPE_CHECKING:
    from .._atomic import OutputTransaction
    from .._findings import CodeInfo, TextEnum
    from .._inventory import MeasureInputs, ModelInventory
    from .._pipeline import PreparedModel
    from .._verify import VerifyReport
    from ..options import ConvertOptions
    from ..report import ConversionReport

__all__ = [
    "BenchRuntime",
    "BlobContainer",
    "BlobFile",
    "Decodes",
    "Format",
    "FormatDefaults",
    "FormatOptions",
    "KeepsAsIs",
    "MeasuresCopies",
    "MeasuresSettings",
    "MeasurementKey",
    "QuietExit",
    "ReadsInputs",
    "SharesPrepared",
]


@dataclass(frozen=True)
class BenchRuntime:
    """How ``weightshare bench`` loads a model of this format: a measuring function run in a fresh process
    (path, session counts, share) -> rows, the runtime settings to measure, each (label, share), and the
    setting (and process environment) for the ``--prepack`` variant."""

    measure: Callable[[str, list[int], bool], list[dict[str, Any]]]
    modes: tuple[tuple[str, bool], ...]
    prepacked: tuple[str, bool] | None = None  # how a ``convert --prepack`` output is measured, if the format has one
    prepacked_env: dict[str, str] = field(default_factory=dict)  # environment of that measuring process
    env: dict[str, str] = field(default_factory=dict)  # environment of every measuring process (all rows)
    takes_inputs: bool = False  # ``measure`` takes a fourth argument, input name -> .npy file (``bench --input``)
    # how the ``--prepack`` variant is measured when not by ``measure`` (TFLite: through weightshare.litert)
    prepacked_measure: Callable[..., list[dict[str, Any]]] | None = None


@dataclass(frozen=True)
class FormatOptions:
    """The conversion options that are a format's own, declared by the format (``Format.options``).

    Shared code names none of them: an ``--unpack`` value no registered format declares is a usage error
    naming the formats that declare some, the CLI's ``--unpack`` choices and help text and ``Unpack``'s
    members are built from the built-in formats' declarations, and the ``ConvertOptions`` fields listed in
    ``fields`` are forwarded to every format and read only by those that declare them.

    Args:
        unpack: its ``--unpack`` values, each with its help text, which names the format
            (``{"sparse": "TFLite: DENSIFY of a constant sparse tensor becomes a dense constant"}``).
        unpack_excludes_keep_packed: those of its ``--unpack`` values that ``--keep-packed`` contradicts
            (refused together, before anything is read).
        fields: the ``ConvertOptions`` fields only this format reads (TFLite: ``external``).
    """

    unpack: Mapping[str, str] = field(default_factory=dict)
    unpack_excludes_keep_packed: frozenset[str] = frozenset()
    fields: tuple[str, ...] = ()


class Format(Protocol):
    """What a format folder's ``FORMAT`` provides; ``tests/toyformat`` is a complete worked example."""

    name: str  # "onnx", "tflite", "coreml": in reports and --json
    title: str  # "ONNX", "TFLite", "Core ML": how help texts name it
    suffixes: tuple[str, ...]  # what a directory walk picks up as models of this format
    # The container of the blob its models reference by name; None when its models keep their weights elsewhere
    # (a Core ML package's own weight.bin). Models of a zoo share one blob, so their formats' containers agree.

    @property
    def blob_container(self) -> BlobContainer | None: ...

    # Where the payloads a runtime maps in place (shared by every session, never copied) live: "external" (in a
    # blob or data file) and/or "embedded" (inside the model file, e.g. a flatbuffer mapped with the file).
    maps_in_place: frozenset[str]
    # The runtime maps an external payload at any offset: a misaligned one costs partly shared pages, not a copy.
    maps_unaligned: bool
    # Its own finding codes with their docs rows (severity, meaning, fix); the format-neutral ones are in
    # ``weightshare._findings.CODES``.
    findings: Mapping[TextEnum, CodeInfo]
    # Stable ids of the runtime settings its inventory reports copies under (``check --target`` takes them).
    settings: tuple[str, ...]
    # Its own conversion options: its --unpack values and the ConvertOptions fields only it reads.
    options: FormatOptions

    def claims(self, path: Path, head: bytes) -> bool:
        """True when ``path`` is a model of this format; ``head`` is its first 8 bytes (b"" for a directory).
        May raise ``InvalidModel``/``Unsupported`` for a file that has this format's name but not its content."""
        ...

    def convert(self, src: Path, out_dir: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
        """scan -> plan -> write -> emit one model into ``out_dir``; every file through ``tx``."""
        ...

    def prepare(self, src: Path, out_dir: Path, options: ConvertOptions) -> PreparedModel:
        """scan + plan for a blob shared with other models (zoo mode); raise ``Unsupported`` when the format
        (or these options) cannot reference a shared blob."""
        ...

    def inventory(self, path: Path, hash_payloads: bool) -> ModelInventory:
        """Where every payload lives and what each runtime setting copies per session (inspect / check)."""
        ...

    def verify(self, report: VerifyReport, original: Path, converted: Path, opts: dict[str, Any], broken: bool) -> None:
        """Run both models in the real runtime (or compare programs and weights) and fill ``report``.
        ``opts``: runs, seed, dims, inputs, shapes; ``broken``: the converted model's external data is damaged
        (already reported): do not run it."""
        ...

    def bench_runtime(self, path: Path) -> BenchRuntime:
        """The runtime ``bench`` measures; raise ``Unsupported`` when none runs on this platform."""
        ...

    def outputs(self, src: Path, out_dir: Path, options: ConvertOptions) -> list[Path]:
        """Every model file a conversion of ``src`` writes (the blob aside), named before anything is written so
        that two inputs never write one path: ``[out_dir / src.name]``, or more (ONNX ``--prepack``: the portable
        model too)."""
        ...

    def merge(
        self,
        sources: list[Path],
        function_names: list[str],
        default_function: str | None,
        out: Path,
        options: ConvertOptions,
        tx: OutputTransaction,
    ) -> ConversionReport:
        """``weightshare merge``: one multifunction model from several (Core ML); ``Unsupported`` for a format
        whose models have one function."""
        ...


class FormatDefaults:
    """What a format folder's ``FORMAT`` may inherit: the protocol's parts most formats answer alike (one model
    file written per input, no merge, no shared blob when ``shared_blob_refused`` says why)."""

    name: str
    # Why ``prepare`` (a blob shared by many models, zoo mode) is refused; a format that references one defines
    # ``prepare`` itself.
    shared_blob_refused = "this format cannot reference a shared blob"

    def outputs(self, src: Path, out_dir: Path, options: ConvertOptions) -> list[Path]:
        return [out_dir / src.name]

    def prepare(self, src: Path, out_dir: Path, options: ConvertOptions) -> PreparedModel:
        raise Unsupported(self.shared_blob_refused, src)

    def merge(
        self,
        sources: list[Path],
        function_names: list[str],
        default_function: str | None,
        out: Path,
        options: ConvertOptions,
        tx: OutputTransaction,
    ) -> ConversionReport:
        raise Unsupported(
            f"{self.name} models cannot be merged into one multifunction model", sources[0] if sources else None
        )


# The optional parts: a format has each or not, and shared code asks with ``isinstance`` (the type checker follows
# it), never with ``getattr`` on a name it cannot see.


@runtime_checkable
class MeasuresCopies(Protocol):
    """``check``/``inspect`` measure what one more session costs in the runtime itself."""

    def measure_copies(self, path: Path, feeds: MeasureInputs | None = None) -> tuple[Any, ...]:
        """(bytes copied per setting, one session's bytes per setting, notes[, activation bytes per setting[,
        findings about the model itself: the runtime refuses it[, what a user pays converted and original:
        ``ModelInventory.paid``]]]); ``feeds``: what the user said of the inputs
        (``check --dim/--input``)."""
        ...


@runtime_checkable
class MeasuresSettings(Protocol):
    """``measure_copies`` of some of the format's settings only: ``check``'s repeats of the figures near a line."""

    def measure_settings(self, path: Path, settings: list[str], feeds: MeasureInputs | None = None) -> tuple[Any, ...]:
        """``measure_copies``' first two figures (bytes copied, one session's bytes) for ``settings`` only."""
        ...


@runtime_checkable
class MeasurementKey(Protocol):
    """``check`` reuses a model's measured figures while what they depend on is unchanged (``_measure_cache``)."""

    def measurement_key(self, path: Path) -> tuple[dict[str, str], list[Path]] | None:
        """(the runtime that would measure ``path``: its name, version and the CPU kind it dispatches on; the
        files besides the model and the data files it maps whose bytes the measuring run reads: configs, an
        encoder, a cache), or None when nothing would be measured (the runtime missing, measuring switched off)."""
        ...


@runtime_checkable
class KeepsAsIs(Protocol):
    """Some of its models are best used as they are (``convert`` refuses them, saying why): a folder run copies
    those unchanged and says so (a MediaPipe bundle whose rebuilt layout would save nothing)."""

    def kept_as_is(self, src: Path, options: ConvertOptions) -> str:
        """Why ``src`` is copied as it is; "" when ``convert`` rewrites it."""
        ...


@runtime_checkable
class SharesPrepared(Protocol):
    """Zoo mode needs more than ``prepare`` (ONNX ``--prepack``: packed payloads staged until the zoo is written)."""

    def prepare_shared(self, src: Path, out_dir: Path, options: ConvertOptions, stages: ExitStack) -> PreparedModel:
        """``prepare`` for a zoo; what it stages, ``stages`` removes once the zoo is written."""
        ...

    def plan_shared(self, sources: list[Path], out_dir: Path, options: ConvertOptions, stages: ExitStack) -> None:
        """Before any model is prepared, when the zoo's models are all of this format: what they stage together
        (ONNX --prepack: one staged blob, which becomes the zoo's)."""
        ...

    def join_shared(self, prepared: list[PreparedModel], options: ConvertOptions) -> None:
        """Once every model is prepared: what the zoo's models share (one blob record)."""
        ...

    def report_disk(self, report: ConversionReport, peak: int) -> None:
        """The zoo-wide temporary disk peak, in each model's report."""
        ...


@runtime_checkable
class ReadsInputs(Protocol):
    """``verify --input NAME=FILE`` reads files of this format's own besides ``.npy``."""

    @property
    def input_readers(self) -> Mapping[str, Callable[[Path], Any]]:
        """Suffix -> reader (ONNX: a serialized TensorProto ``.pb``)."""
        ...


@runtime_checkable
class Decodes(Protocol):
    """``verify --decode-steps``: its models may be decoders (present outputs fed back as past inputs)."""

    decodes: bool


@runtime_checkable
class QuietExit(Protocol):
    """The runtime logs its teardown: silenced once a command has printed its result (LiteRT)."""

    def quiet_exit(self) -> None: ...
