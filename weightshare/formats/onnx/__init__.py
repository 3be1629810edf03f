"""ONNX: a protobuf wire-level scanner, Cast folding, and the rewrite to external data."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..base import BenchRuntime, BlobContainer, FormatDefaults, FormatOptions
from .findings import CODES
from .unpack import ORT_CPU, UNPACK

if TYPE_CHECKING:
    from ..._atomic import OutputTransaction
    from ..._findings import Finding
    from ..._inventory import MeasureInputs, ModelInventory
    from ..._pipeline import PreparedModel
    from ..._verify import VerifyReport
    from ...options import ConvertOptions
    from ...report import ConversionReport


class OnnxFormat(FormatDefaults):
    name = "onnx"
    title = "ONNX"
    suffixes = (".onnx",)
    maps_in_place = frozenset({"external"})
    findings = CODES
    settings = ("ort-default", "ort-disable-prepacking")  # inventory.ORT_DEFAULT, ORT_SHARE
    maps_unaligned = True  # ONNX Runtime maps external data at any offset (measured, see _check.py)
    # --unpack ort-cpu adopts the Casts --keep-packed keeps; the onnxruntime child's limits (ort/limits.py)
    options = FormatOptions(
        unpack=UNPACK,
        unpack_excludes_keep_packed=frozenset({ORT_CPU}),
        fields=("ort_child_timeout_s", "ort_child_memory_mib", "ort_max_growth"),
    )

    @property
    def blob_container(self) -> BlobContainer:
        from ..._safetensors import CONTAINER

        return CONTAINER

    def claims(self, path: Path, head: bytes) -> bool:
        # A ModelProto starts with ir_version (field 1, varint: tag byte 0x08).
        return bool(head) and (path.suffix == ".onnx" or head[0] == 0x08)

    def convert(self, src: Path, out_dir: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
        if options.prepack:  # ONNX Runtime's packed weights too: ort/prepack.py
            from .ort.prepack import convert_prepacked

            return convert_prepacked(src, out_dir, options, tx)
        from .convert import convert_file
        from .ort import cpu_unpack_step

        return convert_file(src, out_dir, options, tx, cpu_unpack_step(options))

    def outputs(self, src: Path, out_dir: Path, options: ConvertOptions) -> list[Path]:
        """The model files a conversion of ``src`` writes (the blob aside): with --prepack, the portable one too."""
        if not options.prepack:
            return [out_dir / src.name]
        from .ort.prepack import portable_name

        return [out_dir / src.name, out_dir / portable_name(src.name)]

    def prepare(self, src: Path, out_dir: Path, options: ConvertOptions) -> PreparedModel:
        from .convert import prepare
        from .ort import cpu_unpack_step

        return prepare(src, out_dir, options, cpu_unpack_step(options))

    def prepare_shared(self, src: Path, out_dir: Path, options: ConvertOptions, stages: ExitStack) -> PreparedModel:
        """Zoo mode: ``prepare``, or with --prepack the packed payloads read from a staging directory that
        ``stages`` removes once the zoo is written."""
        if not options.prepack:
            return self.prepare(src, out_dir, options)
        from .ort.prepack import prepare_prepacked, run_cache, staging
        from .ort.prepack_zoo import prepare_staged
        from .ort.server import run_child

        staged = prepare_staged(src, out_dir, options, stages)  # staged with the zoo's others (``plan_shared``)
        if staged is not None:
            return staged
        # the zoo's packings are reused across its models, and one onnxruntime child serves them (``stages`` spans
        # the run: the child ends with it)
        held = stages.enter_context(staging(out_dir))
        return prepare_prepacked(src, out_dir, options, held, run_cache(stages), run_child(stages))

    def plan_shared(self, sources: list[Path], out_dir: Path, options: ConvertOptions, stages: ExitStack) -> None:
        """Zoo mode with --prepack: every model staged into one blob, which becomes the zoo's in place."""
        if options.prepack and sources:
            from .ort.prepack_zoo import stage_zoo

            stage_zoo(sources, out_dir, options, stages)

    def join_shared(self, prepared: list[PreparedModel], options: ConvertOptions) -> None:
        """Zoo mode with --prepack: one blob record naming every model's portable twin."""
        if options.prepack and prepared:
            from .ort.prepack import share_metadata

            share_metadata(prepared)

    def report_disk(self, report: ConversionReport, peak: int) -> None:
        """Zoo mode with --prepack: the zoo-wide temporary disk peak in each model's report."""
        from .ort.prepack import report_disk

        report_disk(report, peak)

    decodes = True  # verify --decode-steps: present* outputs fed back as past* inputs

    @property
    def input_readers(self) -> dict[str, Callable[[Path], Any]]:
        """``verify --input NAME=FILE``: files this format reads besides .npy, by suffix."""
        from ._proto import read_tensor_proto

        return {".pb": read_tensor_proto}

    def inventory(self, path: Path, hash_payloads: bool) -> ModelInventory:
        from .inventory import inventory_file
        from .remainder import remember

        inv = inventory_file(path, hash_payloads)
        try:  # what check's measuring child is given instead of parsing the model again (``remainder.sources``)
            remember(path, inv)
        except OSError:
            pass
        return inv

    def measure_copies(
        self, path: Path, feeds: MeasureInputs | None = None
    ) -> tuple[dict[str, int], dict[str, int], list[str], dict[str, int], list[Finding]]:
        """Bytes of weight copies one more ORT session costs per setting, its activation memory, and a finding when
        onnxruntime refuses the model, measured in child processes (``measure.py``)."""
        from .measure import measure_copies

        return measure_copies(path, feeds)

    def measure_settings(
        self, path: Path, settings: list[str], feeds: MeasureInputs | None = None
    ) -> tuple[dict[str, int], dict[str, int], list[str], dict[str, int], list[Finding]]:
        """``measure_copies`` of ``settings`` only, their activation memory not measured (``measure.py``)."""
        from .measure import measure_copies

        return measure_copies(path, feeds, settings)

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

    def bench_runtime(self, path: Path) -> BenchRuntime:
        from ..._runtimes.ort import measure_sessions

        # --prepack output at default options, in a process started with the malloc setting that returns ORT's
        # freed pre-pack validation buffers to the OS (weightshare.ort.session does the same with malloc_trim).
        return BenchRuntime(
            measure_sessions,
            (("prepack off", True), ("default", False)),
            prepacked=("default", False),
            prepacked_env={"MALLOC_MMAP_THRESHOLD_": "1048576"},
        )


FORMAT = OnnxFormat()
