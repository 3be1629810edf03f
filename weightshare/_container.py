"""The container of a blob that models reference by name (``BlobContainer``) and the file a writer makes of it
(``BlobFile``): part of the format protocol's ground floor, defined here so that the format protocol
(``formats.base``, which re-exports them) and the safetensors container import nothing heavier than this."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ._placement import AlignPolicy, BlobEntry, PlannedTensor, Progress
    from ._write import BlobPayload


class BlobFile(Protocol):
    """A blob file being written: a ``_write.Container`` that also ends the file and names its content."""

    def place(self, payload: BlobPayload, progress: Progress | None = None) -> BlobEntry:
        """Write one payload; return where it landed."""
        ...

    def expect_duplicates(self) -> None:
        """What is placed from here on may repeat what is placed (a zoo's next model): recognised before written."""
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
