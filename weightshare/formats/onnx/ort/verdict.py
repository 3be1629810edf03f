"""A per-user record of ``--prepack`` blobs whose packed payloads passed their recorded digests.

Hashing every packed payload costs ~1 CPU s per GiB in every process that opens the model; the verdict
depends only on the blob's bytes, so it is remembered, keyed by what changes when those bytes can have
changed: (device, inode, size, mtime_ns, ctime_ns) of the descriptor that was checked and the SHA-256 of
the blob's header (which holds every payload's recorded digest and offset). A writer can set mtime back
(``os.utime``) but not ctime, so a blob modified in place after its verdict is verified again.

The cache is untrusted input too. It lives in ``$XDG_CACHE_HOME/weightshare/ort-verified`` (default
``~/.cache``), a directory that must be ours and closed to others (0700, owned by this euid, not a symlink);
entries are opened through that directory's descriptor without following symlinks, must be regular files
of ours with mode 0600 and a few hundred bytes, and carry an HMAC-SHA256 under a per-user random key kept
beside them (0600): an entry edited by hand, copied from another account or machine, or truncated is
ignored and the blob verified again. Only "intact" verdicts are stored; a mismatch is found again (and
said again) every time. Entries are written to a private temporary name and renamed into place.
Nothing here can make a blob pass that fails: at worst the cache is missed and the digests are hashed.

The cache is bounded: each write drops entries older than ``MAX_AGE_S`` (30 days) and, beyond ``MAX_ENTRIES``
(128, about 40 KiB), the least recently written ones; a temporary of a killed writer goes after an hour. Every
re-conversion makes a new blob (a new inode), so without this the entries of blobs long gone would pile up.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from ...._private_cache import Bound, cache_path, read_sealed, write_sealed
from ...._safetensors import read_header
from ....errors import InvalidModel

log = logging.getLogger("weightshare.ort")

# the rule's version: /2 hashes a --shared-blob zoo's packed payloads too (/1 hashed none of them), so a verdict
# written under /1 vouches for nothing a zoo holds and is not read
_FORMAT = "weightshare-ort-verdict/2"
_MAX_ENTRY = 4096
MAX_ENTRIES = 128
MAX_AGE_S = 30 * 86400
_BOUND = Bound(name_len=40, max_entries=MAX_ENTRIES, max_age_s=MAX_AGE_S)
Identity = tuple[int, int, int, int, int]


def cache_dir() -> Path | None:
    """Where the verdicts live, or None when there is no usable base directory."""
    return cache_path("ort-verified")


def _entry(identity: Identity, header_sha256: str) -> tuple[str, bytes]:
    body = json.dumps({"format": _FORMAT, "identity": list(identity), "header_sha256": header_sha256}).encode()
    return hashlib.sha256(body).hexdigest()[:40], body


def is_intact(identity: Identity, header_sha256: str) -> bool:
    """True when an authentic entry says the blob with this identity and header was verified intact."""
    name, body = _entry(identity, header_sha256)
    return read_sealed(cache_dir(), name, _MAX_ENTRY) == body


def remember_intact(identity: Identity, header_sha256: str) -> None:
    """Record that this blob passed (best effort: a cache that cannot be written is only slower)."""
    name, body = _entry(identity, header_sha256)
    if not write_sealed(cache_dir(), name, body, _BOUND):
        log.debug("weightshare: the verdict cache %s is not usable; not remembering the check", cache_dir())


def header_sha256(fd: int) -> str | None:
    """SHA-256 of the safetensors header (length prefix included) of the file open on ``fd``, None if unreadable."""
    try:
        head, text = read_header(fd)
    except InvalidModel:
        return None
    return hashlib.sha256(head + text).hexdigest()
