"""ExecuTorch (``.pte`` programs, ``.ptd`` data files): segments re-laid page-aligned in the file the runtime maps.

Modules: ``flatbuf`` (bounds-checked pread reader of both files), ``convert`` (segments re-laid, fixed-width
fields patched in the copied flatbuffer), ``inventory`` (where each payload lives, what a loaded program copies),
``verify`` (both programs run by ``executorch.runtime``, outputs compared byte for byte), ``measure`` (PSS of
loaded programs, for ``bench``).
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._outputs_record import DATA_SUFFIXES, NEEDED
from ...errors import InvalidModel
from ..base import BenchRuntime, BlobContainer, FormatDefaults, FormatOptions
from .findings import CODES

if TYPE_CHECKING:
    from ..._atomic import OutputTransaction
    from ..._inventory import ModelInventory
    from ..._verify import VerifyReport
    from ...options import ConvertOptions
    from ...report import ConversionReport
    from .loader import SharedProgram


def _read_by_a_program(path: Path) -> bool:
    """A dropped ``.ptd`` a program beside it still reads is kept (``inventory.read_by_a_program``)."""
    if path.suffix != ".ptd":
        return False
    from .inventory import read_by_a_program

    return read_by_a_program(path)


DATA_SUFFIXES.add(".ptd")
NEEDED.append(_read_by_a_program)


class ExecutorchFormat(FormatDefaults):
    name = "executorch"
    title = "ExecuTorch"
    suffixes = (".pte", ".ptd")
    # MmapDataLoader maps the flatbuffer and every segment MAP_SHARED, at any offset (the pages around it).
    maps_in_place = frozenset({"embedded", "external"})
    maps_unaligned = True
    findings = CODES
    settings = ("executorch-weightshare", "executorch-mmap", "executorch-bytes")  # inventory.SETTINGS
    options = FormatOptions()
    shared_blob_refused = (  # zoo mode
        "ExecuTorch programs keep their weights in their own segments or .ptd; convert them one by one "
        "(several programs share one .ptd by loading it as data_path)"
    )

    @property
    def blob_container(self) -> BlobContainer | None:
        return None  # the weights stay in the program's (or data file's) own segments

    def claims(self, path: Path, head: bytes) -> bool:
        from .flatbuf import kind_of

        if kind_of(head):
            return True
        if path.suffix in self.suffixes and not path.is_dir():
            what = "program (no ET12 identifier)" if path.suffix == ".pte" else "data file (no FT01 identifier)"
            raise InvalidModel(f"not an ExecuTorch {what}", path)
        return False

    def convert(self, src: Path, out_dir: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
        from .convert import convert_file

        return convert_file(src, out_dir, options, tx)

    def inventory(self, path: Path, hash_payloads: bool) -> ModelInventory:
        from .inventory import inventory_file

        return inventory_file(path, hash_payloads)

    def verify(self, report: VerifyReport, original: Path, converted: Path, opts: dict[str, Any], broken: bool) -> None:
        from .verify import verify_in_runtime

        verify_in_runtime(report, original, converted, opts, broken)

    def bench_runtime(self, path: Path) -> BenchRuntime:
        from .measure import measure_programs

        return BenchRuntime(
            measure_programs, (("executorch.runtime", False), ("weightshare loader (XNNPACK weights cache)", True))
        )


FORMAT = ExecutorchFormat()


def program(path: str | PathLike[str], data_path: str | PathLike[str] | None = None) -> SharedProgram:
    """Load an ExecuTorch program so that its weights are shared: ``loader.program`` (mapped weights; XNNPACK's
    packed weights once per process, keys bound to content).

    Example:
        >>> out = program("model.pte").load_method("forward").execute([x])
    """
    from .loader import program as load

    return load(path, data_path)
