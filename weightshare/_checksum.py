"""Payload checksums: BLAKE3 by default (SHA-256 without the package), as tagged digest strings.

A digest travels as ``tagged(kind, hex)``: SHA-256 bare (as recorded before BLAKE3), any other kind prefixed
("blake3:<hex>"), so that two digests compare equal only when kind and value agree.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

from .errors import Unsupported

__all__ = ["DIGEST", "Hasher", "digest_of", "digests_kept", "file_range_digest", "new_hasher", "split_digest", "tagged"]

try:  # BLAKE3: 0.12 CPU s per GiB on the 2-core dev machine against SHA-256's 0.53 (with SHA-NI), measured once
    import blake3 as _blake3
except ImportError:  # the package is a dependency; without it, blobs are written (and read) with SHA-256
    _blake3 = None  # type: ignore[assignment]

DIGEST = "blake3" if _blake3 is not None else "sha256"


class Hasher(Protocol):
    """What hashlib's and blake3's hash objects have in common."""

    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...

    def digest(self) -> bytes: ...


def new_hasher(kind: str | None = None) -> Hasher:
    """A hashlib-style object (update, hexdigest) for ``kind``: "blake3" or "sha256" (default: ``DIGEST``)."""
    kind = kind or DIGEST
    if kind == "sha256":
        return hashlib.sha256()
    if kind == "blake3" and _blake3 is not None:
        return _blake3.blake3()
    raise Unsupported(f"checksums of kind {kind!r} need the {kind} package (pip install {kind})")


def tagged(kind: str, hexdigest: str) -> str:
    """A digest as weightshare passes it around: SHA-256 bare (as recorded before BLAKE3), others
    prefixed with their kind ("blake3:<hex>"), so that two digests compare equal only when both the kind
    and the value agree."""
    return hexdigest if kind == "sha256" else f"{kind}:{hexdigest}"


def split_digest(digest: str) -> tuple[str, str]:
    """(kind, hex) of a ``tagged`` digest."""
    kind, sep, value = digest.partition(":")
    return (kind, value) if sep else ("sha256", digest)


def digest_of(chunks: Iterable[bytes | memoryview], kind: str | None = None) -> str:
    """The ``tagged`` digest of an iterable of chunks (default kind: ``DIGEST``)."""
    kind = kind or DIGEST
    h = new_hasher(kind)
    for chunk in chunks:
        h.update(chunk)
    return tagged(kind, h.hexdigest())


# Within ``digests_kept``: (file identity, offset, length, kind) -> digest. A --prepack output's packed model and its
# portable twin read one blob: each checked its payloads' and records' digests, every byte of it hashed twice.
_KEPT: ContextVar[dict[tuple[object, ...], str] | None] = ContextVar("weightshare_digests", default=None)


@contextmanager
def digests_kept() -> Iterator[None]:
    """Within: a byte range of a file hashed once (``file_range_digest``), while the file is unchanged."""
    token = _KEPT.set({})
    try:
        yield
    finally:
        _KEPT.reset(token)


def file_range_digest(
    path: str,
    offset: int,
    length: int,
    kind: str,
    chunks: Callable[[], Iterable[bytes | memoryview]],
    fd: int | None = None,
) -> str:
    """``digest_of(chunks(), kind)``, the digest of ``length`` bytes at ``offset`` of ``path`` (read through ``fd``
    when given); within ``digests_kept``, the one computed earlier for the same range of the same file, unchanged
    since (its device, inode, size, modification and change times, the same before and after the read)."""
    kept = _KEPT.get()
    if kept is None:
        return digest_of(chunks(), kind)

    def identity() -> tuple[int, ...]:
        st = os.fstat(fd) if fd is not None else os.stat(path)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    key = (*identity(), offset, length, kind)
    if key in kept:
        return kept[key]
    digest = digest_of(chunks(), kind)
    if identity() == key[:5]:  # not kept when the file changed while it was read
        kept[key] = digest
    return digest
