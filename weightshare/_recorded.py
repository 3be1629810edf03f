"""Digests weightshare recorded in a blob it wrote, checked again when that blob is read as an input.

Re-converting a weightshare output must not launder a blob modified after it was written: the new blob
would get fresh digests and ``check`` would pass. When an input payload sits exactly where a recorded
payload sits, its bytes are hashed while they stream and compared at the end of the stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from ._checksum import file_range_digest, new_hasher, split_digest, tagged
from ._safetensors import METADATA_KEY, read_header_at, read_safetensors_metadata
from ._tensors import CHUNK_SIZE, FileRange, PayloadSource
from .errors import InvalidModel, WeightshareError


def recorded_records(path: str) -> list[tuple[str, int, int, str]]:
    """(name, absolute offset, length, tagged digest (``_checksum.tagged``: SHA-256 bare, "blake3:<hex>")) of every
    payload a weightshare blob records; [] for any other file (not safetensors, no weightshare metadata, or a
    header too odd to trust for a lookup)."""
    return [(key, offset, length, digest) for key, offset, length, digest, _aliases in _records(path)]


def recorded_names(path: str) -> dict[tuple[int, int], list[str]]:
    """(absolute offset, length) -> every name a weightshare blob records for the payload there (its own, then its
    aliases: the names of the models and tensors that share it); {} for any other file."""
    return {(offset, length): [key, *aliases] for key, offset, length, _digest, aliases in _records(path)}


def _records(path: str) -> list[tuple[str, int, int, str, list[str]]]:
    try:
        data_start, header, meta = read_safetensors_metadata(path)
    except (WeightshareError, OSError, ValueError, RecursionError):
        return []
    out: list[tuple[str, int, int, str, list[str]]] = []
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
        aliases = entry.get("aliases") if isinstance(entry, dict) else None
        names = [a for a in aliases if isinstance(a, str)] if isinstance(aliases, list) else []
        out.append((key, data_start + offsets[0], offsets[1] - offsets[0], tagged(kind, digest.lower()), names))
    return out


# ``_pipeline.blob_target``: NAME.<digest12>.safetensors, the digest being the first 12 hex digits of the SHA-256
# of the header text as written (without its length prefix and the spaces that pad it to the data section).
_DIGEST_NAME = re.compile(r"\.([0-9a-f]{12})\.safetensors$")


def blob_name_problem(path: str) -> str | None:
    """Why the weightshare blob at ``path`` does not carry the name its header gives it, or None.

    The digest in the name covers every payload's digest, dtype, shape and offset: a payload overwritten with
    its checksum re-recorded, or another conversion's blob renamed to this name, changes the header, so the
    name no longer matches. Files not named ``*.<digest12>.safetensors`` or not written by weightshare: None."""
    named = _DIGEST_NAME.search(os.path.basename(path))
    if named is None:
        return None
    try:
        text = read_header_at(path)[1].rstrip(b" ")
    except (OSError, InvalidModel):
        return None  # not a safetensors file: the payload checks report what is wrong with it
    if b'"format":"weightshare"' not in text:
        return None
    actual = hashlib.sha256(text).hexdigest()[:12]
    if actual != named.group(1):
        return (
            f"its name says header digest {named.group(1)} but its header hashes to {actual}: the blob was "
            "modified after it was written, or another blob was renamed to this name"
        )
    return None


def blob_metadata(path: str) -> dict[str, str]:
    """The string entries of a safetensors file's ``__metadata__`` (the payload table excluded); {} for any
    other file."""
    try:
        meta = json.loads(read_header_at(path)[1]).get("__metadata__")
    except (OSError, InvalidModel, ValueError, AttributeError, RecursionError):
        return {}
    if not isinstance(meta, dict):
        return {}
    return {k: v for k, v in meta.items() if isinstance(k, str) and isinstance(v, str) and k != METADATA_KEY}


def record_problem(path: str, offset: int, length: int, digest: str, file_size: int) -> str | None:
    """Why the ``length`` bytes at ``offset`` of the blob at ``path`` do not match ``digest`` (a tagged digest from
    ``recorded_records``), or None when they do."""
    if offset + length > file_size:
        return "runs past the end of the file"
    chunks = FileRange(path, offset, length).chunks
    if file_range_digest(path, offset, length, split_digest(digest)[0], lambda: chunks(CHUNK_SIZE)) != digest:
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
