"""The shared half of the pipeline: write -> emit, for one model or a whole zoo.

A format's ``prepare`` step (scan + plan) returns a ``PreparedModel``: the payloads
that go to the blob and an ``emit`` callback that writes the rewritten model.
``write_blob`` streams every payload of every model into one blob, in the container its
format declares (``Format.blob_container``; ``_write.write_payloads``, the one write path), so a zoo
of models that share weights stores each distinct payload once; each model's ``emit`` then gets the
blob's location and that model's ``Placements``.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, TypedDict

from ._atomic import TMP_PREFIX, OutputTransaction, clean_stale_temporaries
from ._paths import model_file_suffixes, resolve_inside
from ._write import BlobPayload, Placements, write_payloads
from .errors import OutputError, UsageError
from .options import ConvertOptions
from .report import ConversionReport

if TYPE_CHECKING:
    from ._container import BlobContainer

__all__ = ["BlobPayload", "BlobTarget", "Emit", "Placements", "PreparedModel", "blob_target", "write_models"]

DIGEST_CHARS = 12


class PreparedExtra(TypedDict, total=False):
    """What a format passes along with a prepared model."""

    blob_metadata: dict[str, str]  # written into the blob's metadata (a safetensors blob: its ``__metadata__``)
    plans: list[Any]  # the format's own plan, read back by that format only (TFLite: its BufferPlans)
    write_blob: WriteBlob  # what writes a zoo's blob instead of ``write_blob`` (a staged blob made it in place)


# (blob location relative to the model, where each payload landed, the transaction) -> files written
Emit = Callable[[str, Placements, OutputTransaction], list[Path]]


@dataclass
class PreparedModel:
    report: ConversionReport
    payloads: list[BlobPayload]
    emit: Emit
    name_prefix: str = ""  # before each payload's name in the blob's header (zoo mode: "<model stem>/")
    extra: PreparedExtra = field(default_factory=lambda: PreparedExtra())


def write_blob(
    models: list[PreparedModel],
    blob_path: Path,
    options: ConvertOptions,
    tx: OutputTransaction,
    container: BlobContainer,
    shown: Path | None = None,
) -> tuple[Path, int, str, list[Placements]]:
    """Stream every payload of ``models`` into one blob; return (its temporary, its size, its content digest,
    each model's placements).

    ``blob_path`` names the temporary; ``container`` is its layout (the format's ``blob_container``); ``shown``
    is the blob as error messages name it.
    """
    shown = shown or blob_path
    planned = [p.tensor for m in models for p in m.payloads]
    prefixes = [m.name_prefix for m in models for _ in m.payloads] if any(m.name_prefix for m in models) else None
    tmp = tx.new_file(blob_path)
    progress = options.progress
    try:
        fd = os.open(tmp, os.O_RDWR)
    except OSError as e:
        raise OutputError(f"cannot write the blob: {e.strerror}", shown) from None
    try:
        metadata = {k: v for m in models for k, v in m.extra.get("blob_metadata", {}).items()}
        blob = container.open(fd, planned, options.align, metadata, prefixes)
        if options.progress_total is not None:
            options.progress_total(sum(t.nbytes for t in planned))
        placements = []
        for m in models:
            placements.append(write_payloads(blob, m.payloads, m.report, progress))
            blob.expect_duplicates()  # a family's next model holds the same weights: none written twice
        size = blob.finish()
        # The header lists every payload's digest, dtype, shape and offset: equal digests, equal files.
        return tmp, size, blob.name_digest()[:DIGEST_CHARS], placements
    except OSError as e:  # EFBIG, ENOSPC, EIO: name the file being written, not just the errno
        raise OutputError(f"cannot write the blob: {e.strerror or e}", shown) from None
    except OutputError as e:
        if e.path is None:  # the blob writer knows the errno, not the file
            raise OutputError(e.message, shown) from None
        raise
    finally:
        os.close(fd)


# write_blob's signature: a writer that finds most payloads already in a file of its own (``--prepack``'s staged blob)
WriteBlob = Callable[
    [list[PreparedModel], Path, ConvertOptions, OutputTransaction, "BlobContainer", "Path | None"],
    tuple[Path, int, str, list[Placements]],
]


def write_models(
    models: list[PreparedModel],
    out_dir: Path,
    target: BlobTarget,
    options: ConvertOptions,
    tx: OutputTransaction,
    write: WriteBlob | None = None,
) -> None:
    """Write the blob (when any model has payloads) under its content-derived name, then every model file.
    ``write``: what writes the blob instead of ``write_blob`` (same arguments and result)."""
    size, blob_path, location = 0, None, ""
    moved = [bool(m.payloads) for m in models]
    placements = [Placements() for _ in models]
    if any(moved):
        tx.make_dirs(target.directory)
        if target.prefix:  # OUTDIR itself was cleaned by prepare_out_dir
            clean_stale_temporaries(target.directory)
        tmp, size, digest, placements = (write or write_blob)(
            models,
            target.directory / f"{target.base}{target.container.suffix}",
            options,
            tx,
            target.container,
            target.directory / f"{target.base}.<digest>{target.container.suffix}",
        )
        location, blob_path = target.named(digest)
        tx.retarget(tmp, blob_path)  # an earlier blob goes only as the outputs record proves (_outputs_record)
        for m in models:  # placed: what emit needs is recorded; 100,000s of payload objects go before it runs
            m.payloads = []
    for m, had_payloads, placed in zip(models, moved, placements):
        files = m.emit(location, placed, tx)
        if blob_path is not None and Path(blob_path).resolve() in {Path(f).resolve() for f in files}:
            # only a model input named like a blob gets here; refuse rather than commit one over the other
            raise UsageError(f"blob {blob_path.name!r} would overwrite the model file", m.report.model)
        m.report.outputs = [str(f) for f in files] + ([str(blob_path)] if had_payloads else [])
        m.report.blob_bytes = size


@dataclass
class BlobTarget:
    """Where a blob goes: ``directory/<base>.<digest><suffix>``, referenced from the model as ``prefix`` + that."""

    directory: Path
    base: str
    prefix: str  # the blob's directory relative to OUTDIR, as the model references it ("" or "sub/dir/")
    container: BlobContainer  # the blob's file layout, declared by the format (``Format.blob_container``)

    def named(self, digest: str) -> tuple[str, Path]:
        name = f"{self.base}.{digest}{self.container.suffix}"
        return self.prefix + name, self.directory / name


def blob_target(src: Path | None, out_dir: Path, blob_name: str | None, container: BlobContainer) -> BlobTarget:
    """Validate a blob name (``--blob``, ``--shared-blob``, or the default) and say where its blob goes.

    ``container`` is the format's ``blob_container``. ``NAME`` (the
    container's suffix stripped) becomes ``NAME.<digest12><suffix>``; the default NAME is
    ``<model stem>.weights``. The digest makes every blob name unique per content, so a blob is
    never rewritten in place and a reader that opened the old model still finds the old blob.
    """
    if blob_name is not None:
        name = blob_name
    elif src is not None:
        name = f"{src.stem}.weights"
    else:  # callers without a model (zoo mode) always pass the name
        raise UsageError("a blob name is needed when there is no model to name the blob after", out_dir)
    where = src if src is not None else out_dir
    path = resolve_inside(out_dir, name, "blob", origin=where)
    rel = PurePosixPath(name.replace("\\", "/"))
    if path == Path(out_dir).resolve() or rel.name in ("", ".") or name.endswith(("/", "\\")):
        raise UsageError(f"blob name {name!r} names a directory, not a file", where)
    if any(part.startswith(TMP_PREFIX) for part in rel.parts):
        raise UsageError(f"blob name {name!r} starts with {TMP_PREFIX!r}, which marks weightshare's temporaries", where)
    base = rel.name.removesuffix(container.suffix)
    if not base or base.startswith("."):
        raise UsageError(f"blob name {name!r} must start with a name (not a dot)", where)
    parent = rel.parent
    prefix = "" if str(parent) == "." else f"{parent.as_posix()}/"
    return BlobTarget(Path(out_dir) / parent, base, prefix, container)


def referenced_names(candidates: list[Path], model_dirs: set[Path]) -> set[str]:
    """The candidate file names that occur in any model file of ``model_dirs``."""
    if not candidates:
        return set()
    wanted = {c.name: c.name.encode() for c in candidates}
    suffixes = model_file_suffixes()
    found: set[str] = set()
    for d in model_dirs:
        if not d.is_dir():
            continue
        for f in d.iterdir():
            if (suffixes is not None and f.suffix not in suffixes) or f.name.startswith(TMP_PREFIX) or not f.is_file():
                continue
            found |= _names_in(f, wanted)
            if len(found) == len(wanted):
                return found
    return found


def _names_in(path: Path, wanted: dict[str, bytes]) -> set[str]:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return set()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return {name for name, raw in wanted.items() if m.find(raw) >= 0}
