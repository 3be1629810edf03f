"""The ``--unpack`` values TFLite implements, with their help text (``weightshare convert --help`` shows it)."""

from __future__ import annotations

UNPACK = {
    "sparse": "TFLite: DENSIFY of a constant sparse tensor becomes a dense constant",
    "dequantize": "TFLite: weight-only int8, DEQUANTIZE of an int8 constant, stored once as the fp32 values LiteRT "
    "computes",
}
