"""The breakdown's index of a model's tensors holds the same words at the same places, gathered from mapped windows.

Before: files written in code (random words, repeated fills, zeros) with tensor tables at unaligned offsets, tensors
shorter than the stride, overlapping ones, an empty file, a file without a table; a small model saved with external
weights (``formats/onnx/remainder.sources`` of it). A 192 MiB sparse file for the memory bound.
Under test: ``_runtimes.remainder._Index``, which maps each source a window at a time and gathers one word every
``stride`` bytes with a strided view.
After: its words and places are exactly those of reading every byte of each tensor (the reference below, the way
the index was built before), at the smallest stride and at wider ones, with windows smaller than a tensor; indexing
a source leaves the process's peak RSS within a window, not the source's size.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from weightshare._runtimes import remainder as r

MiB = 1 << 20


def _reference(sources, stride):
    """The index as reading every byte of each tensor gives it: (sorted kept words, their places)."""
    keys, where = [], []
    files = []
    for path, tensors in sources:
        if os.path.isfile(path):
            size = os.path.getsize(path)
            spans = sorted({(b, n, k) for n, b, k in tensors if k >= 16 and 0 <= b and b + k <= size})
            files.append((path, [(n, b, k) for b, n, k in spans] or [(os.path.basename(path), 0, size)]))
    for i, (path, table) in enumerate(files):
        data = Path(path).read_bytes()
        for _n, begin, length in table:
            for m in range(0, length - 7, stride):
                keys.append(int.from_bytes(data[begin + m : begin + m + 8], "little"))
                where.append((i << 48) + begin + m)
    key = np.array(keys, np.uint64)
    at = np.array(where, np.int64)
    order = np.argsort(key, kind="stable")
    key, at = key[order], at[order]
    out_k, out_a = [], []
    j = 0
    while j < len(key):
        e = j
        while e < len(key) and key[e] == key[j]:
            e += 1
        if e - j <= r.COMMON and key[j] != 0:
            out_k.append(key[j])
            out_a.append(at[j])
        j = e
    return np.array(out_k, np.uint64), np.array(out_a, np.int64)


def _fixture(tmp_path: Path):
    rng = np.random.default_rng(7)
    a = tmp_path / "a.bin"
    body = bytearray(rng.integers(0, 256, 3 * MiB + 1234, dtype=np.uint8).tobytes())
    body[5000:9000] = b"\x00" * 4000  # zeros: never evidence
    body[20000:24000] = b"\x3f\x80\x00\x00" * 1000  # a fill: one word many times, dropped
    body[-300:-200] = body[100:200]  # a short repeat: a word at two places, the first kept
    a.write_bytes(bytes(body))
    size = len(body)
    table = [
        ("unaligned", 3, 1001),  # at an odd offset, an odd length
        ("short", 2003, 20),  # shorter than any stride but the smallest
        ("exact", 4096, 16),
        ("tiny", 6000, 7),  # under 16 bytes: not listed (the whole-file fallback is not taken for it)
        ("overlap", 500, 5000),  # overlaps "unaligned" and "short"
        ("long", 17, size - 17 - 5),  # spans many windows, ends 5 bytes before the file does
        ("past-end", size - 100, 200),  # not inside the file: left out
        ("again", 3, 1001),  # listed twice: indexed once
    ]
    b = tmp_path / "b.bin"  # no table: the whole file is one tensor
    b.write_bytes(rng.integers(0, 256, 70001, dtype=np.uint8).tobytes())
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    seven = tmp_path / "seven.bin"  # shorter than one word
    seven.write_bytes(b"1234567")
    return [
        (str(a), table),
        (str(b), []),
        (str(empty), []),
        (str(seven), []),
        (str(tmp_path / "missing.bin"), []),
        (str(a), [("again", 11, 64 << 10)]),  # the same file as another source
    ]


@pytest.mark.parametrize("max_index", [1 << 19, 1 << 16, 1 << 12])
@pytest.mark.parametrize("window", [64 * MiB, 3 * 4096 + 8])
def test_the_index_holds_the_words_of_reading_every_byte(tmp_path, monkeypatch, max_index, window):
    monkeypatch.setattr(r, "MAX_INDEX", max_index)  # a wider stride: 16, 64, 1024 bytes here
    monkeypatch.setattr(r, "WINDOW", window)
    sources = _fixture(tmp_path)
    index = r._Index(sources)
    keys, at = _reference(sources, index.stride)
    assert len(keys) > 100
    assert np.array_equal(index.keys, keys) and np.array_equal(index.at, at)


def test_the_index_of_a_models_sources_is_unchanged(tmp_path, monkeypatch):
    import model_forms as mf

    from weightshare.formats.onnx.remainder import sources

    monkeypatch.setattr(r, "WINDOW", 5 * 4096)
    model = mf._save(mf._mlp(48, 6, 0), tmp_path / "m.onnx", external=True)
    found = sources(model)
    assert sum(len(t) for _f, t in found) >= 6
    index = r._Index(found)
    keys, at = _reference(found, index.stride)
    assert len(keys) > 1000
    assert np.array_equal(index.keys, keys) and np.array_equal(index.at, at)
    # a word found names its tensor
    some = index.find(keys[:50])
    assert (some == at[:50]).all() and all(index.tensor(int(p)) for p in some)


@pytest.mark.slow
def test_indexing_a_source_leaves_the_peak_within_a_window(tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:  # holes read as zero pages: cheap to write, mapped and faulted like data
        f.truncate(192 * MiB)
        for at in range(0, 192 * MiB, MiB):
            f.seek(at)
            f.write(os.urandom(64))
    code = (
        "import resource, sys\n"
        "from weightshare._runtimes import remainder as r\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "r._Index([(sys.argv[1], [('t', 0, 192 << 20)])])\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run([sys.executable, "-c", code, str(big)], capture_output=True, text=True, env=env, check=True)
    grown = int(res.stdout.split()[-1])
    assert grown <= r.WINDOW // MiB + 32, grown
