"""What ExecuTorch's XNNPACK backend copies per loaded program: ExecuTorch's finding code."""

from __future__ import annotations

from ..._findings import CodeInfo, Severity, TextEnum

__all__ = ["CODES", "ExecutorchCode"]


class ExecutorchCode(TextEnum):
    """ExecuTorch's own finding codes (``Format.findings``); docs/ci.md lists them with the others."""

    XNNPACK_PACK_COPY = "executorch-xnnpack-pack-copy-per-program"


CODES: dict[TextEnum, CodeInfo] = {
    ExecutorchCode.XNNPACK_PACK_COPY: CodeInfo(
        Severity.WARNING,
        "ExecuTorch's XNNPACK backend packs the weights it reads into a private buffer per loaded program "
        "(XNNCompiler.cpp: xnn_create_runtime_v4 with no weights cache); the pip wheel builds it without "
        "ENABLE_XNNPACK_WEIGHTS_CACHE and its Python runtime cannot set the weight_cache_enabled backend option.",
        "load each program once per process and share it, or export without the XNNPACK partitioner "
        "(portable kernels read the mapped weights in place), or use a C++ runtime built with "
        "EXECUTORCH_XNNPACK_ENABLE_WEIGHT_CACHE",
    ),
}
