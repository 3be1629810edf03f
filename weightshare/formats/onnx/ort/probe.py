"""What ``weightshare.ort.session`` needs to decide at load, without ``import onnx``.

``import onnx`` costs about 0.6 CPU s (``ml_dtypes`` through ``onnx.helper``), more than the whole check the
loader makes, and even protobuf's import (~0.07 s) is a large part of it: what is read here is read from the
wire (the few ONNX fields that matter, every length checked against its enclosing message), and the probe
model is serialized by hand.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator

from .names import PREPACKED_ENTRY

# /proc/cpuinfo flags that select MLAS kernels (SGEMM packing, NCHWc block size, int8 paths).
CPU_FLAGS = (
    "sse4_1",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "asimddp",
    "i8mm",
    "bf16",
    "sve",
    "sme",
)


def cpu_features() -> list[str]:
    from ...._runtimes.cpuinfo import cpu_flags

    flags = cpu_flags()
    return [f for f in CPU_FLAGS if f in flags]


def _tag(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _msg(number: int, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return _tag(number, 2) + _varint(len(body)) + body


def _int(number: int, v: int) -> bytes:
    return _tag(number, 0) + _varint(v)


def _str(number: int, v: str) -> bytes:
    return _msg(number, v.encode())


def _probe_model() -> bytes:
    """An 8-channel 1x1 Conv (opset 17, IR 8) with an all-ones fp32 weight, serialized by hand (ModelProto:
    ir_version 1, graph 7, opset_import 8; GraphProto: node 1, name 2, initializer 5, input 11, output 12)."""

    def value_info(name: str, dims: tuple[int, ...]) -> bytes:
        shape = _msg(2, *(_msg(1, _int(1, d)) for d in dims)) if dims else b""
        return _str(1, name) + _msg(2, _msg(1, _int(1, 1), shape))  # type.tensor_type: elem_type FLOAT

    weight = b"".join(_int(1, d) for d in (8, 8, 1, 1)) + _int(2, 1) + _str(8, "w") + _msg(9, b"\x00\x00\x80\x3f" * 64)
    graph = (
        _msg(1, _str(1, "x"), _str(1, "w"), _str(2, "y"), _str(4, "Conv"))
        + _str(2, "probe")
        + _msg(5, weight)
        + _msg(11, value_info("x", (1, 8, 4, 4)))
        + _msg(12, value_info("y", ()))
    )
    return _int(1, 8) + _msg(7, graph) + _msg(8, _str(1, ""), _int(2, 17))


# A domain every onnxruntime registers (its internal NHWC ops) whose newest opset follows ONNX's: a model that
# imports it at the converting release's newest version is refused at load by every release that knows fewer
# opsets ("Opset N is under development ... will not guarantee backward compatibility"): ``opset_stamp``.
STAMP_DOMAIN = "com.ms.internal.nhwc"


def _stamp_probe(version: int) -> bytes:
    """A Relu model (opset 17, IR 8) that also imports ``STAMP_DOMAIN`` at ``version``."""

    def value_info(name: str) -> bytes:
        return _str(1, name) + _msg(2, _msg(1, _int(1, 1)))

    graph = _msg(1, _str(1, "x"), _str(2, "y"), _str(4, "Relu")) + _str(2, "stamp")
    graph += _msg(11, value_info("x")) + _msg(12, value_info("y"))
    return (
        _int(1, 8)
        + _msg(7, graph)
        + _msg(8, _str(1, ""), _int(2, 17))
        + _msg(8, _str(1, STAMP_DOMAIN), _int(2, version))
    )


def opset_stamp() -> int:
    """The newest ``STAMP_DOMAIN`` opset this onnxruntime loads (0: none found), measured by loading probes."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4

    def loads(version: int) -> bool:
        try:
            ort.InferenceSession(_stamp_probe(version), so, providers=["CPUExecutionProvider"])
            return True
        except Exception:  # noqa: BLE001 - ORT's refusal of an opset it does not know is what is measured
            return False

    low, high = 0, 1
    while loads(high) and high < 1 << 10:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if loads(mid) else (low, mid)
    return low


