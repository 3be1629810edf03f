"""Digests weightshare recorded in a blob it wrote, checked again when that blob is read as an input.

Re-converting a weightshare output must not launder a blob modified after it was written: the new blob
would get fresh digests and ``check`` would pass. When an input payload sits exactly where a recorded
payload sits, its bytes are hashed while they stream and compared at the end of the stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from .blob import digest_of, new_hasher, read_safetensors_metadata, split_digest, tagged
from .errors import InvalidModel, WeightshareError
from .tensors import CHUNK_SIZE, FileRange, PayloadSource


def recorded_records(path: str) -> list[tuple[str, int, int, str]]:
    """(name, absolute offset, length, tagged digest (``blob.tagged``: SHA-256 bare, "blake3:<hex>")) of every
    payload a weightshare blob records; [] for any other file (not safetensors, no weightshare metadata, or a
    header too odd to trust for a lookup)."""
    try:
        data_start, header, meta = read_safetensors_metadata(path)
    except (WeightshareError, OSError, ValueError, RecursionError):
        return []
    out: list[tuple[str, int, int, str]] = []
    if not isinstance(meta, dict):
        return out
    for key, entry in meta.items():
        t = header.get(key) if isinstance(key, str) else None
        kind = next((k for k in ("blake3", "sha256") if isinstance(entry, dict) and k in entry), "sha256")
        digest = entry.get(kind) if isinstance(entry, dict) else None
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (
            isinstance(digest, str)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int and o >= 0 for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            continue
        out.append((key, data_start + offsets[0], offsets[1] - offsets[0], tagged(kind, digest.lower())))
    return out


def record_problem(path: str, offset: int, length: int, digest: str, file_size: int) -> str | None:
    """Why the ``length`` bytes at ``offset`` of the blob at ``path`` do not match ``digest`` (a tagged digest from
    ``recorded_records``), or None when they do."""
    if offset + length > file_size:
        return "runs past the end of the file"
    if digest_of(FileRange(path, offset, length).chunks(CHUNK_SIZE), split_digest(digest)[0]) != digest:
        return "its checksum differs from the one recorded in the blob"
    return None


def recorded_payloads(path: str) -> dict[tuple[int, int], str]:
    """(absolute offset, length) -> tagged digest of every payload a weightshare blob records."""
    return {(offset, length): digest for _name, offset, length, digest in recorded_records(path)}


@dataclass
class CheckedSource:
    """``inner``'s bytes, unchanged; raises InvalidModel naming ``tensor`` if they do not hash to ``digest`` (a
    tagged digest: the kind the blob recorded)."""

    inner: PayloadSource
    digest: str
    tensor: str
    path: str  # the blob, for the message
    _seen: int = field(default=0, repr=False)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def chunks(self, chunk_size: int = CHUNK_SIZE) -> Iterator[memoryview]:
        kind, expected = split_digest(self.digest)
        hasher = new_hasher(kind)
        for chunk in self.inner.chunks(chunk_size):
            hasher.update(chunk)
            yield chunk
        if hasher.hexdigest() != expected:
            raise InvalidModel(
                f"tensor {self.tensor!r}: its bytes no longer match the {kind} digest weightshare "
                "recorded when it wrote this blob (modified since?); refusing to re-convert it",
                self.path,
            )
