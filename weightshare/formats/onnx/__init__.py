"""ONNX: a protobuf wire-level scanner, Cast folding, and the rewrite to external data."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..base import BenchRuntime, BlobContainer, FormatOptions
from .findings import CODES

if TYPE_CHECKING:
    from ..._atomic import OutputTransaction
    from ..._inventory import MeasureInputs, ModelInventory
    from ..._pipeline import PreparedModel
    from ..._verify import VerifyReport
    from ...options import ConvertOptions
    from ...report import ConversionReport


ORT_CPU = "ort-cpu"  # the --unpack value of ortcpu.py
# The --unpack values ONNX implements, with their help text (``weightshare convert --help`` shows it).
UNPACK = {
    ORT_CPU: "ONNX: store fp16 weights as the fp32 copies ONNX Runtime's CPU provider makes per session; "
    "CPU-specific, a GPU provider would run fp16",
}


class OnnxFormat:
    name = "onnx"
    suffixes = (".onnx",)
    maps_in_place = frozenset({"external"})
    findings = CODES
    settings = ("ort-default", "ort-disable-prepacking")  # inventory.ORT_DEFAULT, ORT_SHARE
    maps_unaligned = True  # ONNX Runtime maps external data at any offset (measured, see _check.py)
    # --unpack ort-cpu adopts the Casts --keep-packed keeps; the onnxruntime child's limits (ort_limits.py)
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
        from .convert import convert_file

        return convert_file(src, out_dir, options, tx)

    def outputs(self, src: Path, out_dir: Path, options: ConvertOptions) -> list[Path]:
        """The model files a conversion of ``src`` writes (the blob aside): with --prepack, the portable one too."""
        if not options.prepack:
            return [out_dir / src.name]
        from .prepack import portable_name

        return [out_dir / src.name, out_dir / portable_name(src.name)]

    def prepare(self, src: Path, out_dir: Path, options: ConvertOptions) -> PreparedModel:
        from .convert import prepare

        return prepare(src, out_dir, options)

    def prepare_shared(self, src: Path, out_dir: Path, options: ConvertOptions, stages: ExitStack) -> PreparedModel:
        """Zoo mode: ``prepare``, or with --prepack the packed payloads read from a staging directory that
        ``stages`` removes once the zoo is written."""
        if not options.prepack:
            return self.prepare(src, out_dir, options)
        from .prepack import prepare_prepacked, staging

        return prepare_prepacked(src, out_dir, options, stages.enter_context(staging(out_dir)))

    def join_shared(self, prepared: list[PreparedModel], options: ConvertOptions) -> None:
        """Zoo mode with --prepack: one blob record naming every model's portable twin."""
        if options.prepack and prepared:
            from .prepack import share_metadata

            share_metadata(prepared)

    def report_disk(self, report: ConversionReport, peak: int) -> None:
        """Zoo mode with --prepack: the zoo-wide temporary disk peak in each model's report."""
        from .prepack import report_disk

        report_disk(report, peak)

    decodes = True  # verify --decode-steps: present* outputs fed back as past* inputs

    @property
    def input_readers(self) -> dict[str, Callable[[Path], Any]]:
        """``verify --input NAME=FILE``: files this format reads besides .npy, by suffix."""
        return {".pb": _read_tensor_proto}

    def inventory(self, path: Path, hash_payloads: bool) -> ModelInventory:
        from .inventory import inventory_file

        return inventory_file(path, hash_payloads)

    def measure_copies(
        self, path: Path, feeds: MeasureInputs | None = None
    ) -> tuple[dict[str, int], dict[str, int], list[str], dict[str, int]]:
        """Bytes of weight copies one more ORT session costs per setting, and its activation memory, measured in
        child processes (``measure.py``)."""
        from .measure import measure_copies

        return measure_copies(path, feeds)

    def verify(self, report: VerifyReport, original: Path, converted: Path, opts: dict[str, Any], broken: bool) -> None:
        from .verify import verify_in_runtime

        verify_in_runtime(report, original, converted, opts, broken)

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


def _read_tensor_proto(path: Path) -> Any:
    """A serialized ONNX TensorProto as a numpy array."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.TensorProto()
    proto.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(proto)


FORMAT = OnnxFormat()
