"""MediaPipe ``.task`` bundles: zips of STORED .tflite members and MediaPipe metadata, read in place.

Modules: ``bundle`` (bounds-checked zip reader, aligned writer), ``inventory`` (each member's payloads through
offsets into the bundle, what MediaPipe's Tasks API copies per task), ``convert`` (a rebuilt bundle, written only
where it saves). The members' own scan is the TFLite format's (``formats/tflite/inventory.py``, windowed).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import Unsupported
from ..base import BenchRuntime, FormatDefaults, FormatOptions
from .findings import CODES

if TYPE_CHECKING:
    from ..._atomic import OutputTransaction
    from ..._inventory import ModelInventory
    from ..._verify import VerifyReport
    from ...options import ConvertOptions
    from ...report import ConversionReport


class MediapipeFormat(FormatDefaults):
    name = "mediapipe"
    title = "MediaPipe task"
    suffixes = (".task",)
    blob_container = None  # the members stay in the bundle
    maps_in_place = frozenset({"embedded"})  # MediaPipe reads each member where it is stored
    maps_unaligned = False
    findings = CODES
    settings = ("mediapipe-tasks",)  # inventory.TASKS
    options = FormatOptions()
    shared_blob_refused = "a MediaPipe bundle keeps its members inside it; it cannot reference a shared blob"

    def claims(self, path: Path, head: bytes) -> bool:
        # by name: a zip's local header may follow a prefix (face_landmarker.task starts with 2 zero bytes); the
        # reader then checks the zip itself
        return path.suffix == ".task" and not path.is_dir()

    def convert(self, src: Path, out_dir: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
        from .convert import convert_bundle

        return convert_bundle(src, out_dir, options, tx)

    def kept_as_is(self, src: Path, options: ConvertOptions) -> str:
        """Why a folder run copies this bundle as it is ("" when it converts it)."""
        from .convert import kept_reason

        return kept_reason(src)

    def inventory(self, path: Path, hash_payloads: bool) -> ModelInventory:
        from .inventory import inventory_bundle

        return inventory_bundle(path, hash_payloads)

    def verify(self, report: VerifyReport, original: Path, converted: Path, opts: dict[str, Any], broken: bool) -> None:
        """A rebuilt bundle keeps every member's bytes: compared byte for byte, member by member (MediaPipe reads
        members in place, so equal bytes compute equal results; scripts/bench_task.py runs both in MediaPipe)."""
        from .convert import compare_bundles

        compare_bundles(report, original, converted)

    def bench_runtime(self, path: Path) -> BenchRuntime:
        raise Unsupported("bench does not drive MediaPipe; scripts/bench_task.py measures bundles in it", path)


FORMAT = MediapipeFormat()
