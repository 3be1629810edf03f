"""What the memory one more runtime instance keeps is made of: a per-mapping PSS breakdown and a content match.

A measured per-session growth says how much, not what. Run in the measuring process itself (it reads its own
``/proc/self/smaps``, ``pagemap`` and ``mem``): ``snapshot()`` after the first instance and after the last, then
``breakdown(first, last, added, sources)``:

- per mapping kind (the glibc heap, anonymous mappings (buffers of 1 MiB or more under the measuring children's
  ``MALLOC_MMAP_THRESHOLD_``), the weight files, other files), the PSS growth per instance;
- the anonymous pages that became resident between the two snapshots (what the added instances allocated), each
  classified by its content:
  ``weights``: most of its non-zero 8-byte words occur in one of ``sources`` (the files holding the model's weights
  and their packed copies) at the same relative position, i.e. a byte copy of a weight; the tensors are named;
  ``runtime objects``: pages of pointers (words that are addresses inside this process's mappings), of small
  integers or of names: what a runtime's graph, kernel objects, hash maps, index arrays and allocation plans are
  made of (``_bookkeeping``); never weight bytes, whose 8-byte words are almost never a valid address;
  ``zero``: nothing but zero bytes (a zeroed buffer: no content to tell);
  ``unclassified``: the rest (a weight transformed beyond a byte copy, a kernel's private packing, scratch): kept
  apart, never counted as not-weights.

Copies are found at any 16-byte phase of the copy against its source (allocators align to 16 bytes or more, and
every payload of a weightshare blob sits at 64 bytes or more): the sources are indexed one 8-byte word every
``stride`` bytes (a power of two, 16 or more, wide enough that the index stays within ``MAX_INDEX`` words) and every
16-byte-aligned word of a page is looked up, so that a copy hits its source's indexed words whatever its phase.
Words that occur many times in the sources (padding, constant fills) are no evidence and are dropped.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..report import JsonDict

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MAX_INDEX = 1 << 19  # 8-byte words indexed over all sources: 4 MiB of index at most, whatever the model's size
BATCH = 512  # pages classified at a time
SAMPLE = 4096  # pages classified at most (evenly spread over those the added instances made resident)
COMMON = 4  # a word indexed more often than this is a fill, not evidence of one tensor
WEIGHT_SHARE = 0.5  # a page is a weight copy when this share of its probed non-zero words match a source
POINTER_SHARE = 0.05  # ... runtime objects when this share of its words are addresses in this process
WINDOW = 8 << 20  # bytes of a source mapped at a time: indexing leaves the RSS within this, whatever its size
KINDS = ("heap", "anonymous", "weight files", "other files")


def _mappings() -> list[tuple[int, int, str, str]]:
    """(start, end, permissions, path) of every mapping of this process."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[1], parts[5] if len(parts) > 5 else ""))
    return out


def _kind(path: str, weight_files: set[str]) -> str:
    if path == "[heap]":
        return "heap"
    if not path or path.startswith("[anon"):
        return "anonymous"
    return "weight files" if path in weight_files else "other files"


def _is_code(perms: str, path: str) -> bool:
    return bool(path) and not path.startswith("[") and ("x" in perms or ".so" in os.path.basename(path))


def mapping_pss(weight_files: set[str]) -> dict[str, int]:
    """PSS in bytes per mapping kind (``KINDS``), program code left out (its PSS moves with other processes)."""
    out = dict.fromkeys(KINDS, 0)
    kind: str | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                path = parts[5] if len(parts) > 5 else ""
                kind = (
                    None
                    if _is_code(parts[1], path)
                    else _kind(os.path.realpath(path) if path.startswith("/") else path, weight_files)
                )
            elif parts[0] == "Pss:" and kind is not None:
                out[kind] += int(parts[1]) * 1024
    return out


