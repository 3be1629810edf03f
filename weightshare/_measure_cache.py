"""``check``'s measured verdicts, reused while what they depend on is unchanged.

Measuring a model starts runtime children that open a dozen sessions (seconds to minutes per model, the bulk of
`check`'s time), and the figure depends only on: the bytes the runtime reads (the model file, every data file it
maps, the side files the measuring run reads: configs, an encoder beside a decoder, an XNNPACK cache), the
runtime's version and the CPU kind it dispatches on, how weightshare measures (its version and source, ``SCHEMA``,
the children's memory bound) and what `check` was told (``--target``, ``--threshold``: the repeats near a line;
``--dim``, ``--input`` and those files' bytes). An entry is keyed by a digest of all of that, so any change is a
miss and the model is measured again.

The content digest is the cheapest sound one: `check` hashes every payload already (to find duplicates and
compare them with the digests a weightshare blob records), so a data file contributes its size and each payload's
(offset, length, digest) as hashed in this run, plus each blob record's recorded digest once `check` re-hashed
it without a problem (a packed copy ORT maps); a data file with a payload not hashed is hashed whole. The model
file (a converted model's graph: small) and the side files are hashed whole with BLAKE3 (0.12 CPU s per GiB).
A model with a payload problem or a failed record is never looked up nor stored.

The cache is untrusted input: ``$XDG_CACHE_HOME/weightshare/measured`` (default ``~/.cache``), a directory that
must be ours and private (0700, not a symlink); entries are regular 0600 files of ours of at most ``MAX_ENTRY``
bytes, sealed with an HMAC-SHA256 under a per-user random key kept beside them, and their fields are type-checked
before use. An entry that was edited, truncated or copied from elsewhere is ignored (measured again and
overwritten), never trusted and never a crash. At most ``MAX_ENTRIES`` are kept (the least recently written go).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ._checksum import new_hasher
from ._findings import Finding, code_named
from ._inventory import MeasureInputs, ModelInventory
from ._private_cache import Bound, cache_path, read_sealed, write_sealed
from ._recorded import recorded_records
from ._version import __version__

__all__ = [
    "key_for",
    "remember",
    "reuse",
    "MeasuredEntry",
    "cache_dir",
    "content_digest",
    "entry_key",
    "file_digest",
    "load",
    "now_utc",
    "store",
]

SCHEMA = "weightshare-measured/1"  # bump when what a measurement means changes
MAX_ENTRY = 256 << 10
MAX_ENTRIES = 512
_BOUND = Bound(name_len=48, max_entries=MAX_ENTRIES)
_CHUNK = 4 << 20


@dataclass
class MeasuredEntry:
    """What one model's measurement left in its inventory (``measure_copies`` and ``_check.settle``)."""

    measured: dict[str, int]
    one_session: dict[str, int]
    notes: list[str]
    activation: dict[str, int]
    findings: list[tuple[str, str, str]] = field(default_factory=list)  # (code, tensor, message)
    measured_at: str = ""  # UTC, ISO 8601 to the second
    paid: dict[str, object] = field(default_factory=dict)  # ``ModelInventory.paid``


def cache_dir() -> Path | None:
    """Where the measured verdicts live, or None when there is no usable base directory."""
    return cache_path("measured")


def _hash_file(h: object, path: Path) -> bool:
    """Feed ``path``'s bytes to ``h``; False when it cannot be read."""
    try:
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(_CHUNK)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])  # type: ignore[attr-defined]
    except OSError:
        return False
    return True


def content_digest(inv: ModelInventory, path: Path, side_files: Sequence[Path] = ()) -> str | None:
    """The digest of every byte the measurement of ``inv``'s model can depend on (module docstring), or None when
    the model is not cacheable (a package directory, a payload or record problem, a file that cannot be read)."""
    if path.is_dir() or inv.record_problems or any(p.problem for p in inv.payloads):
        return None
    h = new_hasher()
    h.update(b"model\0")
    if not _hash_file(h, path):
        return None
    base = path.parent
    for name in sorted(set(inv.external_files)):
        f = base / name
        try:
            size = f.stat().st_size
        except OSError:
            return None
        h.update(f"\0data\0{name}\0{size}\0".encode())
        here = [p for p in inv.payloads if p.location == "external" and p.file == name]
        if any(not p.sha256 or p.offset is None for p in here):
            if not _hash_file(h, f):
                return None
            continue
        spans = sorted((p.offset or 0, p.nbytes, p.sha256) for p in here)
        spans += sorted((begin, length, digest) for _key, begin, length, digest in recorded_records(str(f)))
        h.update(json.dumps(spans).encode())
    for f in side_files:
        h.update(f"\0side\0{f.name}\0".encode())
        if f.is_file() and not _hash_file(h, f):
            return None
        h.update(b"present" if f.is_file() else b"absent")
    return h.hexdigest()


def file_digest(path: Path) -> str | None:
    """The digest of ``path``'s bytes (a ``--input`` file), None when it cannot be read."""
    h = new_hasher()
    return h.hexdigest() if _hash_file(h, path) else None


@functools.cache
def code_digest() -> str:
    """A digest of weightshare's own source: how it measures (sessions, settings, options, the repeats near a line)
    is its code, and a version string does not change with every edit of it (a development install)."""
    h = new_hasher()
    package = Path(__file__).resolve().parent
    for f in sorted(package.rglob("*.py")):
        h.update(f"{f.relative_to(package)}\0".encode())
        _hash_file(h, f)
    return h.hexdigest()


