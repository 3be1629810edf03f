"""ONNX inventory: the scan and the plan of `convert`, reported instead of executed.

ONNX Runtime copies every embedded initializer into its own heap tensor per
session, constant-folds Cast(fp16 -> float) of an initializer into a new fp32
heap tensor per session, and decodes typed fields; external data at an offset it
can map is shared (DESIGN.md 1).
"""

from __future__ import annotations

import os
from pathlib import Path

from ...blob import recorded_checksums
from ...errors import WeightshareError
from ...inventory import ModelInventory, PayloadInfo, alignment_of, sha256_of
from ...options import ConvertOptions
from ...tensors import FileRange
from . import dtypes
from .convert import load_skeleton, plan
from .fold import fold_fp16_casts, shape_tensor_names
from .graph import collect_sites
from .scan import Scanner, TensorRef
from .wire import WireFile

DTYPE_NAMES = {v: k for k, v in __import__("onnx").TensorProto.DataType.items()}


class _LenientScanner(Scanner):
    """Records a broken external reference as a finding instead of stopping the whole inspection."""

    def __init__(self, wf, model_dir):
        super().__init__(wf, model_dir)
        self.problems: dict[int, tuple[str, str]] = {}  # ref index -> (location, problem)

    def _external_range(self, name, info, expected):
        try:
            return super()._external_range(name, info, expected)
        except WeightshareError as e:
            self.problems[len(self.refs)] = (info.get("location", ""), e.message)
            return FileRange(self.wf.path, 0, 0)


def inventory_file(path: Path, hash_payloads: bool = True) -> ModelInventory:
    inv = ModelInventory(model=str(path), format="onnx", file_bytes=path.stat().st_size)
    with WireFile(path) as wf:
        scanner = _LenientScanner(wf, path.resolve().parent)
        skeleton = scanner.scan()
    refs: list[TensorRef] = scanner.refs
    model = load_skeleton(skeleton, path)
    sites = collect_sites(model)
    names = {i: site.name for i, site in sites.items()}  # before folding renames them
    folded, _ = fold_fp16_casts(model, sites)  # on this private copy: tells which Casts ORT would fold per session
    placements = plan(refs, sites, folded, shape_tensor_names(model), ConvertOptions())
    external_files = set()
    to_hash = []
    for p in placements:
        ref = p.ref
        info = PayloadInfo(name=names[ref.index], dtype=DTYPE_NAMES.get(ref.data_type, str(ref.data_type)),
                           shape=ref.dims, nbytes=ref.nbytes_in, location="embedded")
        if ref.field == 0:
            info.location = "external"
            location, problem = scanner.problems.get(ref.index, ("", ""))
            if problem:
                info.file, info.problem, info.nbytes = location, problem, ref.native_nbytes
            else:
                part = ref.parts[0]
                info.file = os.path.relpath(part.path, path.resolve().parent)
                info.offset = part.offset
                info.alignment = alignment_of(part.offset)
                external_files.add(info.file)
        else:
            info.offset = ref.parts[0].offset if ref.parts else None
            info.encoding = "raw_data" if ref.field == dtypes.RAW_DATA else dtypes.TYPED_FIELDS[ref.field]
            info.copied_per_session = ref.native_nbytes
        if p.fold:
            info.unpacked_at_load = f"Cast {info.dtype.lower()}->float folded per session"
            info.copied_per_session = ref.native_nbytes * 2  # the fp32 copy (plus the embedded one, if any)
            if ref.field != 0:
                info.copied_per_session += ref.native_nbytes
        info.would_move = p.external and (ref.field != 0 or p.fold)
        info.stays_inline_because = p.reason
        if hash_payloads and not info.problem:
            to_hash.append((info, ref.parts[0] if len(ref.parts) == 1 else ref.native_source()))
        inv.payloads.append(info)
    inv.external_files = sorted(external_files)
    sums = {name: recorded_checksums(str(path.resolve().parent / name)) for name in external_files}
    for info in inv.payloads:
        if info.location == "external" and info.file in sums:
            info.recorded_sha256 = sums[info.file].get(info.offset, "")
    for info, source in to_hash:  # in the recorded digest's kind (BLAKE3 or SHA-256), so that the two compare
        info.sha256 = sha256_of(source, info.recorded_sha256)
    return inv