def _resident_anonymous() -> Any:
    """Addresses of the resident pages of this process's writable anonymous mappings (the heap included), a sorted
    numpy array (8 bytes a page: the snapshot held between two PSS readings must not weigh on them)."""
    import numpy as np

    pages = []
    fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        for lo, hi, perms, path in _mappings():
            if "w" not in perms or (path and path != "[heap]" and not path.startswith("[anon")):
                continue
            n = (hi - lo) // PAGE
            entries = np.frombuffer(os.pread(fd, 8 * n, (lo // PAGE) * 8), "<u8")
            present = np.nonzero(entries >> np.uint64(63))[0]
            pages.append(np.uint64(lo) + present.astype(np.uint64) * np.uint64(PAGE))
    finally:
        os.close(fd)
    return np.sort(np.concatenate(pages)) if pages else np.zeros(0, np.uint64)


def snapshot(weight_files: Sequence[str]) -> JsonDict:
    """What ``breakdown`` compares: PSS per mapping kind and the resident anonymous pages, now."""
    files = {os.path.realpath(f) for f in weight_files}
    return {"pss": mapping_pss(files), "pages": _resident_anonymous()}


def _read_pages(pages: list[int]) -> Any:
    """The bytes of ``pages`` (sorted addresses), one row of 8-byte words per page; a page that cannot be read
    (unmapped since) reads as zeros."""
    import numpy as np

    words = np.zeros((len(pages), PAGE // 8), np.uint64)
    fd = os.open("/proc/self/mem", os.O_RDONLY | os.O_CLOEXEC)
    try:
        i = 0
        while i < len(pages):
            j = i + 1
            while j < len(pages) and pages[j] == pages[j - 1] + PAGE and j - i < 256:
                j += 1
            try:
                data = os.pread(fd, (j - i) * PAGE, pages[i])
                words[i : i + len(data) // PAGE] = np.frombuffer(data[: len(data) // PAGE * PAGE], "<u8").reshape(
                    -1, PAGE // 8
                )
            except OSError:
                pass
            i = j
    finally:
        os.close(fd)
    return words


def _spans() -> Any:
    """[start, end) of every mapping of this process, sorted (a numpy array of two columns)."""
    import numpy as np

    return np.array(sorted((lo, hi) for lo, hi, _p, _n in _mappings()), np.uint64)


def _pointer(words: Any, spans: Any) -> Any:
    """Which of ``words`` are addresses inside one of the mappings ``spans``."""
    import numpy as np

    out = np.zeros(words.shape, bool)
    # only a word between the lowest mapping and the highest can be one: looked up alone (most words of a page of
    # floats or small integers are not)
    maybe = np.flatnonzero((words >= spans[0, 0]) & (words < spans[:, 1].max()))
    near = words[maybe]
    at = np.searchsorted(spans[:, 0], near, side="right").astype(np.int64) - 1
    inside = at >= 0
    at = np.maximum(at, 0)
    out[maybe] = inside & (near >= spans[at, 0]) & (near < spans[at, 1])
    return out


def _gather(
    path: str, table: list[tuple[str, int, int]], stride: int, tag: int, keys: list[Any], where: list[Any]
) -> None:
    """Append to ``keys`` the 8-byte words of ``path`` at each tensor's first byte and every ``stride`` bytes
    after it (those wholly inside the tensor) and to ``where`` their places (``tag`` + offset), in the order of
    ``table`` (sorted by offset). The file is mapped a window at a time and each word gathered by a strided view:
    read whole, a source cost one fresh buffer per chunk under the measuring child's ``MALLOC_MMAP_THRESHOLD_``
    (mapped, zeroed, unmapped: 0.43 CPU s a T5 decoder's sources, 0.04 s this way); each window unmapped before
    the next is mapped, so that the child's RSS does not grow by the sources' size."""
    import mmap

    import numpy as np

    per = max(1, WINDOW // stride)  # words gathered from one window at most
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        mm: mmap.mmap | None = None
        lo = hi = 0
        try:
            for _name, begin, length in table:
                count = (length - 8) // stride + 1 if length >= 8 else 0
                done = 0
                while done < count:
                    first = begin + done * stride
                    n = min(count - done, per)
                    last = first + (n - 1) * stride + 8
                    if last > size:  # shorter than when listed: what is left is not this tensor
                        return
                    if mm is None or first < lo or last > hi:
                        if mm is not None:
                            mm.close()
                        lo = first - first % mmap.ALLOCATIONGRANULARITY
                        hi = min(size, max(last, lo + WINDOW))
                        mm = mmap.mmap(f.fileno(), hi - lo, access=mmap.ACCESS_READ, offset=lo)
                    view = np.ndarray((n,), "<u8", buffer=mm, offset=first - lo, strides=(stride,))
                    keys.append(view.copy())
                    del view  # the window is closed with no view of it left
                    where.append(tag + first + np.arange(n, dtype=np.int64) * stride)
                    done += n
        finally:
            if mm is not None:
                mm.close()


class _Index:
    """One 8-byte word every ``stride`` bytes of each tensor of the sources, from the tensor's first byte (a copy is
    aligned to its tensor, not to the file: a protobuf's raw_data sits at any offset), sorted, with where it came
    from. A source without a table of its tensors is indexed as one tensor, the file."""

    def __init__(self, sources: Sequence[tuple[str, list[tuple[str, int, int]]]]) -> None:
        import numpy as np

        self.files: list[tuple[str, list[tuple[str, int, int]]]] = []
        for path, tensors in sources:
            if os.path.isfile(path):
                size = os.path.getsize(path)
                spans = sorted({(b, n, k) for n, b, k in tensors if k >= 16 and 0 <= b and b + k <= size})
                self.files.append((path, [(n, b, k) for b, n, k in spans] or [(os.path.basename(path), 0, size)]))
        total = sum(length for _path, table in self.files for _n, _b, length in table)
        self.stride = 16
        while total // self.stride > MAX_INDEX:
            self.stride *= 2
        keys: list[Any] = []
        where: list[Any] = []
        for i, (path, table) in enumerate(self.files):
            _gather(path, table, self.stride, (i << 48), keys, where)
        self.starts = [[b for _n, b, _l in table] for _path, table in self.files]
        key = np.concatenate(keys) if keys else np.zeros(0, np.uint64)
        del keys  # each step frees what the next replaces: the index's peak is a few copies of its words
        at = np.concatenate(where) if where else np.zeros(0, np.int64)
        del where
        order = np.argsort(key, kind="stable")
        key = key[order]
        at = at[order]
        del order
        runs = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1]))) if len(key) else np.zeros(0, np.int64)
        count = np.diff(np.append(runs, len(key)))
        runs = runs[(count <= COMMON) & (key[runs] != 0)]
        self.keys, self.at = key[runs], at[runs]

    def find(self, words: Any) -> Any:
        """For each word: its place in the sources (file index << 48 | offset), or -1."""
        import numpy as np

        if not len(self.keys):
            return np.full(words.shape, -1, np.int64)
        i = np.minimum(np.searchsorted(self.keys, words), len(self.keys) - 1)
        return np.where(self.keys[i] == words, self.at[i], -1)

    def tensor(self, place: int) -> str:
        import bisect

        path, table = self.files[place >> 48]
        offset = place & ((1 << 48) - 1)
        k = bisect.bisect_right(self.starts[place >> 48], offset) - 1
        if k >= 0 and offset < table[k][1] + table[k][2]:
            return table[k][0]
        return os.path.basename(path)


def _bookkeeping(words: Any, zero: Any, pointer: Any) -> Any:
    """Which pages hold a runtime's bookkeeping: pointers (more than POINTER_SHARE of the non-zero words: objects,
    hash maps, however sparse), arrays of small integers (value indices, offsets: 8-byte words below 2**24) or
    names (text: printable bytes, mostly letters). What a weight's bytes never look like, however transformed
    (packed, transposed, cast or dequantized, their words are floats or bytes spread over the whole range); an
    integer weight copied as it is matches its source first."""
    import numpy as np

    nonzero = np.maximum((~zero).sum(1), 1)
    pointers = pointer.sum(1)
    small = (~zero & (words < np.uint64(1 << 24))).sum(1)
    out = ((pointers >= 2) & (pointers >= POINTER_SHARE * nonzero)) | ((small >= 0.8 * nonzero) & (nonzero >= 16))
    rest = np.flatnonzero(~out)  # text is looked for on the pages not already told apart (a byte-wise pass)
    if len(rest):
        raw = words[rest].view(np.uint8).reshape(len(rest), -1)
        printable = ((raw >= 0x20) & (raw < 0x7F)) | (raw == 0) | (raw == 0x0A)
        letters = ((raw | 0x20) >= ord("a")) & ((raw | 0x20) <= ord("z"))
        out[rest] = (printable.mean(1) >= 0.9) & (letters.mean(1) >= 0.4)
    return out


def _classify(words: Any, spans: Any, index: _Index, counts: Any, tensor_pages: dict[str, int]) -> None:
    """Add the pages ``words`` (one row of 8-byte words each) to ``counts`` (weights, runtime objects, zero) and the
    weight pages to ``tensor_pages`` (the tensor each copies, by name)."""
    import numpy as np

    zero = words == 0
    pointer = _pointer(words.ravel(), spans).reshape(words.shape)
    probe = words[:, ::2]  # every 16-byte-aligned word
    probed = (probe != 0) & ~pointer[:, ::2]
    found = np.full(probe.shape, -1, np.int64)
    found[probed] = index.find(probe[probed])  # only the words that count are looked up
    hits = found >= 0
    # a copy's words sit at one distance from their source's: the longest run of hits at one distance counts (a
    # page of small integers hits some short tensor everywhere, at as many distances as words)
    rows, cols = np.nonzero(hits)
    places = found[rows, cols]
    delta = places - cols.astype(np.int64) * 16
    order = np.lexsort((delta, rows))
    rows, delta, places = rows[order], delta[order], places[order]
    starts = np.ones(len(rows), bool)
    starts[1:] = (rows[1:] != rows[:-1]) | (delta[1:] != delta[:-1])
    runs = np.bincount(np.cumsum(starts) - 1) if len(rows) else np.zeros(0, np.int64)
    best = np.zeros(len(words), np.int64)
    np.maximum.at(best, rows[starts], runs)
    # the indexed words a copy covering the page hits: 16 / stride of the probed ones
    expected = np.maximum(probed.sum(1), 1) * 16 / index.stride
    is_weight = (best >= np.maximum(2, WEIGHT_SHARE * expected)) & (probed.sum(1) > 0)
    is_zero = zero.all(1) & ~is_weight
    rest = np.flatnonzero(~is_weight & ~is_zero)  # told apart by their bytes alone
    is_object = np.zeros(len(words), bool)
    is_object[rest] = _bookkeeping(words[rest], zero[rest], pointer[rest])
    counts += [int(is_weight.sum()), int(is_object.sum()), int(is_zero.sum())]
    first_rows = rows[starts]
    # each weight page's source: its longest run (the last of equally long ones)
    named = is_weight[first_rows] & (runs == best[first_rows])
    where = dict(zip(first_rows[named].tolist(), places[starts][named].tolist()))
    for row in np.nonzero(is_weight)[0]:
        name = index.tensor(where[int(row)])
        tensor_pages[name] = tensor_pages.get(name, 0) + 1


# The last sources indexed, with their index (the caller lists a model's sources once while its files are
# unchanged, ``formats/onnx/remainder.sources``): at most ``MAX_INDEX`` words, 8 MiB with their places.
_INDEX: list[tuple[Any, _Index]] = []


def breakdown(
    first: JsonDict,
    last: JsonDict,
    added: int,
    sources: Sequence[tuple[str, list[tuple[str, int, int]]]],
    top: int = 5,
) -> JsonDict:
    """What each of the ``added`` instances opened between ``first`` and ``last`` (``snapshot``s) kept, per
    instance: ``pss`` by mapping kind, ``pages`` by content class (bytes), ``tensors``: the weights copied,
    largest first (name, bytes per instance). ``sources``: (file, [(tensor name, absolute offset, length)])."""
    import numpy as np

    added = max(1, added)
    pss = {k: (last["pss"][k] - first["pss"][k]) // added for k in KINDS}
    made = np.setdiff1d(last["pages"], first["pages"])
    # beyond SAMPLE pages, evenly spread ones stand for all (their shares within a few percent, at a fraction of
    # the cost: 8000 pages took a T5 decoder's breakdown 0.4 CPU s)
    new = (made[np.linspace(0, len(made) - 1, SAMPLE).astype(np.int64)] if len(made) > SAMPLE else made).tolist()
    scale = len(made) / max(1, len(new))
    classes = {"weights": 0, "runtime objects": 0, "zero": 0, "unclassified": 0}
    if not new:
        return {"pss": pss, "pages": classes, "tensors": [], "new_pages": 0}
    spans = _spans()
    if not _INDEX or _INDEX[0][0] is not sources:  # the same model's sources under another setting: indexed once
        _INDEX[:] = [(sources, _Index(sources))]
    index = _INDEX[0][1]
    counts = np.zeros(3, np.int64)  # weights, runtime objects, zero
    tensor_pages: dict[str, int] = {}
    for at in range(0, len(new), BATCH):  # a batch at a time: the breakdown's memory stays small
        _classify(_read_pages(new[at : at + BATCH]), spans, index, counts, tensor_pages)
    classes["weights"], classes["runtime objects"], classes["zero"] = (int(n * scale) * PAGE // added for n in counts)
    classes["unclassified"] = (len(made) * PAGE // added) - sum(classes.values())
    found = ((n, int(c * scale) * PAGE // added) for n, c in tensor_pages.items())
    tensors = sorted(found, key=lambda t: (-t[1], t[0]))
    return {"pss": pss, "pages": classes, "tensors": tensors[:top], "new_pages": len(made) * PAGE // added}
