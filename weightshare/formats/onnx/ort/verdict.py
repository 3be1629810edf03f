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
import hmac
import json
import logging
import os
from pathlib import Path

from ...._private_cache import cache_path, open_private_dir, read_small, seal_key, write_atomic
from ...._safetensors import read_header
from ....errors import InvalidModel

log = logging.getLogger("weightshare.ort")

_FORMAT = "weightshare-ort-verdict/1"
_MAX_ENTRY = 4096
MAX_ENTRIES = 128
MAX_AGE_S = 30 * 86400
_TMP_AGE_S = 3600
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
    with open_private_dir(cache_dir(), create=False) as dir_fd:
        if dir_fd is None:
            return False
        key = seal_key(dir_fd, create=False)
        data = read_small(name, dir_fd, _MAX_ENTRY)
    if key is None or data is None:
        return False
    body_read, _, mac = data.rpartition(b"\n")
    expected = hmac.new(key, body, hashlib.sha256).hexdigest().encode()
    return body_read == body and hmac.compare_digest(mac, expected)


def remember_intact(identity: Identity, header_sha256: str) -> None:
    """Record that this blob passed (best effort: a cache that cannot be written is only slower)."""
    name, body = _entry(identity, header_sha256)
    with open_private_dir(cache_dir(), create=True) as dir_fd:
        key = None if dir_fd is None else seal_key(dir_fd, create=True)
        if dir_fd is None or key is None:
            log.debug("weightshare: the verdict cache %s is not usable; not remembering the check", cache_dir())
            return
        write_atomic(name, body + b"\n" + hmac.new(key, body, hashlib.sha256).hexdigest().encode(), dir_fd)
        prune(dir_fd, keep=name)


def prune(dir_fd: int, keep: str = "", now: float | None = None) -> None:
    """Bound the cache (``MAX_ENTRIES``, ``MAX_AGE_S``); best effort, concurrent writers may prune the same."""
    import time

    now = time.time() if now is None else now
    entries: list[tuple[float, str]] = []
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return
    for n in names:
        is_entry = len(n) == 40 and all(c in "0123456789abcdef" for c in n)
        if not is_entry and not n.startswith(".tmp-"):
            continue  # the key, or nothing of ours
        try:
            st = os.stat(n, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if not is_entry:
            if now - st.st_mtime > _TMP_AGE_S:
                _unlink(n, dir_fd)
        elif n != keep and now - st.st_mtime > MAX_AGE_S:
            _unlink(n, dir_fd)
        else:
            entries.append((st.st_mtime if n != keep else now, n))
    entries.sort(reverse=True)
    for _mtime, n in entries[MAX_ENTRIES:]:
        _unlink(n, dir_fd)


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def header_sha256(fd: int) -> str | None:
    """SHA-256 of the safetensors header (length prefix included) of the file open on ``fd``, None if unreadable."""
    try:
        head, text = read_header(fd)
    except InvalidModel:
        return None
    return hashlib.sha256(head + text).hexdigest()
