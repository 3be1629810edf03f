"""ONNX Runtime's own machinery: pre-packing (``--prepack``), the ``--unpack ort-cpu`` rewrite, and what they need.

The ONNX format's conversion (``formats/onnx/convert.py``) writes a model ONNX Runtime maps; the modules here run
ONNX Runtime itself on it, in bounded children: ``prepack`` (the packed blob and its record, ``prepack_record``),
``segments`` + ``child`` (the graph optimized in segments), ``cpu`` (the ort-cpu rewrite and its rounding check),
``reload`` (the written model reloaded), ``probe`` + ``verdict`` (what a loader checks before trusting a packed blob),
``limits`` (the children's bounds), ``fold_bound`` (constant folding refused beyond the model's size), ``types``.
Internal, as the whole format folder is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ....options import ConvertOptions
    from ..convert import CpuUnpack


def cpu_unpack_step(options: ConvertOptions) -> CpuUnpack | None:
    """The ``--unpack ort-cpu`` step ``convert.prepare`` takes, when ``options`` ask for it (imported only then:
    subprocess, tempfile and importlib.metadata are not on every conversion's path)."""
    from ..unpack import ORT_CPU

    if ORT_CPU not in options.unpack or options.keep_packed:
        return None
    from .cpu import unpack_for_cpu

    return unpack_for_cpu
