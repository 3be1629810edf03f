"""The ``weightshare.ort_prepack`` record of a ``--prepack`` blob, read as untrusted input.

``convert --prepack`` writes the record into the blob's safetensors ``__metadata__``: what the packed
data is bound to (onnxruntime version, CPU) and the file names of the two models. Anyone can edit a
blob, so every reader (``weightshare.ort.session``, ``check``, ``verify``, re-conversion) goes through
``parse_record``: fields of the expected types, model names plain file names beside the blob's model
(never an absolute path, ``..`` or a directory), any problem one ``InvalidModel``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...._paths import plain_file_name
from ....errors import InvalidModel, UsageError
from ....report import JsonDict

METADATA_KEY = "weightshare.ort_prepack"  # in the blob's __metadata__: what the packed data is bound to
# in both models' metadata_props: the digest of the pair as converted, so a stale or foreign twin is refused
PAIR_KEY = "weightshare.prepack_pair"
PACKED_PREFIX = "ort.prepacked/"  # safetensors names of pre-packed MatMul/Gemm copies
_STRINGS = ("onnxruntime", "machine", "prepacked_model", "portable_model")
_OPTIONAL_STRINGS = ("optimization_level", "packed_prefix", "optimized_prefix", "cpu_kind", "session_options")
_DEFAULTS = {"packed_prefix": "ort.prepacked/", "optimized_prefix": "ort.optimized/"}


def name_from_prefix(name: str, prefixes: tuple[str, ...]) -> str | None:
    """``name`` from its packed or optimized prefix on: a model's own blob names start with one, a --shared-blob
    zoo's with the model's stem and "/" before it (``<stem>/ort.prepacked/...``); None for any other name."""
    if name.startswith(prefixes):
        return name
    tail = name.partition("/")[2]
    return tail if tail.startswith(prefixes) else None


def parse_record(raw: Any, where: str | os.PathLike[str]) -> JsonDict:
    """The validated record (``raw`` as found in the metadata: a JSON string), prefixes defaulted.

    Raises InvalidModel naming ``where`` (the blob) for anything but a well-formed record.
    """

    def bad(why: str) -> InvalidModel:
        return InvalidModel(f"its {METADATA_KEY} metadata {why}", where)

    if not isinstance(raw, str):
        raise bad("is not a JSON string")
    try:
        rec = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        raise bad("is not valid JSON") from None
    if not isinstance(rec, dict):
        raise bad("is not a JSON object")
    for key in _STRINGS:
        if not isinstance(rec.get(key), str):
            raise bad(f"has no string {key!r}")
    for key in _OPTIONAL_STRINGS:
        if key in rec and not isinstance(rec[key], str):
            raise bad(f"has a {key!r} that is not a string")
    features = rec.get("cpu_features")
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise bad("has no list of strings 'cpu_features'")
    if not isinstance(rec.get("nchwc_block"), int) or isinstance(rec.get("nchwc_block"), bool):
        raise bad("has no integer 'nchwc_block'")
    for key in ("prepacked_model", "portable_model"):
        if not plain_file_name(rec[key]) or not rec[key].endswith(".onnx"):
            raise bad(f"names {key} {rec[key]!r}, which is not a plain .onnx file name beside the model")
    if rec["portable_model"] == rec["prepacked_model"]:
        raise bad("names the prepacked model as its own portable model")
    twins = rec.get("portable_models", {})  # --prepack --shared-blob: every zoo model's portable twin
    if not isinstance(twins, dict):
        raise bad("has a 'portable_models' that is not an object")
    for model, twin in twins.items():
        for name in (model, twin):
            if not isinstance(name, str) or not plain_file_name(name) or not name.endswith(".onnx"):
                raise bad(f"names {name!r} in portable_models, which is not a plain .onnx file name beside the model")
        if model == twin:
            raise bad(f"names {model!r} as its own portable model")
    return {**_DEFAULTS, **rec, "portable_models": twins}


def portable_of(rec: JsonDict, model_name: str) -> str:
    """The portable twin of ``model_name`` in a validated record (a zoo's blob names one per model)."""
    twin = rec["portable_models"].get(model_name)
    return str(twin) if twin else str(rec["portable_model"])


def record_of_header(header: Any, where: str | os.PathLike[str]) -> JsonDict | None:
    """The validated record in a parsed safetensors header (``__metadata__`` included), None if it has none."""
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get(METADATA_KEY) in (None, ""):
        return None
    return parse_record(meta[METADATA_KEY], where)


def read_record_fd(fd: int, where: str | os.PathLike[str]) -> JsonDict | None:
    """The validated record of the safetensors blob open on ``fd`` (read with pread: the offset stays put);
    None when the file is not a safetensors blob or has no record."""
    from ...._safetensors import read_header  # here: the loaders import this module, and no blob writer

    try:
        header = json.loads(read_header(fd)[1])
    except (InvalidModel, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    return record_of_header(header, where)


def refuse_prepacked_model(src: Path, files: Iterable[str]) -> None:
    """Refuse to convert the prepacked model of a ``--prepack`` output (any model but the record's portable one
    referencing a blob with a record): its graph is ONNX Runtime's level-ALL, CPU-specific one (NCHWc nodes),
    so converting it again would write a "portable" model that is not portable."""
    for f in files:
        if Path(f) == Path(src):
            continue
        try:
            fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # the scan reports unreadable files itself
        try:
            rec = read_record_fd(fd, f)
        finally:
            os.close(fd)
        if rec is not None and rec["portable_model"] != Path(src).name:
            raise UsageError(
                "is the prepacked model of a --prepack output (ONNX Runtime's CPU-specific graph); convert "
                f"its portable model {rec['portable_model']} instead",
                src,
            )