def nchwc_block_size(directory: str | None = None) -> int:
    """Measured, not guessed: ORT pads the output channels of an NCHWc Conv weight to its block size,
    so an 8-channel 1x1 Conv's reordered weight has block-size rows (0: no NCHWc on this CPU).
    ``directory``: where its scratch file goes (the converter's locked staging; default $TMPDIR)."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        so = ort.SessionOptions()
        so.optimized_model_filepath = f"{tmp}/probe.onnx"
        so.log_severity_level = 3
        ort.InferenceSession(_probe_model(), so, providers=["CPUExecutionProvider"])
        with open(f"{tmp}/probe.onnx", "rb") as f:
            optimized = f.read()
    nchwc, block = False, 0
    for number, wire, a, b in _fields(optimized, 0, len(optimized)):
        if number != 7 or wire != 2:
            continue
        for n2, w2, a2, b2 in _fields(optimized, a, b):
            if n2 == 1 and w2 == 2:  # node: domain 7
                nchwc |= any(
                    n3 == 7 and w3 == 2 and optimized[a3:b3] == b"com.microsoft.nchwc"
                    for n3, w3, a3, b3 in _fields(optimized, a2, b2)
                )
            elif n2 == 5 and w2 == 2:  # initializer: dims 1 (plain or packed)
                dims = []
                for n3, w3, a3, b3 in _fields(optimized, a2, b2):
                    if n3 == 1 and w3 == 0:
                        dims.append(b3)
                    elif n3 == 1 and w3 == 2:
                        dims += _varint_values(optimized, a3, b3)
                if len(dims) == 4:
                    block = max(block, dims[0])
    return block if nchwc else 0


def _read_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``data[pos]`` (not reaching ``end``) and the position after it."""
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated or overlong varint")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _varint_values(data: bytes, start: int, end: int) -> list[int]:
    """The values of a packed varint field."""
    out, pos = [], start
    while pos < end:
        v, pos = _read_varint(data, pos, end)
        out.append(v)
    return out


