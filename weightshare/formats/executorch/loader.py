"""Load ExecuTorch programs so that every copy of their weights in a process is shared: ``program(path)``.

- Unpacked weights: ``Runtime.load_program(path, data_path=...)`` maps the program and its ``.ptd`` with
  ``MmapDataLoader`` (``MAP_SHARED``): page cache, shared by every program and process. ``program`` finds the
  ``.ptd`` beside the program that holds its external tensors when ``data_path`` is not given.
- XNNPACK's packed weights: each ``load_method`` runs with the XNNPACK backend's weights cache on
  (``backend_options``), so a weight packed for one program is reused by every later program of the process that
  reads the same weight. The cache looks weights up by their named-data key only; the exporter makes that key the
  SHA-256 of the bytes, but a file can claim any key. So, before a program's methods load with the cache, every
  key it brings (its own named data and its ``.ptd``'s) is bound to the digest of the bytes behind it, in a
  process-wide table: a key seen before with other bytes (another model reusing a name, a tampered file) loads
  that program with the cache off (XNNPACK packs privately, as without weightshare), never with another
  program's packed weights. The option is switched back off after each load, so programs loaded with
  ``executorch.runtime`` directly are untouched.

What this cannot share: packed weights across processes. ExecuTorch's file-backed cache (``packed_cache_path``)
is read only from per-load runtime specs (XNNPACKBackend.cpp ``init``: "Only honor a path coming through
runtime_spec"), which ``Program.load_method`` in the pybindings does not pass; the global option is ignored
(measured: no file written with ``save_weight_cache_on_disk``). Each process packs once.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..._tensors import FileRange, open_input
from ...errors import InvalidModel, Unsupported
from . import backend_options, flatbuf
from .inventory import locate_data_files

_lock = threading.Lock()
_bound: dict[str, str] = {}  # named-data key -> SHA-256 of the bytes first loaded under it
# (dev, ino, size, mtime_ns, ctime_ns, offset, n) -> digest. ctime, because a rewrite in place can keep size and
# mtime (os.utime sets them; a program rewritten with its mtime restored ran with the earlier version's packed
# weights) but never ctime, which the kernel sets on every write and utime alone.
_digests: dict[tuple[int, ...], str] = {}
# ctime has the kernel's coarse-clock granularity (a jiffy, 1-10 ms): two writes within one tick can share it. So a
# digest is remembered only for a file whose ctime is this much older than the hashing (git's racy-clean rule); a
# file changed more recently is hashed at every load.
RACY_NS = 2_000_000_000


def _file_keys(path: Path) -> list[tuple[str, FileRange, tuple[int, ...]]]:
    """(key, bytes, file identity) of every named data entry of a program or data file; the bytes are read through
    the descriptor the identity was taken from (closed when the last range goes)."""
    f = open_input(path)
    st = os.fstat(f.fd)
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    kind = flatbuf.kind_of(os.pread(f.fd, 8, 0))
    if kind == "pte":
        prog = flatbuf.read_program(f.fd, str(path))
        named, segments = prog.named_data, prog.segments
    elif kind == "ptd":
        data = flatbuf.read_data_file(f.fd, str(path))
        named, segments = data.named_data, data.segments
    else:
        f.close()
        raise InvalidModel("not an ExecuTorch program or data file", path)
    out: list[tuple[str, FileRange, tuple[int, ...]]] = []
    for nd in named:
        seg = segments[nd.segment]
        out.append((nd.key, FileRange(str(path), seg.file_offset, seg.nbytes, f), ident))
    return out


def _digest(source: FileRange, ident: tuple[int, ...]) -> str:
    """SHA-256 of ``source``'s bytes; remembered by the file's identity when its ctime is not racy."""
    key = (*ident, source.offset, source.length)
    cached = _digests.get(key)
    if cached is not None:
        return cached
    started = time.time_ns()
    h = hashlib.sha256()
    for chunk in source.chunks():
        h.update(chunk)
    digest = h.hexdigest()
    if ident[4] < started - RACY_NS:
        _digests[key] = digest
    return digest


def bind_keys(files: list[Path]) -> list[str]:
    """Bind every named-data key of ``files`` to its bytes' digest; return the keys already bound to other bytes
    (empty: the weights cache can serve this program)."""
    conflicts = []
    wanted: dict[str, str] = {}
    for path in files:
        for key, source, ident in _file_keys(path):
            digest = _digest(source, ident)
            if wanted.setdefault(key, digest) != digest:
                conflicts.append(key)  # one program, one key, two contents: ambiguous for the cache
    with _lock:
        conflicts += [k for k, d in wanted.items() if _bound.get(k, d) != d]
        if not conflicts:
            _bound.update(wanted)
    return conflicts


@dataclass
class SharedProgram:
    """A loaded ``executorch.runtime.Program`` whose methods load with XNNPACK's weights cache when that is safe."""

    program: Any
    path: Path
    data_path: Path | None
    packed_shared: bool  # methods load through the weights cache
    conflicts: list[str] = field(default_factory=list)  # keys bound to other bytes (why packed_shared is False)

    @property
    def method_names(self) -> set[str]:
        names: set[str] = self.program.method_names
        return names

    def load_method(self, name: str) -> Any:
        if not self.packed_shared:
            return self.program.load_method(name)
        with _lock:  # the option is process-wide: hold it on only for this load
            backend_options.enable_xnnpack_weight_cache()
            try:
                return self.program.load_method(name)
            finally:
                backend_options.set_bool(backend_options.XNNPACK, backend_options.WEIGHT_CACHE, False)


