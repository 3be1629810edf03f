"""ExecuTorch programs loaded so that their weights are shared: ``program(path)``.

``program`` maps the program and its ``.ptd`` (``executorch.runtime``'s ``MmapDataLoader``: shared by every
program and process) and loads each method with the XNNPACK backend's weights cache switched on, so that every
weight is packed once per process, not once per loaded program; each named-data key is bound to the digest of its
bytes before its packed weights are shared (``weightshare.formats.executorch.loader``). Packed weights are not
shared across processes: ExecuTorch's Python runtime cannot pass the per-load option its file-backed cache needs.
"""

from __future__ import annotations

import os

from .formats.executorch.loader import SharedProgram
from .formats.executorch.loader import program as _program

__all__ = ["SharedProgram", "program"]


def program(path: str | os.PathLike[str], data_path: str | os.PathLike[str] | None = None) -> SharedProgram:
    """Load an ExecuTorch program: weights mapped, XNNPACK's packed weights once per process.

    Args:
        path: the ``.pte``.
        data_path: its ``.ptd``; by default the one beside it holding the tensors it reads, if any.

    Returns:
        A ``SharedProgram``; ``load_method(name)`` returns ``executorch.runtime``'s ``Method``.

    Raises:
        Unsupported: ExecuTorch's Python runtime is not installed.
        InvalidModel: the program or its data file is damaged; a named-data key it reads is in no data file
            (checked before ExecuTorch loads it: the runtime fails or crashes on a missing key).

    Example:
        >>> method = program("model.pte").load_method("forward")
        >>> outputs = method.execute([torch.randn(1, 2048)])
    """
    return _program(path, data_path)
