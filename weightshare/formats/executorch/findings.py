"""What ExecuTorch's XNNPACK backend copies per loaded program: ExecuTorch's finding code."""

from __future__ import annotations

from ..._findings import CodeInfo, Severity, TextEnum, register_codes

__all__ = ["CODES", "ExecutorchCode"]


class ExecutorchCode(TextEnum):
    """ExecuTorch's own finding codes (``Format.findings``); docs/ci.md lists them with the others."""

    XNNPACK_PACK_COPY = "executorch-xnnpack-pack-copy-per-program"


CODES: dict[TextEnum, CodeInfo] = {
    ExecutorchCode.XNNPACK_PACK_COPY: CodeInfo(
        Severity.WARNING,
        "ExecuTorch's XNNPACK backend packs the weights it reads into a private buffer per loaded program "
        "(XNNCompiler.cpp: xnn_create_runtime_v4 with no weights cache); the pip wheel builds it without "
        "ENABLE_XNNPACK_WEIGHTS_CACHE and `executorch.runtime` exposes no backend option.",
        "load with weightshare.formats.executorch.program(path) (XNNPACK's weights cache: packed once per process, "
        "keys bound to content), or export without the XNNPACK partitioner (portable kernels read the mapped "
        "weights in place)",
    ),
}

register_codes(CODES)  # known to Finding.of as soon as the codes exist, whether or not the registry was asked
