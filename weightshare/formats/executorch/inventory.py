"""Where an ExecuTorch program's payloads live, and what loading one more program copies.

Read in pytorch/executorch (main, Aug 2026) and measured with executorch 1.5.1 (scripts/build_executorch.py):
- ``Runtime.load_program(path[, data_path=])`` opens both files with ``MmapDataLoader`` (pybindings.cpp
  ``loader_from_file``), which maps the pages around every segment it loads ``MAP_SHARED``
  (mmap_data_loader.cpp ``MmapDataLoader::load``): the flatbuffer, the constant segment, named data and a .ptd's
  segments are page cache, shared by every program and process, at any offset (partly shared edge pages).
- The portable kernels read constant tensors in place in that mapping: no copy per program.
- The XNNPACK backend reads each weight (named data, keyed by the SHA-256 of its bytes; node_visitor.py) and, with
  no weights cache, ``xnn_create_runtime_v4`` packs it into private memory of about the same size per delegate
  instance, then frees the mapping (XNNCompiler.cpp). The weights cache that would share them
  (``weight_cache_enabled``) is off in the wheel's build and is a backend option the Python runtime cannot set.
- ``load_program(bytes)`` keeps the whole program in a Python ``bytes`` per program (``executorch-bytes``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ..._inventory import ModelInventory, PayloadInfo, alignment_of, payload_digest
from ..._placement import AlignPolicy
from ..._tensors import FileRange, open_input
from ...errors import InvalidModel, WeightshareError
from . import flatbuf
from .findings import ExecutorchCode

LOADER = "executorch-weightshare"  # loader.program(path): mapped, XNNPACK's weights cache on (packed once per process)
MMAP = "executorch-mmap"  # Runtime.load_program(path): MmapDataLoader
BYTES = "executorch-bytes"  # Runtime.load_program(bytes): BufferDataLoader over a Python bytes per program
SETTINGS = (LOADER, MMAP, BYTES)  # the one that shares most first
XNNPACK_BACKEND = "XnnpackBackend"
MAX_DATA_FILES = 32  # .ptd files beside a program searched for its external keys


def data_files_beside(path: Path) -> list[Path]:
    """The ``.ptd`` files in a program's directory (the runtime takes one by ``data_path``; the exporter writes it
    beside the program)."""
    try:
        found = sorted(p for p in path.parent.iterdir() if p.suffix == ".ptd" and p.is_file())
    except OSError:
        return []
    return found[:MAX_DATA_FILES]


def needed_keys(prog: flatbuf.Program, fd: int, path: str) -> list[str]:
    """The named-data keys a program reads and does not hold itself: its external constants'
    (``ExtraTensorInfo``) and those its XNNPACK delegates name (``ConstantDataOffset.named_key``)."""
    own = {nd.key for nd in prog.named_data}
    keys = [c.external_key for c in prog.constants if c.external_key]
    for d in prog.delegates:
        if d.backend != XNNPACK_BACKEND:
            continue
        blob = prog.delegate_data[d.index] if d.inline else prog.segments[d.index]
        keys += flatbuf.xnnpack_keys(fd, blob.file_offset, blob.nbytes, path) or []
    return list(dict.fromkeys(k for k in keys if k not in own))


def locate_data_files(
    program: Path, prog: flatbuf.Program, fd: int, candidates: Sequence[Path] | None = None
) -> dict[Path, list[str]]:
    """Each data file holding keys the program reads, with those keys: searched among ``candidates`` (by default
    the ``.ptd`` files beside it), each file once however it is named.

    Raises:
        InvalidModel: a key the program reads is in no candidate, or in two of them (which one the runtime
            would read is then a guess).
    """
    needed = needed_keys(prog, fd, str(program))
    reads = reads_key(prog, delegate_blob_bytes(prog, fd))
    files: list[Path] = []
    seen: set[tuple[int, int]] = set()
    for ptd in candidates if candidates is not None else data_files_beside(program):
        try:
            st = os.stat(ptd)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            files.append(ptd)
    holders: dict[str, list[Path]] = {}
    found: dict[Path, list[str]] = {}
    for ptd in files:
        try:
            keys = _keys(ptd)
        except WeightshareError:  # another .ptd that is damaged is not this program's problem
            continue
        for key in keys:
            if key in needed or reads(key):
                holders.setdefault(key, []).append(ptd)
                found.setdefault(ptd, []).append(key)
    for key, where in holders.items():
        if len(where) > 1:
            raise InvalidModel(
                f"reads named data {key!r}, which is in both {where[0]} and {where[1]}: keep the one it was "
                "exported with",
                program,
            )
    missing = [k for k in needed if k not in holders]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InvalidModel(
            f"reads named data {missing[0]!r}{more}, which no .ptd beside it or given with it holds: add the .ptd it "
            "was exported with",
            program,
        )
    return found


def read_by_a_program(path: Path) -> bool:
    """Whether a program beside the ``.ptd`` ``path`` reads a key it holds (the loader finds a program's ``.ptd``
    beside it): the outputs record removes a dropped ``.ptd`` only when none does. True when it cannot be told (a
    file unreadable or damaged): kept, never removed early."""
    if path.suffix != ".ptd":
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            keys = {nd.key for nd in flatbuf.read_data_file(fd, str(path)).named_data}
        finally:
            os.close(fd)
        programs = sorted(p for p in path.parent.iterdir() if p.suffix == ".pte" and not p.name.startswith("."))
    except (OSError, WeightshareError):
        return True
    for program in programs:
        try:
            fd = os.open(program, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # a link or a directory: not a program the record wrote beside it
        try:
            if not keys.isdisjoint(needed_keys(flatbuf.read_program(fd, str(program)), fd, str(program))):
                return True
        except (OSError, WeightshareError):
            return True
        finally:
            os.close(fd)
    return False


def _keys(ptd: Path) -> dict[str, tuple[flatbuf.NamedData, flatbuf.Segment]]:
    f = open_input(ptd)
    try:
        data = flatbuf.read_data_file(f.fd, str(ptd))
    finally:
        f.close()
    return {nd.key: (nd, data.segments[nd.segment]) for nd in data.named_data}


def find_data_file(
    path: Path, reads: Callable[[str], bool]
) -> tuple[Path | None, dict[str, tuple[flatbuf.NamedData, flatbuf.Segment]]]:
    """The .ptd beside ``path`` holding the most keys the program reads, with those entries (None when no .ptd
    holds any)."""
    best: tuple[Path | None, dict[str, tuple[flatbuf.NamedData, flatbuf.Segment]]] = (None, {})
    for ptd in data_files_beside(path):
        try:
            found = {k: v for k, v in _keys(ptd).items() if reads(k)}
        except WeightshareError:  # another .ptd that is damaged is not this program's problem
            continue
        if len(found) > len(best[1]):
            best = (ptd, found)
    return best


MAX_DELEGATE_BYTES = 64 << 20  # delegate blobs searched for the keys they read (XNNPACK's are a few KiB)


def delegate_blob_bytes(prog: flatbuf.Program, fd: int) -> bytes:
    """The delegate blobs of a program (segments), concatenated, up to ``MAX_DELEGATE_BYTES``: a delegate names the
    weights it reads by key in its own serialization (XNNPACK: ``ConstantDataOffset.named_key``)."""
    parts, total = [], 0
    for d in prog.delegates:
        if d.inline:
            blob = prog.delegate_data[d.index]
            pos, n = blob.file_offset, blob.nbytes
        else:
            seg = prog.segments[d.index]
            pos, n = seg.file_offset, seg.nbytes
        if total + n > MAX_DELEGATE_BYTES:
            break
        parts.append(os.pread(fd, n, pos))
        total += n
    return b"".join(parts)


def reads_key(prog: flatbuf.Program, blobs: bytes) -> Callable[[str], bool]:
    """Whether the program reads a .ptd entry of this key: an external constant of a plan, or a key its delegate
    blobs name (and its own named data does not hold)."""
    constants = {c.external_key for c in prog.constants if c.external_key}
    own = {nd.key for nd in prog.named_data}
    return lambda key: key in constants or (key not in own and key.encode() in blobs)


def _payload(
    name: str, dtype: str, shape: tuple[int, ...], nbytes: int, file: str, offset: int, encoding: str
) -> PayloadInfo:
    info = PayloadInfo(
        name,
        dtype,
        shape,
        nbytes,
        "external",
        encoding=encoding,
        file=file,
        offset=offset,
        alignment=alignment_of(offset),
    )
    # convert re-lays a file's segments at the default policy's alignment
    info.would_move = (info.alignment or 1) < AlignPolicy().for_size(nbytes)
    return info


def _packed(info: PayloadInfo) -> None:
    info.copy_reason = "packed by ExecuTorch's XNNPACK backend into private memory per loaded program"
    info.copy_code = ExecutorchCode.XNNPACK_PACK_COPY.value
    info.copied_per_session = 0  # under LOADER: packed once per process, reused by every later program
    info.copies = {LOADER: 0, MMAP: info.nbytes, BYTES: 2 * info.nbytes}
    info.copy_bytes = {LOADER: 0, MMAP: info.nbytes, BYTES: info.nbytes}


def program_inventory(path: Path, hash_payloads: bool) -> ModelInventory:
    f = open_input(path)
    try:
        prog = flatbuf.read_program(f.fd, str(path))
        blobs = delegate_blob_bytes(prog, f.fd)
    finally:
        f.close()
    inv = ModelInventory(model=str(path), format="executorch", file_bytes=prog.file_size, settings=list(SETTINGS))
    xnnpack = any(d.backend == XNNPACK_BACKEND for d in prog.delegates)
    seg_named: dict[int, str] = {}
    for nd in prog.named_data:
        seg_named.setdefault(nd.segment, nd.key)
    constants = {c.buffer_index: c for c in reversed(prog.constants) if c.buffer_index}
    delegate_segments = {d.index: d for d in prog.delegates if not d.inline}
    sources: list[tuple[PayloadInfo, FileRange]] = []
    for seg in prog.segments:
        if seg.index == prog.constant_segment:
            offs = prog.constant_offsets
            for j, start in enumerate(offs):
                end = offs[j + 1] if j + 1 < len(offs) else seg.nbytes  # ascending (checked by the reader)
                if end <= start:
                    continue
                c = constants.get(j)
                info = _payload(
                    c.name if c else f"constant{j}",
                    c.dtype if c else "uint8",
                    c.shape if c else (),
                    end - start,
                    path.name,
                    seg.file_offset + start,
                    "constant-segment",
                )
                info.copies = {LOADER: 0, MMAP: 0, BYTES: info.nbytes}  # portable kernels read it in the mapping
                sources.append((info, FileRange(str(path), seg.file_offset + start, end - start)))
            continue
        if seg.index in delegate_segments:
            d = delegate_segments[seg.index]
            info = _payload(
                f"{d.plan}/{d.backend}",
                "uint8",
                (seg.nbytes,),
                seg.nbytes,
                path.name,
                seg.file_offset,
                "delegate-segment",
            )
            info.stays_inline_because = "delegate blob: read once at load and freed"
        else:
            key = seg_named.get(seg.index, f"segment{seg.index}")
            info = _payload(key, "uint8", (seg.nbytes,), seg.nbytes, path.name, seg.file_offset, "named-data")
            if xnnpack and seg.index in seg_named:
                _packed(info)
        info.copies = info.copies or {LOADER: 0, MMAP: 0, BYTES: info.nbytes}
        sources.append((info, FileRange(str(path), seg.file_offset, seg.nbytes)))
    for blob in prog.constant_buffers + prog.delegate_data:
        if blob.nbytes:
            info = PayloadInfo(
                blob.what,
                "uint8",
                (blob.nbytes,),
                blob.nbytes,
                "embedded",
                encoding="inline",
                offset=blob.file_offset,
                alignment=alignment_of(blob.file_offset),
            )
            info.stays_inline_because = "inline in the program flatbuffer (mapped with it; not moved)"
            info.copies = {LOADER: 0, MMAP: 0, BYTES: info.nbytes}
            sources.append((info, FileRange(str(path), blob.file_offset, blob.nbytes)))
    _external(path, prog, blobs, xnnpack, inv, sources)
    if hash_payloads:
        for info, src in sources:
            if not info.problem:
                info.sha256 = payload_digest(src)
    inv.payloads = [info for info, _ in sources]
    if any(p.file == path.name for p in inv.payloads):
        inv.external_files.append(path.name)
    planned = sum(prog.planned_bytes.values())
    if planned >= 1 << 20:  # e.g. portable Linear: permute_copy of each weight into the arena (not shared)
        inv.notes.append(
            f"memory-planned buffers (activations and copies the graph makes at run time, e.g. a transposed weight): "
            f"{planned / (1 << 20):.1f} MiB per loaded program, allocated by the runtime, not mapped"
        )
    if xnnpack:
        inv.notes.append(
            "XNNPACK-delegated: executorch.runtime packs the weights into private memory for every loaded program "
            "(static estimate: about their stored size); weightshare.formats.executorch.program(path) packs them once "
            "per process (XNNPACK's weights cache); no Python API shares them across processes"
        )
    return inv


def _external(
    path: Path,
    prog: flatbuf.Program,
    blobs: bytes,
    xnnpack: bool,
    inv: ModelInventory,
    sources: list[tuple[PayloadInfo, FileRange]],
) -> None:
    """Tensors the program reads from a .ptd (``data_path``): external constants by name; a delegate's by key."""
    reads = reads_key(prog, blobs)
    ptd, found = find_data_file(path, reads)
    wanted = {c.external_key for c in prog.constants if c.external_key} | set(found)
    if not wanted:
        return
    if ptd is not None and ptd.name not in inv.external_files:
        inv.external_files.append(ptd.name)
    delegated = {k for k in found if k.encode() in blobs}
    for key in sorted(wanted):
        if key not in found:
            info = PayloadInfo(key, "uint8", (), 0, "external", encoding="named-data")
            info.problem = f"external tensor {key!r} is in no .ptd beside the program (pass its data_path)"
            info.problem_code = "missing-external-file"
            sources.append((info, FileRange(str(path), 0, 0)))
            continue
        nd, seg = found[key]
        assert ptd is not None
        info = _payload(key, nd.dtype, nd.shape, seg.nbytes, ptd.name, seg.file_offset, "ptd")
        info.copies = {LOADER: 0, MMAP: 0, BYTES: 0}
        if xnnpack and key in delegated:
            _packed(info)
        sources.append((info, FileRange(str(ptd), seg.file_offset, seg.nbytes)))


