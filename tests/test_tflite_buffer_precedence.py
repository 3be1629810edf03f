"""A Buffer with both a data vector and offset/size: LiteRT's InterpreterBuilder reads the data vector, so the
converter must too (found by scripts/fuzz.py --mode structure: the converted model read the other bytes)."""

from __future__ import annotations

import flatbuffers
import numpy as np
from fuzz_structure import load_seed, run_model, tflite_concat_seed

import weightshare


def _pack(m) -> bytes:
    b = flatbuffers.Builder(1 << 16)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def test_data_vector_wins_over_offset(tmp_path):
    m = load_seed("tflite", tflite_concat_seed(tmp_path / "seed.tflite"))
    buf = m.buffers[1]  # the fp16 weight behind DEQUANTIZE
    other = (np.frombuffer(bytes(buf.data), np.float16) * -1).tobytes()  # different bytes after the flatbuffer
    buf.offset, buf.size = 1 << 20, len(other)
    offset = (len(_pack(m)) + 63) // 64 * 64
    buf.offset = offset  # same encoded width: the flatbuffer keeps its length
    fb = _pack(m)
    src = tmp_path / "both.tflite"
    src.write_bytes(fb + bytes(offset - len(fb)) + other)
    weightshare.convert(src, tmp_path / "out")
    before, after = run_model("tflite", str(src)), run_model("tflite", str(tmp_path / "out" / src.name))
    assert before[0] == after[0] == "ok", (before, after)
    assert before[1] == after[1]
