"""ExecuTorch ``.pte`` / ``.ptd`` files written in code, with the structures executorch 1.5.1's exporter writes.

Copied from real exports (scripts/build_executorch.py, read back with ``weightshare.formats.executorch.flatbuf``):
- XNNPACK-delegated MLP (``xnnpack_program``): ``Program.segments`` = [constant segment (empty, offset and size
  fields omitted), the delegate blob (offset omitted: relative 0, as the empty segment), then one segment per
  weight and bias]; ``named_data`` keys are the SHA-256 hex of each weight's bytes (node_visitor.py);
  ``constant_segment`` = {segment_index 0, offsets [0]}; one ``BackendDelegate`` "XnnpackBackend" whose processed
  data is segment 1 and whose blob names the keys; segments 128-byte aligned; an extended header "eh00" at byte 8.
- not delegated (``portable_program``): one constant segment holding every tensor at 128-byte-aligned offsets
  (``constant_segment.offsets`` = [0, 0, w0, b0, ...]: index 0 is the reserved empty buffer), and plan values
  that are constant Tensors (no allocation_info, ``data_buffer_idx`` 1..n).
- ``.ptd`` (``data_file``): "FT01", a "FH01" header at byte 8 (length 40, flatbuffer_offset 48), segments after
  the flatbuffer 128-byte aligned, the first segment's offset field omitted; ``NamedData`` with a TensorLayout
  (external constants) or without (a delegate's weights tagged external: uint8, no shape).
- The XNNPACK delegate blob (``xnnpack_blob``): 4 zero bytes, "XH00", u16 header length 30, u32 flatbuffer offset
  32, u32 flatbuffer size, u32 constant data offset, u64 constant data size; then the ``XNNGraph`` flatbuffer
  ("XN01") whose ``constant_data`` names each weight by key (offset UINT64_MAX: the bytes are named data).
- Weights in a .ptd (``xnnpack_program(external=...)``, ``external_program``): ``to_executorch(ExecutorchBackend
  Config(external_constants=True))`` + ``write_tensor_data_to_file`` (constants: ``ExtraTensorInfo`` EXTERNAL with
  the key as fully_qualified_name; the program's only segment, the constant segment, empty, and then no extended
  header) or XNNPACK weights tagged external (``delegate_external_constants_pass_unlifted``: the delegate names
  keys the program's own named data does not hold).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import flatbuffers
import numpy as np

SEGMENT_ALIGN = 128


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _string(b: flatbuffers.Builder, s: str) -> int:
    return int(b.CreateString(s))


def _table_vector(b: flatbuffers.Builder, items: list[int]) -> int:
    b.StartVector(4, len(items), 4)
    for it in reversed(items):
        b.PrependUOffsetTRelative(it)
    return int(b.EndVector())


def _u64_vector(b: flatbuffers.Builder, values: list[int]) -> int:
    b.StartVector(8, len(values), 8)
    for v in reversed(values):
        b.PrependUint64(v)
    return int(b.EndVector())


def _i32_vector(b: flatbuffers.Builder, values: list[int]) -> int:
    b.StartVector(4, len(values), 4)
    for v in reversed(values):
        b.PrependInt32(v)
    return int(b.EndVector())


def _segment(b: flatbuffers.Builder, offset: int, size: int) -> int:
    b.StartObject(2)
    b.PrependUint64Slot(0, offset, 0)  # a default 0 is omitted, as flatc writes it
    b.PrependUint64Slot(1, size, 0)
    return int(b.EndObject())


def _named(b: flatbuffers.Builder, key: str, segment: int, layout: tuple[int, tuple[int, ...]] | None = None) -> int:
    k = _string(b, key)
    lay = None
    if layout is not None:
        sizes = _i32_vector(b, list(layout[1]))
        b.StartObject(3)
        b.PrependInt8Slot(0, layout[0], 0)
        b.PrependUOffsetTRelativeSlot(1, sizes, 0)
        lay = b.EndObject()
    b.StartObject(3)
    b.PrependUOffsetTRelativeSlot(0, k, 0)
    b.PrependUint32Slot(1, segment, 0)
    if lay is not None:
        b.PrependUOffsetTRelativeSlot(2, lay, 0)
    return int(b.EndObject())


def _constant_tensor(b: flatbuffers.Builder, shape: tuple[int, ...], buffer_idx: int, fqn: str = "") -> int:
    """An EValue holding a constant float32 Tensor (KernelTypes.Tensor = 5)."""
    sizes = _i32_vector(b, list(shape))
    extra = None
    if fqn:
        name = _string(b, fqn)
        b.StartObject(5)
        b.PrependUOffsetTRelativeSlot(1, name, 0)
        b.PrependInt8Slot(2, 1, 0)  # TensorDataLocation.EXTERNAL
        extra = b.EndObject()
    b.StartObject(10)
    b.PrependInt8Slot(0, 6, 0)  # FLOAT
    b.PrependUOffsetTRelativeSlot(2, sizes, 0)
    b.PrependUint32Slot(5, buffer_idx, 0)
    if extra is not None:
        b.PrependUOffsetTRelativeSlot(9, extra, 0)
    tensor = b.EndObject()
    b.StartObject(2)
    b.PrependUint8Slot(0, 5, 0)
    b.PrependUOffsetTRelativeSlot(1, tensor, 0)
    return int(b.EndObject())


def _plan(
    b: flatbuffers.Builder, values: list[int], delegate_segment: int | None, planned: tuple[int, ...] | list[int] = ()
) -> int:
    name = _string(b, "forward")
    vals = _table_vector(b, values)
    sizes = None
    if planned:
        b.StartVector(8, len(planned), 8)
        for v in reversed(planned):
            b.PrependInt64(v)
        sizes = b.EndVector()
    delegates = None
    if delegate_segment is not None:
        did = _string(b, "XnnpackBackend")
        b.StartObject(2)
        b.PrependUint8Slot(0, 1, 0)  # DataLocation.SEGMENT
        b.PrependUint32Slot(1, delegate_segment, 0)
        ref = b.EndObject()
        b.StartObject(3)
        b.PrependUOffsetTRelativeSlot(0, did, 0)
        b.PrependUOffsetTRelativeSlot(1, ref, 0)
        delegates = _table_vector(b, [b.EndObject()])
    b.StartObject(10)
    b.PrependUOffsetTRelativeSlot(0, name, 0)
    b.PrependUOffsetTRelativeSlot(2, vals, 0)
    if delegates is not None:
        b.PrependUOffsetTRelativeSlot(7, delegates, 0)
    if sizes is not None:
        b.PrependUOffsetTRelativeSlot(8, sizes, 0)
    return int(b.EndObject())


def _with_header(fb: bytes, header: bytes) -> bytes:
    """The flatbuffer with ``header`` inserted after its root offset and identifier (as exir/_serialize does): every
    offset after byte 8 is relative, so only the root offset moves."""
    root = struct.unpack_from("<I", fb, 0)[0] + len(header)
    return struct.pack("<I", root) + fb[4:8] + header + fb[8:]


def xnnpack_blob(keys: list[str], sizes: list[int]) -> bytes:
    """An XNNPACK delegate blob naming ``keys`` in ``XNNGraph.constant_data`` (no nodes: only the keys matter to
    the readers under test)."""
    b = flatbuffers.Builder(256)
    entries = []
    for k, n in zip(keys, sizes):
        name = _string(b, k)
        b.StartObject(3)
        b.PrependUint64Slot(0, (1 << 64) - 1, 0)
        b.PrependUint64Slot(1, n, 0)
        b.PrependUOffsetTRelativeSlot(2, name, 0)
        entries.append(b.EndObject())
    constant_data = _table_vector(b, entries)
    version = _string(b, "1")
    b.StartObject(9)
    b.PrependUOffsetTRelativeSlot(0, version, 0)
    b.PrependUOffsetTRelativeSlot(8, constant_data, 0)
    b.Finish(b.EndObject(), file_identifier=b"XN01")
    fb = bytes(b.Output())
    header = b"\x00\x00\x00\x00XH00" + struct.pack("<HIIIQ", 30, 32, len(fb), 32 + _align(len(fb), 16), 0)
    return header + bytes(32 - len(header)) + fb + bytes(_align(len(fb), 16) - len(fb))


def _program_file(
    plan: int,
    b: flatbuffers.Builder,
    segments: list[bytes],
    named: list[tuple[str, int]],
    constant_offsets: list[int],
    constant_index: int,
) -> bytes:
    """Finish a Program over ``segments`` (laid out 128 apart after the flatbuffer) and return the file's bytes."""
    offsets, pos = [], 0
    for data in segments:
        offsets.append(pos)
        pos = _align(pos + len(data), SEGMENT_ALIGN)
    segs = _table_vector(b, [_segment(b, o, len(d)) for o, d in zip(offsets, segments)])
    named_vec = _table_vector(b, [_named(b, k, s) for k, s in named])
    coffs = _u64_vector(b, constant_offsets)
    b.StartObject(2)
    b.PrependUint32Slot(0, constant_index, 0)
    b.PrependUOffsetTRelativeSlot(1, coffs, 0)
    cseg = b.EndObject()
    plans = _table_vector(b, [plan])
    b.StartObject(8)
    b.PrependUint32Slot(0, 0, 0)
    b.PrependUOffsetTRelativeSlot(1, plans, 0)
    b.PrependUOffsetTRelativeSlot(4, segs, 0)
    b.PrependUOffsetTRelativeSlot(5, cseg, 0)
    b.PrependUOffsetTRelativeSlot(7, named_vec, 0)
    b.Finish(b.EndObject(), file_identifier=b"ET12")
    fb = bytes(b.Output())
    if not any(segments):  # nothing after the flatbuffer: the exporter writes no extended header
        return fb
    program_size = len(fb) + 32
    base = _align(program_size, SEGMENT_ALIGN)
    data_size = pos
    header = b"eh00" + struct.pack("<IQQQ", 32, program_size, base, data_size)
    head = _with_header(fb, header)
    body = bytearray(offsets[-1] + len(segments[-1]) if segments else 0)
    for o, d in zip(offsets, segments):
        body[o : o + len(d)] = d
    return head + bytes(base - len(head)) + bytes(body)