def entry_key(parts: dict[str, object]) -> str:
    """The entry's name: a digest of every part of the key (``SCHEMA``, weightshare's version and source included)."""
    body = json.dumps(
        {"schema": SCHEMA, "weightshare": __version__, "code": code_digest(), **parts}, sort_keys=True, default=str
    )
    return hashlib.sha256(body.encode()).hexdigest()[:48]


def _ints(value: object) -> dict[str, int] | None:
    if not isinstance(value, dict):
        return None
    ok = all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in value.items())
    return dict(value) if ok else None


def _paid(value: object) -> dict[str, object] | None:
    """``ModelInventory.paid`` as measured: role -> {"setting": str, "one_process": {count: int}, "two_processes":
    int}; None for anything else."""
    if not isinstance(value, dict):
        return None
    for role, figures in value.items():
        if not isinstance(role, str) or not isinstance(figures, dict) or not isinstance(figures.get("setting"), str):
            return None
        one = _ints(figures.get("one_process"))
        if not one or not all(k.isdigit() and 0 < int(k) < 1 << 20 for k in one):
            return None
        if type(figures.get("two_processes")) is not int or figures["two_processes"] < 0:
            return None
    return dict(value)


def _parse(key: str, body: bytes) -> MeasuredEntry | None:
    """The entry in ``body`` when every field has its type (the seal said who wrote it, not that it is sane)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("key") != key:
        return None
    measured, one, activation = _ints(doc.get("measured")), _ints(doc.get("one_session")), _ints(doc.get("activation"))
    notes, findings, at, paid = doc.get("notes"), doc.get("findings"), doc.get("measured_at"), _paid(doc.get("paid"))
    if measured is None or one is None or activation is None or not isinstance(at, str) or len(at) > 40:
        return None
    if paid is None:
        return None
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        return None
    if not isinstance(findings, list) or not all(
        isinstance(f, list) and len(f) == 3 and all(isinstance(x, str) for x in f) for f in findings
    ):
        return None
    return MeasuredEntry(measured, one, list(notes), activation, [(c, t, m) for c, t, m in findings], at, paid)


def load(key: str) -> MeasuredEntry | None:
    """The entry stored under ``key`` if it is authentic and well-formed, else None (a miss)."""
    body = read_sealed(cache_dir(), key, MAX_ENTRY)
    return None if body is None else _parse(key, body)


def store(key: str, entry: MeasuredEntry) -> bool:
    """Write ``entry`` under ``key`` (best effort: a cache that cannot be written is only slower)."""
    body = json.dumps(
        {
            "schema": SCHEMA,
            "key": key,
            "measured_at": entry.measured_at,
            "measured": entry.measured,
            "one_session": entry.one_session,
            "notes": entry.notes,
            "activation": entry.activation,
            "findings": [list(f) for f in entry.findings],
            "paid": entry.paid,
        },
        sort_keys=True,
    ).encode()
    if len(body) > MAX_ENTRY - 100:
        return False
    return write_sealed(cache_dir(), key, body, _BOUND)


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def key_for(
    inv: ModelInventory,
    path: Path,
    context: tuple[dict[str, str], list[Path]] | None,
    feeds: MeasureInputs,
    options: dict[str, object],
) -> str | None:
    """The key of ``inv``'s measured verdict, or None when it is not to be reused: ``context`` is the format's
    ``measurement_key`` (the runtime, the side files), ``feeds`` check's --dim/--input (the input files' bytes
    count, not their names), ``options`` what else the verdict depends on (the children's bound, --target,
    --threshold)."""
    if context is None:
        return None
    runtime, side_files = context
    content = content_digest(inv, path, side_files)
    if content is None:
        return None
    inputs = []
    for name, file in feeds.input_files:
        digest = file_digest(Path(file))
        if digest is None:
            return None
        inputs.append((name, digest))
    parts = {"format": inv.format, "content": content, "runtime": runtime, "dims": sorted(feeds.dims)}
    return entry_key({**parts, "inputs": sorted(inputs), **options})


def reuse(inv: ModelInventory, key: str, path: Path) -> bool:
    """Fill ``inv`` with the verdict stored under ``key`` and say so (``measure_notes``, ``measured_cached``);
    False when there is none to trust."""
    entry = load(key)
    if entry is None:
        return False
    try:
        found = [Finding.of(code_named(c), str(path), m, t) for c, t, m in entry.findings]
    except KeyError:  # a code this version does not know: measured again
        return False
    inv.measured, inv.measured_one_session = entry.measured, entry.one_session
    inv.measured_activation = entry.activation
    inv.paid = dict(entry.paid)
    inv.measured_cached = entry.measured_at
    inv.measure_notes = [
        f"measured (cached, {entry.measured_at}): the verdict measured then, reused while the model's content, the "
        "runtime's version, the CPU kind and the options are unchanged (--no-cache measures again)",
        *entry.notes,
    ]
    inv.findings += found
    return True


def remember(key: str, inv: ModelInventory, found: Sequence[Finding]) -> None:
    """Store ``inv``'s measured verdict (``found``: the findings measuring made) unless a child did not finish
    (a time limit on a loaded machine is not the model's verdict)."""
    if any("did not finish" in n or "could not measure" in n for n in inv.measure_notes):
        return
    entry = MeasuredEntry(
        dict(inv.measured),
        dict(inv.measured_one_session),
        list(inv.measure_notes),
        dict(inv.measured_activation),
        [(f.code.value, f.tensor, f.message) for f in found],
        now_utc(),
        dict(inv.paid),
    )
    store(key, entry)
