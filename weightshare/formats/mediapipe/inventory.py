"""What a MediaPipe ``.task`` bundle costs per task: its members read in place, through offsets into the bundle.

MediaPipe's Tasks API (1.2.2, measured with scripts/bench_task.py) reads each .tflite member in place (a task costs
no copy of the bundle) and runs it with the default XNNPACK delegate and no weight cache: every task packs each
member's weights (fp16 behind DEQUANTIZE packed as fp32) into private memory. A constant whose absolute file offset
is not a multiple of its element size (capped at 4) is copied per task besides (face_landmarker's fp16 members at
odd offsets: +3.4 MiB per task; its members converted to fp32 at offsets 2 mod 4: +6.4 MiB per task; at 2 mod 4
the fp16 members cost nothing more; scripts/bench_task.txt). Metadata members (``.binarypb``, ``.txt``) are small.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..._inventory import ModelInventory, PayloadInfo, alignment_of
from ...errors import InvalidModel
from .bundle import Bundle, Member, member_crc, read_bundle
from .findings import MediapipeCode

# the stable setting id (docs/ci.md): MediaPipe's Tasks API as it opens a bundle (XNNPACK, no weight cache)
TASKS = "mediapipe-tasks"
_XNNPACK = "litert-xnnpack"  # the TFLite inventory's setting for LiteRT's default XNNPACK delegate
_ITEMSIZE = {"FLOAT32": 4, "INT32": 4, "UINT32": 4, "INT64": 8, "UINT64": 8, "FLOAT64": 8}
_ITEMSIZE |= {"FLOAT16": 2, "BFLOAT16": 2, "INT16": 2, "UINT16": 2}


def needed_alignment(dtype: str) -> int:
    """The alignment MediaPipe needs to read a constant in place: its element size, capped at 4."""
    return min(_ITEMSIZE.get(dtype, 1), 4)


def is_tflite(fd: int, member: Member) -> bool:
    return member.size >= 8 and os.pread(fd, 4, member.data_offset + 4) == b"TFL3"


@dataclass
class MemberCost:
    """One .tflite member: its payloads (offsets absolute in the bundle) and what a task copies of them."""

    member: Member
    payloads: list[PayloadInfo]
    packed: int  # bytes XNNPACK packs per task
    misaligned: int  # bytes copied per task because they are not aligned in the file

    def misaligned_at(self, data_offset: int) -> int:
        """Bytes that would be misaligned were the member's data at ``data_offset``."""
        shift = data_offset - self.member.data_offset
        return sum(
            p.nbytes for p in self.payloads if p.offset is not None and (p.offset + shift) % needed_alignment(p.dtype)
        )


def member_costs(bundle: Bundle, hash_payloads: bool = False) -> tuple[list[MemberCost], list[Member]]:
    """The .tflite members with their per-task costs, and the other members (metadata)."""
    from ..tflite.inventory import inventory_file

    costs, others = [], []
    fd = os.open(bundle.path, os.O_RDONLY)
    try:
        for m in bundle.members:
            if hash_payloads and member_crc(fd, m) != m.crc32:
                raise InvalidModel(f"member {m.name!r} fails its CRC-32: the bundle is damaged", bundle.path)
            if not is_tflite(fd, m):
                others.append(m)
                continue
            try:
                inv = inventory_file(Path(bundle.path), hash_payloads, window=(m.data_offset, m.size))
            except InvalidModel as e:
                raise InvalidModel(f"member {m.name!r}: {e.message}", bundle.path) from None
            packed = sum(p.copies.get(_XNNPACK, 0) for p in inv.payloads)
            cost = MemberCost(m, inv.payloads, packed, 0)
            cost.misaligned = cost.misaligned_at(m.data_offset)
            costs.append(cost)
    finally:
        os.close(fd)
    return costs, others


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def inventory_bundle(path: Path, hash_payloads: bool = True) -> ModelInventory:
    path = Path(path)
    bundle = read_bundle(path)
    inv = ModelInventory(model=str(path), format="mediapipe", file_bytes=bundle.size)
    inv.settings = [TASKS]
    inv.default_setting = TASKS
    inv.default_how = "as MediaPipe's Tasks API opens it (XNNPACK, no weight cache)"
    costs, others = member_costs(bundle, hash_payloads)
    for cost in costs:
        for p in cost.payloads:
            _per_task(p, cost.member.name)
            inv.payloads.append(p)
        m = cost.member
        place = "aligned" if not cost.misaligned else f"{_mib(cost.misaligned)} of constants misaligned, copied"
        inv.notes.append(
            f"{m.name}: {m.size:,} bytes stored at offset {m.data_offset} ({place}); MediaPipe packs "
            f"{_mib(cost.packed)} of its weights per task"
        )
    for m in others:
        inv.payloads.append(
            PayloadInfo(
                name=m.name,
                dtype="UINT8",
                shape=(m.size,),
                nbytes=m.size,
                location="embedded",
                encoding="stored",
                offset=m.data_offset,
                alignment=alignment_of(m.data_offset),
                copies={TASKS: 0},
                stays_inline_because="MediaPipe metadata member",
            )
        )
        inv.notes.append(f"{m.name}: {m.size:,} bytes of MediaPipe metadata (not a model)")
    inv.notes.append(
        "MediaPipe's Tasks API reads every member in place and packs its weights per task; a rebuilt bundle saves "
        "only the copies of misaligned constants. To share the weights, convert the .tflite members and load them "
        "through weightshare.litert"
    )
    return inv


def _per_task(p: PayloadInfo, member: str) -> None:
    """A member's payload as MediaPipe pays for it: XNNPACK's packing (with any DEQUANTIZE), and a copy when the
    constant is not aligned in the file."""
    packed = p.copies.get(_XNNPACK, 0)
    misaligned = p.nbytes if p.offset is not None and p.offset % needed_alignment(p.dtype) else 0
    reason = p.copy_reason or p.unpacked_at_load
    p.name = f"{member}/{p.name}"
    p.copies = {TASKS: packed + misaligned}
    p.copied_per_session = packed + misaligned
    p.unpacked_at_load, p.would_move = "", False
    p.location, p.file = "embedded", ""  # appended after its flatbuffer or not, a member's buffer is in the bundle
    p.encoding = "stored" if p.encoding in ("inline", "appended") else p.encoding
    p.stays_inline_because = "read in place from the bundle by MediaPipe"
    if misaligned:
        p.copy_code, p.copy_bytes = MediapipeCode.UNALIGNED_COPY.value, {TASKS: misaligned}
        p.copy_reason = f"not {needed_alignment(p.dtype)}-byte aligned in the bundle: MediaPipe copies it per task"
    elif packed:
        p.copy_code, p.copy_bytes = MediapipeCode.PACK_COPY.value, {TASKS: packed}
        p.copy_reason = (reason or "weights packed by XNNPACK").replace("per interpreter", "per MediaPipe task")
    else:
        p.copy_code, p.copy_reason, p.copy_bytes = "", "", {}
