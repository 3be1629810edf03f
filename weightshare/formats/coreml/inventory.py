"""Core ML inventory: every ``BlobFileValue`` of an ML Program, where its payload sits and what `convert` would change.

Core ML memory-maps weight.bin, so a payload is shared by every model instance and
every function that references it; nothing is copied per load. What costs memory is
building the package: coremltools' ``save_multifunction`` loads each source's weights
(one full copy per function), which ``weightshare merge`` streams instead.

A broken reference (missing weight file, a name outside the package, a bad record,
an offset past the end) becomes ``PayloadInfo.problem``, a finding for ``check``;
only a package that cannot be read at all (manifest, spec) raises.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from google.protobuf.message import Message

from ..._findings import problem_code
from ..._inventory import ModelInventory, PayloadInfo, alignment_of, payload_digest
from ...errors import InvalidModel, UnsafePath, WeightshareError
from ...options import ConvertOptions
from .convert import MAX_DEPTH
from .milblob import BlobRecord, WeightFile
from .package import MODEL_PATH_PREFIX, Package, read_package, resolve_blob_file, spec_protos

if TYPE_CHECKING:
    from coremltools.proto import MIL_pb2

VALUE = "CoreML.Specification.MILSpec.Value"
OPERATION = "CoreML.Specification.MILSpec.Operation"

# What a constexpr op's payloads are; the role (the input or attribute name) follows, e.g. "palettized indices".
ENCODINGS = {
    "constexpr_lut_to_dense": "palettized",
    "constexpr_sparse_to_dense": "sparse",
    "constexpr_affine_dequantize": "affine",
    "constexpr_blockwise_shift_scale": "blockwise",
    "constexpr_lut_to_sparse": "palettized sparse",
    "constexpr_sparse_blockwise_shift_scale": "sparse blockwise",
    "constexpr_cast": "cast",
}


@dataclass
class BlobSite:
    """One ``Value`` holding a ``BlobFileValue``, with the op (if any) and the input/attribute name it sits under."""

    value: MIL_pb2.Value
    scope: str  # function name ("" for program attributes)
    op: MIL_pb2.Operation | None
    role: str

    @property
    def name(self) -> str:
        if self.op is None:
            return f"{self.scope or 'program'}:{self.role}"
        out = self.op.outputs[0].name if self.op.outputs else self.op.type
        return out if self.op.type == "const" and self.role == "val" else f"{out}.{self.role}"

    @property
    def encoding(self) -> str:
        if self.op is None:
            return "attribute"
        if self.op.type == "const":
            return "raw"
        return f"{ENCODINGS.get(self.op.type, self.op.type)} {self.role}"


def blob_sites(
    message: Message,
    origin: Path | None = None,
    scope: str = "",
    op: MIL_pb2.Operation | None = None,
    role: str = "",
    depth: int = 0,
) -> Iterator[BlobSite]:
    """Yield a ``BlobSite`` for every ``BlobFileValue`` below ``message``, in field order (convert's order)."""
    if depth > MAX_DEPTH:
        raise InvalidModel(f"program nesting is deeper than {MAX_DEPTH} levels", origin)
    kind = message.DESCRIPTOR.full_name
    if kind == VALUE and message.WhichOneof("value") == "blobFileValue":
        yield BlobSite(message, scope, op, role)
        return
    if kind == OPERATION:
        op, role = message, ""
    for fd, value in message.ListFields():
        if fd.message_type is None:
            continue
        if fd.message_type.GetOptions().map_entry:
            if fd.message_type.fields_by_name["value"].message_type is None:
                continue
            children: list[tuple[str | None, Message]] = [(k, value[k]) for k in sorted(value)]
        elif fd.is_repeated:
            children = [(None, v) for v in value]
        else:
            children = [(None, value)]
        for key, child in children:
            child_scope, child_role = scope, role
            if key is not None and fd.name == "functions":
                child_scope = key
            elif key is not None and fd.name in ("inputs", "attributes"):
                child_role = key
            yield from blob_sites(child, origin, child_scope, op, child_role, depth + 1)


def _declared(value: MIL_pb2.Value) -> tuple[str, tuple[int, ...]]:
    """(dtype, shape) from the value's type; -1 for a dimension that is not a constant."""
    _, MIL_pb2 = spec_protos()
    tt = value.type.tensorType
    dtype = MIL_pb2.DataType.Name(tt.dataType).lower() if tt.dataType in MIL_pb2.DataType.values() else str(tt.dataType)
    shape = tuple(d.constant.size if d.WhichOneof("dimension") == "constant" else -1 for d in tt.dimensions)
    return dtype, shape


def _package_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            total += st.st_size
    return total


class BlobLocator:
    """Resolves ``BlobFileValue`` references; weight files are opened (and their headers checked) once."""

    def __init__(self, pkg: Package):
        self.pkg = pkg
        self.root = pkg.root.resolve()
        self._files: dict[Path, WeightFile | WeightshareError] = {}

    def locate(self, file_name: str, offset: int) -> tuple[Path, WeightFile, BlobRecord]:
        """(path, WeightFile, record); raises WeightshareError for every broken reference."""
        path = resolve_blob_file(self.pkg, file_name)
        wf = self._files.get(path)
        if wf is None:
            try:
                wf = WeightFile(path)
            except WeightshareError as e:
                wf = e
            self._files[path] = wf
        if isinstance(wf, WeightshareError):
            raise wf
        return path, wf, wf.record(offset)

    def relative(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    def shown(self, file_name: str) -> str:
        """A BlobFileValue name as a package-relative path when it has the ``@model_path/`` form, else as it is."""
        if not file_name.startswith(MODEL_PATH_PREFIX):
            return file_name
        return f"{self.relative(self.pkg.model_dir)}/{file_name.removeprefix(MODEL_PATH_PREFIX)}"


def inventory_file(path: Path, hash_payloads: bool = True) -> ModelInventory:
    path = Path(path)
    pkg = read_package(path)
    inv = ModelInventory(model=str(path), format="coreml", file_bytes=_package_bytes(path))
    policy = ConvertOptions().align
    locator = BlobLocator(pkg)
    hashes: dict[tuple[Path, int], str] = {}  # (file, record offset) -> sha256: one record referenced twice
    # (dtype, padding, nbytes, sha256) -> first record with those bytes
    stored: dict[tuple[int, int, int, str], tuple[Path, int]] = {}
    files = set()
    qualify = len(pkg.spec.mlProgram.functions) > 1  # op names repeat across functions
    for site in blob_sites(pkg.spec.mlProgram, pkg.model_path):
        bfv = site.value.blobFileValue
        dtype, shape = _declared(site.value)
        name = f"{site.scope}/{site.name}" if qualify and site.op is not None else site.name
        info = PayloadInfo(
            name=name,
            dtype=dtype,
            shape=shape,
            nbytes=0,
            location="external",
            encoding=site.encoding,
            file=locator.shown(bfv.fileName),
        )
        try:
            file, wf, rec = locator.locate(bfv.fileName, bfv.offset)
            source = wf.payload(rec)
        except WeightshareError as e:
            info.problem = e.message
            # never stat a name that failed the containment check
            exists = (
                not isinstance(e, UnsafePath)
                and (pkg.model_dir / bfv.fileName.removeprefix(MODEL_PATH_PREFIX)).is_file()
            )
            info.problem_code = problem_code(e, exists).value
            inv.payloads.append(info)
            continue
        info.file = locator.relative(file)
        files.add(info.file)
        info.dtype, info.nbytes = rec.dtype_name, rec.nbytes
        info.offset, info.alignment = rec.data_offset, alignment_of(rec.data_offset)
        info.would_move = rec.data_offset % policy.for_size(rec.nbytes) != 0
        if hash_payloads:
            key = (file, rec.offset)
            if key not in hashes:
                hashes[key] = payload_digest(source)
            info.sha256 = hashes[key]
            first = stored.setdefault((rec.dtype, rec.padding_bits, rec.nbytes, info.sha256), key)
            info.would_move = info.would_move or first != key  # the same bytes stored twice: convert keeps one
        inv.payloads.append(info)
    inv.external_files = sorted(files)
    inv.settings = ["coreml"]
    inv.notes.append(
        "Core ML memory-maps weight.bin: payloads are shared by every load and function, nothing is "
        "copied per session (static: no Core ML runtime runs on Linux, so this is not measured); "
        "per-function copies happen when coremltools' save_multifunction builds a package, not at load"
    )
    return inv
