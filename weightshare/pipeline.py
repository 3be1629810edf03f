"""The shared half of the pipeline: write -> emit, for one model or a whole zoo.

A format's ``prepare`` step (scan + plan) returns a ``PreparedModel``: the payloads
that go to the blob, each with a callback that records where it landed, and an
``emit`` callback that writes the rewritten model. ``write_blob`` streams every
payload of every model into one safetensors blob, so a zoo of models that share
weights stores each distinct payload once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .atomic import OutputTransaction
from .blob import BlobEntry, PlannedTensor, SafetensorsBlob
from .errors import UsageError
from .options import ConvertOptions
from .paths import resolve_inside
from .report import ConversionReport
from .tensors import PayloadSource


@dataclass
class BlobPayload:
    tensor: PlannedTensor  # name, dtype, shape and size in the blob
    source: PayloadSource  # bytes in the runtime's native form
    nbytes_in: int  # size as found in the input (before unpacking)
    placed: Callable[[BlobEntry], None]  # records the blob range in the model


@dataclass
class PreparedModel:
    report: ConversionReport
    payloads: list[BlobPayload]
    emit: Callable[[str, OutputTransaction], list[Path]]  # (blob location relative to the model) -> files written
    name_prefix: str = ""
    extra: dict = field(default_factory=dict)


def write_blob(models: list[PreparedModel], blob_path: Path, options: ConvertOptions, tx: OutputTransaction) -> int:
    """Stream every payload of ``models`` into one blob at ``blob_path``; return the blob size."""
    for m in models:
        for p in m.payloads:
            if m.name_prefix:
                p.tensor.name = f"{m.name_prefix}{p.tensor.name}"
    planned = [p.tensor for m in models for p in m.payloads]
    tmp = tx.new_file(blob_path)
    fd = os.open(tmp, os.O_RDWR)
    try:
        metadata = {k: v for m in models for k, v in m.extra.get("blob_metadata", {}).items()}
        blob = SafetensorsBlob(fd, planned, options.align, metadata=metadata)
        if options.progress_total is not None:
            options.progress_total(sum(t.nbytes for t in planned))
        for m in models:
            written_before = blob.bytes_written
            r = m.report
            for p in m.payloads:
                entry = blob.add(p.tensor, p.source, progress=options.progress)
                p.placed(entry)
                r.tensors_moved += 1
                r.bytes_in += p.nbytes_in
                r.bytes_out += entry.nbytes
                if entry.duplicate:
                    r.deduplicated += 1
                    r.deduplicated_bytes += entry.nbytes
            r.bytes_written = blob.bytes_written - written_before
        return blob.finish()
    finally:
        os.close(fd)


def write_models(models: list[PreparedModel], out_dir: Path, blob_name: str, blob_path: Path,
                 options: ConvertOptions, tx: OutputTransaction) -> None:
    """Write the blob (when any model has payloads), then every model file."""
    size = 0
    if any(m.payloads for m in models):
        blob_path.parent.mkdir(parents=True, exist_ok=True)
        size = write_blob(models, blob_path, options, tx)
    for m in models:
        files = m.emit(blob_name, tx)
        m.report.outputs = [str(f) for f in files] + ([str(blob_path)] if m.payloads else [])
        m.report.blob_bytes = size


def blob_target(src: Path, out_dir: Path, blob_name: str | None) -> tuple[str, Path]:
    """The blob's name as the model will reference it, and its path; it must stay inside ``out_dir``."""
    name = blob_name or f"{src.stem}.weights.safetensors"
    path = resolve_inside(out_dir, name, "blob")
    if path == (out_dir / src.name).resolve():
        raise UsageError(f"blob name {name!r} would overwrite the model file", src)
    return name, out_dir / name
