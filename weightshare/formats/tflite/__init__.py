"""TFLite / LiteRT: weights appended page-aligned after the flatbuffer (or in an external blob), fp16 DEQUANTIZE folded.

Modules: ``flatbuf`` (bounds-checked scan over mmap), ``graph`` (validation, fp16 folds),
``convert`` (plan, write, emit).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import InvalidModel, UsageError
from ..base import BenchRuntime, BlobContainer, FormatDefaults, FormatOptions
from .findings import CODES
from .unpack import UNPACK

if TYPE_CHECKING:
    from ..._atomic import OutputTransaction
    from ..._findings import Finding
    from ..._inventory import MeasureInputs, ModelInventory
    from ..._pipeline import PreparedModel
    from ..._verify import VerifyReport
    from ...options import ConvertOptions
    from ...report import ConversionReport


class TfliteFormat(FormatDefaults):
    name = "tflite"
    title = "TFLite"
    suffixes = (".tflite",)
    maps_in_place = frozenset({"embedded", "external"})  # the flatbuffer is mapped with the file
    maps_unaligned = False
    findings = CODES
    settings = ("litert-builtin", "litert-xnnpack", "litert-compiled-cache")  # inventory.NO_DELEGATE, XNNPACK, ...
    options = FormatOptions(unpack=UNPACK, fields=("external",))  # --external: ExternalBuffer groups in a blob
    decodes = True  # verify --decode-steps: a prefill signature, then decode steps feeding the KV outputs back

    @property
    def blob_container(self) -> BlobContainer:
        from ..._safetensors import CONTAINER

        return CONTAINER

    def claims(self, path: Path, head: bytes) -> bool:
        if len(head) >= 8 and head[4:8] == b"TFL3":  # the flatbuffer file identifier
            return True
        if path.suffix == ".tflite" and not path.is_dir():
            raise InvalidModel("not a TFLite flatbuffer (no TFL3 identifier)", path)
        return False

    def convert(self, src: Path, out_dir: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
        from .convert import convert_file

        return convert_file(src, out_dir, options, tx)

    def prepare(self, src: Path, out_dir: Path, options: ConvertOptions) -> PreparedModel:
        if not options.external:
            raise UsageError("TFLite models join a shared blob only with --external", src)
        from .convert import prepare

        return prepare(src, out_dir, options)

    def inventory(self, path: Path, hash_payloads: bool) -> ModelInventory:
        from .inventory import inventory_file

        return inventory_file(path, hash_payloads)

    def measure_copies(
        self, path: Path, feeds: MeasureInputs | None = None
    ) -> tuple[dict[str, int], dict[str, int], list[str], dict[str, int], list[Finding], dict[str, Any]]:
        """Bytes one more LiteRT interpreter costs per setting, measured in child processes (``measure.py``)."""
        from .measure import measure_copies

        return measure_copies(path, feeds)

    def measurement_key(self, path: Path) -> tuple[dict[str, str], list[Path]] | None:
        """What ``measure_copies`` depends on besides the model's bytes (``measure.measurement_key``)."""
        from .measure import measurement_key

        return measurement_key(path)

    def verify(self, report: VerifyReport, original: Path, converted: Path, opts: dict[str, Any], broken: bool) -> None:
        from ..._runtimes.memory import verify_bounded
        from .verify import mapped

        # in a child under the memory bound of the larger model (``_runtimes/bound.py``)
        largest = max(mapped(original), mapped(converted))
        verify_bounded(f"{__name__}.verify", "verify_in_runtime", report, original, converted, opts, broken, largest)

    def quiet_exit(self) -> None:
        """LiteRT logs its teardown on native stderr at exit: silence it once a command has printed its result."""
        from ..._runtimes.litert import silence_native_stderr_until_exit

        silence_native_stderr_until_exit()

    def bench_runtime(self, path: Path) -> BenchRuntime:
        from ..onnx.measure import MALLOC_ENV
        from .measure import measure_interpreters, measure_shared

        return BenchRuntime(
            measure_interpreters,
            (("no delegate", True), ("XNNPACK", False)),
            prepacked=("weightshare.litert.interpreter", True),
            prepacked_env=MALLOC_ENV,
            env=MALLOC_ENV,  # as check's measuring child: glibc returns freed buffers, so rows compare with check
            takes_inputs=True,
            prepacked_measure=measure_shared,
        )


FORMAT = TfliteFormat()
