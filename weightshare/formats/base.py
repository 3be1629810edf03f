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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .._atomic import OutputTransaction
    from .._findings import CodeInfo, TextEnum
    from .._inventory import ModelInventory
    from .._pipeline import PreparedModel
    from .._placement import AlignPolicy, BlobEntry, PlannedTensor, Progress
    from .._verify import VerifyReport
    from .._write import BlobPayload
    from ..options import ConvertOptions
    from ..report import ConversionReport

__all__ = ["BenchRuntime", "BlobContainer", "BlobFile", "Format", "FormatOptions"]


class BlobFile(Protocol):
    """A blob file being written: a ``_write.Container`` that also ends the file and names its content."""

    def place(self, payload: BlobPayload, progress: Progress | None = None) -> BlobEntry:
        """Write one payload; return where it landed."""
        ...

    def finish(self) -> int:
        """Write what goes after the payloads (a header, an index); return the file's size."""
        ...

    def name_digest(self) -> str:
        """Hex digest of the content, from which the blob's file name is made (``NAME.<digest12><suffix>``)."""
        ...


@dataclass(frozen=True)
class BlobContainer:
    """The container of the blob a format's models reference by name (``--blob``, zoo mode's ``--shared-blob``):
    its file suffix, and how a writer over an open file is made from the planned payloads
    (fd, planned, alignment, metadata, per-payload name prefixes)."""

    suffix: str
    open: Callable[[int, list[PlannedTensor], AlignPolicy, dict[str, str], Sequence[str] | None], BlobFile]


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