# Message fields that can hold a TensorProto, by message: field number -> message kind.
_MODEL, _GRAPH, _NODE, _ATTR, _FUNC, _SPARSE, _TENSOR, _TRAINING = range(8)
_CHILDREN: dict[int, dict[int, int]] = {
    _MODEL: {7: _GRAPH, 20: _TRAINING, 25: _FUNC},
    _TRAINING: {1: _GRAPH, 2: _GRAPH},
    _GRAPH: {1: _NODE, 5: _TENSOR, 15: _SPARSE},
    _NODE: {5: _ATTR},
    _ATTR: {5: _TENSOR, 6: _GRAPH, 10: _TENSOR, 11: _GRAPH, 22: _SPARSE, 23: _SPARSE},
    _FUNC: {7: _NODE, 11: _ATTR},
    _SPARSE: {1: _TENSOR, 2: _TENSOR},
}


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def _fields(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value start, value end or varint value) of each field in ``data[start:end]``."""
    pos = start

    def varint() -> int:
        nonlocal pos
        value, pos = _read_varint(data, pos, end)
        return value

    while pos < end:
        tag = varint()
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        if wire == 0:
            yield number, 0, pos, varint()
        elif wire == 2:
            n = varint()
            if n > end - pos:
                raise WireError("length runs past its message")
            yield number, 2, pos, pos + n
            pos += n
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            if pos > end:
                raise WireError("truncated fixed-width field")
        else:
            raise WireError(f"wire type {wire} (groups are not ONNX)")


def _tensor_entries(data: bytes) -> Iterator[tuple[bool, list[tuple[str, str]]]]:
    """(external, its ``external_data`` (key, value) entries) of every TensorProto in the serialized ModelProto
    ``data`` (initializers, attributes, sparse tensors, subgraphs, functions, training graphs), first seen first.
    A tensor counts as external as protobuf reads it (its last ``data_location`` is EXTERNAL).
    Raises WireError for bytes that are not a well-formed message."""
    stack = [(_MODEL, 0, len(data), 0)]
    while stack:
        kind, start, end, depth = stack.pop()
        if depth > 64:
            raise WireError("messages nested too deep")
        if kind == _TENSOR:
            external, entries = False, []
            for number, wire, a, b in _fields(data, start, end):
                if number == 14 and wire == 0:
                    external = b == 1
                elif number == 13 and wire == 2:
                    key = value = b""
                    for n2, w2, a2, b2 in _fields(data, a, b):
                        if w2 == 2 and n2 in (1, 2):
                            key, value = (data[a2:b2], value) if n2 == 1 else (key, data[a2:b2])
                    entries.append((key.decode("utf-8", "surrogateescape"), value.decode("utf-8", "surrogateescape")))
            yield external, entries
            continue
        children = _CHILDREN[kind]
        for number, wire, a, b in reversed(list(_fields(data, start, end))):
            if wire == 2 and number in children:
                stack.append((children[number], a, b, depth + 1))


def external_locations(data: bytes) -> list[str]:
    """The ``location`` of every external-data tensor in the serialized ModelProto ``data``, first seen first,
    read from the wire without protobuf (``_tensor_entries``); every ``location`` entry a tensor carries is
    listed, not only the one ORT would pick. Raises WireError for bytes that are not a well-formed message."""
    found: dict[str, None] = {}
    for external, entries in _tensor_entries(data):
        if external:  # no location at all: "" (which resolves to no file and is refused)
            found.update(dict.fromkeys([v for k, v in entries if k == "location"] or [""]))
    return list(found)


def packed_entries(data: bytes) -> list[tuple[str, str]]:
    """(location, value) of every ``prepacked_N`` entry of an external-data tensor in the serialized ModelProto
    ``data``: the packed copies a session of this model maps. Raises WireError for bytes that are not a
    well-formed message."""
    out = []
    for external, entries in _tensor_entries(data):
        location = next((v for k, v in reversed(entries) if k == "location"), "")
        if external:
            out += [(location, v) for k, v in entries if k.startswith(PREPACKED_ENTRY)]
    return out


def packed_buffers(value: str) -> list[tuple[int, int]] | None:
    """(offset, length) of each buffer of a ``prepacked_N`` entry (``<kernel>+<hash>|<offset>;<size>;...|...``),
    or None when it is not one."""
    _key, *parts = value.split("|")
    fields = [part.split(";") for part in parts]
    if not fields or any(len(f) < 2 or not (f[0].isdigit() and f[1].isdigit()) for f in fields):
        return None
    return [(int(f[0]), int(f[1])) for f in fields]


def packed_bytes(entries: Iterable[tuple[str, str]]) -> int:
    """Bytes of the packed copies ``(location, value)`` ``prepacked_N`` entries point at (``packed_entries``), each
    buffer counted once (tied weights and nodes of one kernel share theirs): what a session of the model maps
    from them, and what each session of its portable twin pre-packs for itself. Malformed entries count nothing."""
    seen: set[tuple[str, int, int]] = set()
    for location, value in entries:
        seen.update((location, *buf) for buf in packed_buffers(value) or [])
    return sum(length for _location, _offset, length in seen)


def nchwc_convs(data: bytes) -> int:
    """Conv nodes of the main graph of the serialized ModelProto ``data`` whose weight is a float 4-D
    initializer (what ORT_ENABLE_ALL reorders into an NCHWc copy), read from the wire without protobuf."""
    float4d: set[bytes] = set()
    convs: list[bytes] = []
    for number, wire, a, b in _fields(data, 0, len(data)):
        if number != 7 or wire != 2:
            continue
        for n2, w2, a2, b2 in _fields(data, a, b):
            if n2 == 5 and w2 == 2:  # initializer
                name, dtype, rank = b"", 0, 0
                for n3, w3, a3, b3 in _fields(data, a2, b2):
                    if n3 == 8 and w3 == 2:
                        name = data[a3:b3]
                    elif n3 == 2 and w3 == 0:
                        dtype = b3
                    elif n3 == 1 and w3 == 0:
                        rank += 1
                    elif n3 == 1 and w3 == 2:  # packed dims
                        rank += len(_varint_values(data, a3, b3))
                if dtype == 1 and rank == 4:  # FLOAT
                    float4d.add(name)
            elif n2 == 1 and w2 == 2:  # node
                op, domain, inputs = b"", b"", []
                for n3, w3, a3, b3 in _fields(data, a2, b2):
                    if w3 != 2:
                        continue
                    if n3 == 4:
                        op = data[a3:b3]
                    elif n3 == 7:
                        domain = data[a3:b3]
                    elif n3 == 1:
                        inputs.append(data[a3:b3])
                if op == b"Conv" and domain in (b"", b"ai.onnx") and len(inputs) > 1:
                    convs.append(inputs[1])
    return sum(1 for w in convs if w in float4d)


def fd_identity(fd: int) -> tuple[int, int, int, int, int]:
    """(dev, inode, size, mtime_ns, ctime_ns) of the file open on ``fd``: ctime cannot be set back by a writer."""
    return _identity(os.fstat(fd))


def path_identity(path: str | os.PathLike[str]) -> tuple[int, int, int, int, int]:
    """``fd_identity`` of the file at ``path`` (followed as ``os.stat`` follows it)."""
    return _identity(os.stat(path))


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def cpu_kind(features: list[str] | tuple[str, ...], machine: str = "") -> str:
    """The ISA level MLAS dispatches its kernels on, named from ``cpu_features`` (the blob's record or this
    machine): what "another CPU kind" means to a packed blob (AVX-512 and AVX2 pack with other block sizes)."""
    have = set(features)
    if {"asimd", "sve", "sme", "i8mm", "asimddp"} & have or machine in ("aarch64", "arm64"):
        return "arm64-" + "+".join(f for f in ("asimd", "asimddp", "i8mm", "bf16", "sve", "sme") if f in have)
    for kind, needs in (
        ("amx", {"amx_tile"}),
        ("avx512-vnni", {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
        ("avx512", {"avx512f", "avx512bw", "avx512vl"}),
        ("avx2-vnni", {"avx2", "fma", "avx_vnni"}),
        ("avx2", {"avx2", "fma"}),
        ("avx", {"avx"}),
        ("sse4.1", {"sse4_1"}),
    ):
        if needs <= have:
            return kind
    return machine or "unknown"


def _graph_fields(data: bytes) -> Iterator[tuple[int, int, int, int]]:
    for number, wire, a, b in _fields(data, 0, len(data)):
        if number == 7 and wire == 2:
            yield from _fields(data, a, b)


def metadata_props(data: bytes) -> dict[str, str]:
    """The ``metadata_props`` (ModelProto field 14) of the serialized model ``data``, read from the wire."""
    props: dict[str, str] = {}
    for number, wire, a, b in _fields(data, 0, len(data)):
        if number != 14 or wire != 2:
            continue
        key = value = b""
        for n2, w2, a2, b2 in _fields(data, a, b):
            if w2 == 2 and n2 == 1:
                key = data[a2:b2]
            elif w2 == 2 and n2 == 2:
                value = data[a2:b2]
        props[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return props


def overridable_initializers(data: bytes) -> int:
    """Initializers of the main graph that are also graph inputs (a caller may feed them): ORT advises removing
    them from the inputs (``remove_initializer_from_input.py``), which would let it fold what reads them."""
    inits: set[bytes] = set()
    inputs: set[bytes] = set()
    for n2, w2, a2, b2 in _graph_fields(data):
        if w2 != 2 or n2 not in (5, 11):
            continue
        for n3, w3, a3, b3 in _fields(data, a2, b2):
            if w3 == 2 and ((n2 == 5 and n3 == 8) or (n2 == 11 and n3 == 1)):
                (inits if n2 == 5 else inputs).add(data[a3:b3])
    return len(inits & inputs)