def data_inventory(path: Path, hash_payloads: bool) -> ModelInventory:
    f = open_input(path)
    try:
        data = flatbuf.read_data_file(f.fd, str(path))
    finally:
        f.close()
    inv = ModelInventory(model=str(path), format="executorch", file_bytes=data.file_size, settings=list(SETTINGS))
    named: dict[int, flatbuf.NamedData] = {}
    for each in data.named_data:
        named.setdefault(each.segment, each)
    for seg in data.segments:
        nd = named.get(seg.index)
        info = _payload(
            nd.key if nd else f"segment{seg.index}",
            nd.dtype if nd else "uint8",
            nd.shape if nd else (seg.nbytes,),
            seg.nbytes,
            path.name,
            seg.file_offset,
            "ptd",
        )
        info.copies = {
            LOADER: 0,
            MMAP: 0,
            BYTES: 0,
        }  # the runtime maps a data_path; what a program copies is the program's
        if hash_payloads:
            info.sha256 = payload_digest(FileRange(str(path), seg.file_offset, seg.nbytes))
        inv.payloads.append(info)
    inv.external_files.append(path.name)
    inv.notes.append("an ExecuTorch data file (.ptd): the programs that load it say what each copies")
    return inv


def inventory_file(path: Path, hash_payloads: bool) -> ModelInventory:
    with open(path, "rb") as fh:
        head = fh.read(8)
    if flatbuf.kind_of(head) == "ptd":
        return data_inventory(path, hash_payloads)
    return program_inventory(path, hash_payloads)


__all__ = ["SETTINGS", "data_files_beside", "find_data_file", "inventory_file", "os"]
