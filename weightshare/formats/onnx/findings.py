"""What ONNX Runtime copies per session, and the --prepack records it refuses: ONNX's finding codes."""

from __future__ import annotations

from ..._findings import CodeInfo, Severity, TextEnum, register_codes

__all__ = ["CODES", "OnnxCode"]


class OnnxCode(TextEnum):
    """ONNX's own finding codes (``Format.findings``); docs/ci.md lists them with the others."""

    ORT_NCHWC_COPY = "ort-nchwc-copy-per-session"
    ORT_PREPACK_COPY = "ort-prepack-copy-per-session"
    BAD_PREPACKED_ENTRY = "bad-prepacked-entry"
    BAD_PREPACK_RECORD = "bad-prepack-record"
    ORT_SESSION_STATE = "ort-session-state"


CODES: dict[TextEnum, CodeInfo] = {
    OnnxCode.ORT_NCHWC_COPY: CodeInfo(
        Severity.ERROR,
        "ONNX Runtime's NCHWc layout transformer (graph optimization level ORT_ENABLE_ALL, the "
        "default) copies these Conv weights into every session, even with session.disable_prepacking=1.",
        "convert with --prepack, or create sessions with graph_optimization_level=ORT_ENABLE_EXTENDED (and "
        "session.disable_prepacking=1)",
    ),
    OnnxCode.ORT_PREPACK_COPY: CodeInfo(
        Severity.WARNING,
        "With default session options ONNX Runtime (MLAS) pre-packs a private copy of every "
        "constant MatMul/Gemm B weight per session.",
        "create sessions with session.disable_prepacking=1, or convert with --prepack",
    ),
    OnnxCode.BAD_PREPACKED_ENTRY: CodeInfo(
        Severity.ERROR,
        "A prepacked_N external-data entry of a --prepack model does not point at the packed copy the blob "
        "records for its tensor: ONNX Runtime refuses the model at load (ValidatePrePackedWeights) or maps "
        "another weight's packed bytes.",
        "re-run weightshare convert MODEL -o OUT --prepack from the original model",
    ),
    OnnxCode.BAD_PREPACK_RECORD: CodeInfo(
        Severity.ERROR,
        "The weightshare.ort_prepack record in the blob's metadata is malformed or names a model outside the "
        "model's directory: weightshare.ort.session refuses the model (no fallback).",
        "re-run weightshare convert MODEL -o OUT --prepack from the original model",
    ),
    OnnxCode.ORT_SESSION_STATE: CodeInfo(
        Severity.INFO,
        "Measured: beyond its weights, one more ONNX Runtime session keeps this much of its own state (the graph, "
        "kernel objects, value maps, execution plans: pages dense with pointers, holding no weight bytes), which "
        "grows with the node count. It is not a weight copy and is not counted as one; the line gives the "
        "per-mapping breakdown and any weight bytes found copied.",
        "none needed for sharing: it is the runtime's bookkeeping, not weights (it grows with the sessions "
        "opened, so threads sharing one session cost less than one session each)",
    ),
}

register_codes(CODES)  # known to Finding.of as soon as the codes exist, whether or not the registry was asked
