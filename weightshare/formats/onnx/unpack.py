"""The ``--unpack`` values ONNX implements, with their help text (``weightshare convert --help`` shows it)."""

from __future__ import annotations

ORT_CPU = "ort-cpu"  # the --unpack value of ort/cpu.py
UNPACK = {
    ORT_CPU: "ONNX: store fp16 weights as the fp32 copies ONNX Runtime's CPU provider makes per session; "
    "CPU-specific, a GPU provider would run fp16",
}
