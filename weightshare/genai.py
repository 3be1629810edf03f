"""Open a converted onnxruntime-genai folder, falling back to the portable model where packed data cannot run.

    import weightshare.genai
    model = weightshare.genai.model("out/")   # an onnxruntime_genai.Model

onnxruntime-genai opens the decoder named by ``genai_config.json`` itself, with the session options written there,
so the fallback ``weightshare.ort.session`` makes for a ``--prepack`` model does not apply: on a CPU (or
onnxruntime version) the packed copies were not made for, ORT re-packs each MatMul/MatMulNBits weight at load,
finds that the stored copy differs and refuses the model ("ValidatePrePackedWeights ... do not match"), and
``og.Model`` raises. ``model`` checks first, like ``weightshare.ort.session`` (the blob's record against this
machine, the packed payloads against their recorded digests), and opens ``MODEL.portable.onnx`` instead through a
config overlay when they do not match or ORT refuses them: genai's own session options, default pre-packing
(outputs those of the original model; each ``og.Model`` then packs its own copy).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .errors import InvalidModel, UsageError
from .formats.onnx.ort.prepack_record import portable_of
from .ort import check_packed_payloads, mismatch, prepack_info

log = logging.getLogger("weightshare.genai")

__all__ = ["decoder_file", "model"]
CONFIG = "genai_config.json"


def decoder_file(folder: str | os.PathLike[str]) -> Path:
    """The decoder model ``genai_config.json`` names (``model.decoder.filename``).

    Args:
        folder: an onnxruntime-genai model folder.

    Returns:
        The decoder model's path inside ``folder``.

    Raises:
        InvalidModel: no readable genai_config.json, or its decoder filename leaves the folder.
    """
    path = Path(folder) / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        name = config["model"]["decoder"]["filename"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidModel(f"not an onnxruntime-genai folder: {CONFIG} names no decoder filename ({e})", path) from None
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise InvalidModel(f"{CONFIG}: decoder filename {name!r} is not a file inside the folder", path)
    return Path(folder) / name


def _why_not_packed(decoder: Path) -> tuple[str | None, str | None]:
    """(reason the packed model cannot run here or None, its portable twin's name or None for a plain model)."""
    found = prepack_info(decoder)
    if found is None:
        return None, None
    info, blob = found
    return mismatch(info) or check_packed_payloads(blob, info), portable_of(info, decoder.name)


def model(folder: str | os.PathLike[str]) -> Any:
    """An ``onnxruntime_genai.Model`` of a folder written by ``weightshare convert`` (``--prepack`` or not).

    Opens the folder as genai_config.json says when its decoder is a plain conversion, or a ``--prepack`` model
    whose packed data matches this machine; else the decoder's portable twin (one warning through logging).

    Args:
        folder: the converted onnxruntime-genai folder (``weightshare convert DIR -o OUT``).

    Returns:
        An ``onnxruntime_genai.Model``.

    Raises:
        UsageError: onnxruntime-genai is not installed.
        InvalidModel: the folder names no decoder, or the decoder's ``--prepack`` record cannot be trusted.
    """
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise UsageError("weightshare.genai needs onnxruntime-genai (pip install onnxruntime-genai)") from None
    decoder = decoder_file(folder)
    why, portable = _why_not_packed(decoder)
    if portable is None:
        return og.Model(str(folder))
    if why is None:
        try:
            return og.Model(str(folder))
        except RuntimeError as e:  # ORT's ValidatePrePackedWeights: fall back, not fail
            why = f"onnxruntime refused it ({str(e).splitlines()[0][:200]})"
    name = Path(decoder.parent / portable).relative_to(Path(folder)).as_posix()
    log.warning("weightshare: %s: not using its pre-packed weights: %s; opening %s instead", decoder.name, why, name)
    config = og.Config(str(folder))
    config.overlay(json.dumps({"model": {"decoder": {"filename": name}}}))
    return og.Model(config)
