"""Core ML ML Program packages (.mlpackage): weight.bin re-layout (convert) and streaming multifunction merge."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._findings import CodeInfo, TextEnum
from ...errors import Unsupported
from ..base import BenchRuntime, FormatDefaults, FormatOptions

if TYPE_CHECKING:
    from ..._atomic import OutputTransaction
    from ..._inventory import MeasureInputs, ModelInventory
    from ..._verify import VerifyReport
    from ...options import ConvertOptions
    from ...report import ConversionReport


NOT_MEASURED = (
    "per-load copies are the static estimate, not measured: no Core ML runtime runs here; weight.bin payloads "
    "count 0 per load because Core ML memory-maps weight.bin (Apple's documented behaviour, not verified by "
    "weightshare); coremltools itself copies: its MIL loader and save_multifunction read every payload into "
    "memory (the payload bytes once per function merged), a build-time cost `weightshare merge` avoids"
)


class CoremlFormat(FormatDefaults):
    name = "coreml"
    title = "Core ML"
    suffixes = (".mlpackage",)
    blob_container = None  # the weights stay in the package's own weight.bin
    maps_in_place = frozenset({"external"})
    maps_unaligned = False
    findings: dict[TextEnum, CodeInfo] = {}  # the format-neutral codes cover it
    settings = ("coreml",)
    options = FormatOptions()  # no --unpack of its own (constexpr decompression is not implemented)
    shared_blob_refused = (  # zoo mode
        "Core ML models keep their weights in the package's weight.bin; "
        "use `weightshare merge` to share weights between Core ML models"
    )

    def claims(self, path: Path, head: bytes) -> bool:
        if path.is_dir():
            return path.suffix == ".mlpackage" or (path / "Manifest.json").exists()
        if path.suffix == ".mlmodel":
            raise Unsupported(
                "NeuralNetwork .mlmodel files keep their weights inside the protobuf; convert the model to an "
                "ML Program (.mlpackage) with coremltools first",
                path,
            )
        return False

    def convert(self, src: Path, out_dir: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
        from .convert import convert_file

        return convert_file(src, out_dir, options, tx)

    def merge(
        self,
        sources: list[Path],
        function_names: list[str],
        default_function: str | None,
        out: Path,
        options: ConvertOptions,
        tx: OutputTransaction,
    ) -> ConversionReport:
        """``weightshare merge``: one multifunction package, each distinct weight stored once (streamed)."""
        from .merge import merge_packages

        return merge_packages(sources, function_names, default_function, out, options, tx)

    def inventory(self, path: Path, hash_payloads: bool) -> ModelInventory:
        from .inventory import inventory_file

        return inventory_file(path, hash_payloads)

    def measure_copies(
        self, path: Path, feeds: MeasureInputs | None = None
    ) -> tuple[dict[str, int], dict[str, int], list[str]]:
        """Nothing measured: no Core ML runtime runs on Linux (or anywhere but Apple's systems), so ``check``'s
        figure for ``coreml`` stays the static one, and says so."""
        return {}, {}, [NOT_MEASURED]

    def verify(self, report: VerifyReport, original: Path, converted: Path, opts: dict[str, Any], broken: bool) -> None:
        from .verify import verify_programs

        verify_programs(report, original, converted)

    def bench_runtime(self, path: Path) -> BenchRuntime:
        raise Unsupported("Core ML models cannot be loaded on this platform; use `inspect` for their structure", path)


FORMAT = CoremlFormat()
