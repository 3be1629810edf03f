"""ONNX TensorProto.DataType facts: element sizes and which typed field holds what.

Numbers are from onnx.proto (onnx 1.23). Bits rather than bytes so that the
sub-byte types (int4, uint4, float4e2m1, int2, uint2) pack as the spec says:
ceil(n * bits / 8) bytes, low bits first.
"""

from __future__ import annotations

from collections.abc import Iterable

FLOAT, UINT8, INT8, UINT16, INT16, INT32, INT64, STRING, BOOL, FLOAT16, DOUBLE = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11
UINT32, UINT64, COMPLEX64, COMPLEX128, BFLOAT16 = 12, 13, 14, 15, 16

BITS = {
    1: 32,
    2: 8,
    3: 8,
    4: 16,
    5: 16,
    6: 32,
    7: 64,
    9: 8,
    10: 16,
    11: 64,
    12: 32,
    13: 64,
    14: 64,
    15: 128,
    16: 16,
    17: 8,
    18: 8,
    19: 8,
    20: 8,
    21: 4,
    22: 4,
    23: 4,
    24: 8,
    25: 2,
    26: 2,
    27: 6,
    28: 6,
}

# numpy-style names used by the blob (safetensors dtype); others are stored as U8.
NAMES = {
    1: "float32",
    2: "uint8",
    3: "int8",
    4: "uint16",
    5: "int16",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
    12: "uint32",
    13: "uint64",
    16: "bfloat16",
    17: "float8_e4m3fn",
    19: "float8_e5m2",
}

# Typed fields (TensorProto field numbers) and the element width of the raw form.
FLOAT_DATA, INT32_DATA, INT64_DATA, DOUBLE_DATA, UINT64_DATA, RAW_DATA = 4, 5, 7, 10, 11, 9
TYPED_FIELDS = {
    FLOAT_DATA: "float_data",
    INT32_DATA: "int32_data",
    INT64_DATA: "int64_data",
    DOUBLE_DATA: "double_data",
    UINT64_DATA: "uint64_data",
}


def element_count(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def raw_nbytes(data_type: int, dims: tuple[int, ...]) -> int:
    bits = BITS[data_type]
    return (element_count(dims) * bits + 7) // 8


def typed_layout(field: int, data_type: int, dims: tuple[int, ...]) -> tuple[str, int, int] | None:
    """How a typed field decodes: (kind, value count, bytes per value in raw form), or None if invalid.

    kind is "copy" (packed fixed-width values already equal the raw bytes) or "varint".
    """
    n = element_count(dims)
    bits = BITS.get(data_type)
    if bits is None:
        return None
    if field == FLOAT_DATA and data_type in (FLOAT, COMPLEX64):
        return "copy", n * (2 if data_type == COMPLEX64 else 1), 4
    if field == DOUBLE_DATA and data_type in (DOUBLE, COMPLEX128):
        return "copy", n * (2 if data_type == COMPLEX128 else 1), 8
    if field == INT64_DATA and data_type == INT64:
        return "varint", n, 8
    if field == UINT64_DATA and data_type in (UINT32, UINT64):
        return "varint", n, bits // 8
    if field == INT32_DATA:
        if bits in (8, 16, 32) and data_type not in (FLOAT, UINT32, INT64, DOUBLE, COMPLEX64, COMPLEX128):
            return "varint", n, bits // 8
        if bits in (2, 4):  # one packed byte per int32 value, as onnx.helper.make_tensor writes them
            return "varint", (n * bits + 7) // 8, 1
    return None


def fp16_has_signalling_nan(chunks: Iterable[bytes | memoryview]) -> bool:
    """Whether any little-endian fp16 value in ``chunks`` (whole elements each) is a signalling NaN.

    Exponent all ones, quiet bit (0x0200) clear, rest of the mantissa non-zero: with the sign masked off that
    is exactly the range 0x7c01..0x7dff. Runs over every fp16 fold candidate before anything is written, so
    it is kept cheap: cache-sized blocks into one reused buffer, and the range test only when a block holds
    any NaN at all (max >= 0x7c01), which real weights almost never do. About 0.02 CPU s per 256 MiB.
    """
    import numpy as np

    block = 1 << 17
    tmp = np.empty(block, np.uint16)
    for chunk in chunks:
        u = np.frombuffer(chunk, "<u2")
        for i in range(0, len(u), block):
            part = u[i : i + block]
            t = tmp[: len(part)]
            np.bitwise_and(part, 0x7FFF, out=t)
            if len(t) and t.max() >= 0x7C01:
                t -= np.uint16(0x7C01)
                if (t < np.uint16(0x1FF)).any():
                    return True
    return False