def data_file_for(path: Path, given: Path | None) -> Path | None:
    """The ``.ptd`` to load ``path`` with (``given``, else the one beside it holding the keys it reads), once every
    named-data key the program reads is known to be there: ExecuTorch fails to load a method whose data is missing
    (executorch 1.5.1: ``RuntimeError: Failed to load method``, error 0x:2, 0x:20 or 0x:24; a SIGSEGV was
    reported), so this is said first.

    Raises:
        InvalidModel: a key is in no data file (or in two beside it); the program is damaged.
        Unsupported: its keys are in two data files (the runtime takes one ``data_path``).
    """
    f = open_input(path)
    try:
        prog = flatbuf.read_program(f.fd, str(path))
        found = locate_data_files(path, prog, f.fd, [given] if given is not None else None)
    finally:
        f.close()
    if len(found) > 1:
        names = ", ".join(str(p) for p in found)
        raise Unsupported(f"reads named data from {len(found)} data files ({names}); the runtime takes one", path)
    return given if given is not None else next(iter(found), None)


def program(path: str | os.PathLike[str], data_path: str | os.PathLike[str] | None = None) -> SharedProgram:
    """Load an ExecuTorch program for sharing: mapped weights, XNNPACK's packed weights once per process
    (``weightshare.executorch.program``).

    Args:
        path: the ``.pte``.
        data_path: its ``.ptd``; by default the one beside it that holds its external tensors, if any.

    Returns:
        A ``SharedProgram``: ``load_method(name)`` returns the runtime's ``Method`` (``execute(inputs)``).

    Raises:
        InvalidModel: the program reads a named-data key no data file holds (checked before ExecuTorch runs it).

    Example:
        >>> m = program("model.pte").load_method("forward")
        >>> out = m.execute([torch.randn(1, 2048)])
    """
    path = Path(path)
    data = data_file_for(path, Path(data_path) if data_path is not None else None)  # before the runtime sees it
    try:
        runtime = importlib.import_module("executorch.runtime")
    except ImportError as e:
        raise Unsupported(f"ExecuTorch's Python runtime is not installed ({e})") from None
    files = [path] + ([data] if data is not None else [])
    conflicts = bind_keys(files)
    kwargs = {"data_path": str(data)} if data is not None else {}
    loaded = runtime.Runtime.get().load_program(str(path), **kwargs)
    try:
        backend_options.set_bool(backend_options.XNNPACK, backend_options.WEIGHT_CACHE, False)
        reachable = True
    except Unsupported:
        reachable = False  # a runtime without the exported set_option: load as the runtime does
    return SharedProgram(loaded, path, data, reachable and not conflicts, conflicts)
