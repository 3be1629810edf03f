"""What MediaPipe's Tasks API copies per task: the bundle format's finding codes."""

from __future__ import annotations

from ..._findings import CodeInfo, Severity, TextEnum, register_codes

__all__ = ["CODES", "MediapipeCode"]


class MediapipeCode(TextEnum):
    """MediaPipe bundles' own finding codes (``Format.findings``); docs/ci.md lists them with the others."""

    PACK_COPY = "mediapipe-pack-copy-per-task"
    UNALIGNED_COPY = "mediapipe-unaligned-copy-per-task"


CODES: dict[TextEnum, CodeInfo] = {
    MediapipeCode.PACK_COPY: CodeInfo(
        Severity.WARNING,
        "MediaPipe's Tasks API runs every .tflite member with XNNPACK and packs its weights (fp16 dequantized to "
        "fp32) into a private copy per task; its Python API has no weight-cache option, so no rebuilt bundle "
        "shares them.",
        "to share: unzip the .tflite members, weightshare convert MEMBER.tflite -o OUT --prepack, and load them "
        "through weightshare.litert",
    ),
    MediapipeCode.UNALIGNED_COPY: CodeInfo(
        Severity.ERROR,
        "Constants of a .tflite member sit at file offsets not aligned to their element size (4 bytes at most): "
        "MediaPipe copies them into private memory per task instead of reading them in place.",
        "weightshare convert BUNDLE.task -o OUT (the same members, each at a 64 KiB-aligned offset)",
    ),
}

register_codes(CODES)  # known to Finding.of as soon as the codes exist, whether or not the registry was asked