def mlp_weights(dim: int, layers: int, seed: int = 0) -> list[np.ndarray]:
    """Weight, bias, weight, bias, ... of an MLP (float32)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        out += [rng.standard_normal((dim, dim), np.float32), rng.standard_normal(dim, np.float32)]
    return out


def xnnpack_program(
    path: Path,
    dim: int = 512,
    layers: int = 2,
    seed: int = 0,
    duplicate: bool = False,
    external: Path | None = None,
    missing: int = 0,
) -> Path:
    """An XNNPACK-delegated MLP as executorch 1.5.1 writes it (weights as named data keyed by their SHA-256).
    ``duplicate``: the last two weights hold the same bytes under two keys (two segments). ``external``: the
    weights go to that .ptd instead (the program holds none of them); ``missing``: its last ``missing`` weights are
    left out of it (a .ptd of another export)."""
    arrays = mlp_weights(dim, layers, seed)
    if duplicate:
        arrays.append(arrays[0].copy())
    blobs = [a.tobytes() for a in arrays]
    keys = [hashlib.sha256(d).hexdigest() for d in blobs]
    if duplicate:
        keys[-1] = "duplicate-of-" + keys[0][:20]
    delegate = xnnpack_blob(keys, [len(d) for d in blobs])
    b = flatbuffers.Builder(1024)
    plan = _plan(b, [], delegate_segment=1)
    if external is not None:
        kept = len(keys) - missing
        data_file(external, dict(zip(keys[:kept], arrays[:kept])), layout=False)
        path.write_bytes(_program_file(plan, b, [b"", delegate], [], [0], 0))
        return path
    segments = [b"", delegate, *blobs]
    named = [(k, 2 + i) for i, k in enumerate(keys)]
    path.write_bytes(_program_file(plan, b, segments, named, [0], 0))
    return path


def portable_program(path: Path, dim: int = 512, layers: int = 2, seed: int = 0) -> Path:
    """A non-delegated MLP: every tensor in the constant segment, 128-byte aligned, index 0 reserved; the plan's
    memory-planned buffers [0, one transposed weight + activations] (the portable Linear's permute_copy: the real
    2048-wide export plans [0, 16793600])."""
    arrays = mlp_weights(dim, layers, seed)
    b = flatbuffers.Builder(1024)
    values = [_constant_tensor(b, a.shape, i + 1) for i, a in enumerate(arrays)]
    plan = _plan(b, values, delegate_segment=None, planned=[0, dim * dim * 4 + 2 * dim * 4])
    seg, offsets = bytearray(), [0]
    for a in arrays:
        offsets.append(len(seg))
        seg += a.tobytes()
        seg += bytes(_align(len(seg), SEGMENT_ALIGN) - len(seg))
    path.write_bytes(_program_file(plan, b, [bytes(seg)], [], offsets, 0))
    return path


def external_program(path: Path, names: list[str], shapes: list[tuple[int, ...]]) -> Path:
    """A non-delegated program whose constants are external (``ExtraTensorInfo`` EXTERNAL, read from a .ptd)."""
    b = flatbuffers.Builder(1024)
    values = [_constant_tensor(b, s, 0, fqn=n) for n, s in zip(names, shapes)]
    plan = _plan(b, values, delegate_segment=None)
    path.write_bytes(_program_file(plan, b, [b""], [], [0], 0))
    return path


def data_file(path: Path, tensors: dict[str, np.ndarray], layout: bool = True) -> Path:
    """A .ptd holding ``tensors`` (float32), each in its own segment, 128 apart; ``layout``: each with its
    TensorLayout (external constants), else none (a delegate's weights: raw bytes)."""
    b = flatbuffers.Builder(1024)
    blobs = [a.tobytes() for a in tensors.values()]
    offsets, pos = [], 0
    for d in blobs:
        offsets.append(pos)
        pos = _align(pos + len(d), SEGMENT_ALIGN)
    segs = _table_vector(b, [_segment(b, o, len(d)) for o, d in zip(offsets, blobs)])
    named = _table_vector(
        b, [_named(b, k, i, (6, a.shape) if layout else None) for i, (k, a) in enumerate(tensors.items())]
    )
    b.StartObject(3)
    b.PrependUint32Slot(0, 0, 0)
    b.PrependUOffsetTRelativeSlot(1, segs, 0)
    b.PrependUOffsetTRelativeSlot(2, named, 0)
    b.Finish(b.EndObject(), file_identifier=b"FT01")
    fb = bytes(b.Output())
    size = len(fb) + 40
    base = _align(size, SEGMENT_ALIGN)
    header = b"FH01" + struct.pack("<IQQQQ", 40, 48, size - 48, base, pos)
    head = _with_header(fb, header)
    body = bytearray(offsets[-1] + len(blobs[-1]) if blobs else 0)
    for o, d in zip(offsets, blobs):
        body[o : o + len(d)] = d
    path.write_bytes(head + bytes(base - len(head)) + bytes(body))
    return path
