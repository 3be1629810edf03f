"""A bundle rewritten only where it saves: the same members, names and order, each at a 64 KiB-aligned offset.

MediaPipe packs every member's weights per task whatever the layout (no weight cache in its Tasks API), so the only
memory a rebuilt bundle can save is the copies of constants MediaPipe cannot read in place (misaligned in the file,
``inventory.needed_alignment``). The members' bytes are copied unchanged: converting them (fp16 -> fp32) would add
file pages and save nothing under XNNPACK (face_landmarker with converted members, 4 tasks: 224.8 vs 221.1 MiB).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import Unsupported, UsageError
from ...report import ConversionReport
from .bundle import CHUNK, aligned_offsets, read_bundle, write_bundle
from .inventory import member_costs

if TYPE_CHECKING:
    from ..._atomic import OutputTransaction
    from ..._verify import VerifyReport
    from ...options import ConvertOptions

ALIGN = 64 * 1024  # each member's data: Windows' allocation granularity, 16 KiB Apple and 64 KiB ARM64 pages
MIN_SAVING = 1 << 20  # per task: below this a rebuilt bundle saves nothing measurable (check's copy threshold)
_SHARE = (
    "to share its weights, unzip the .tflite members, `weightshare convert MEMBER.tflite -o OUT --prepack` and load "
    "them through weightshare.litert"
)


def planned_saving(src: Path) -> tuple[int, int, int]:
    """(bytes per task a rebuilt bundle saves, bytes MediaPipe packs per task either way, members) of ``src``."""
    bundle = read_bundle(src)
    costs, _ = member_costs(bundle)
    placed = dict(zip([m.name for m in bundle.members], aligned_offsets(bundle, ALIGN), strict=True))
    saving = sum(c.misaligned - c.misaligned_at(placed[c.member.name]) for c in costs)
    return saving, sum(c.packed for c in costs), len(bundle.members)


def kept_reason(src: Path) -> str:
    """Why ``src`` is best used as it is ("" when a rebuilt bundle saves at least MIN_SAVING per task)."""
    saving, packed, _ = planned_saving(src)
    if saving >= MIN_SAVING:
        return ""
    copied = f"{saving / (1 << 20):,.1f} MiB of misaligned constants" if saving else "no constant"
    return (
        f"a rebuilt bundle would save {copied} per task under MediaPipe's Tasks API, which reads the members in "
        f"place and packs their weights per task ({packed / (1 << 20):,.1f} MiB) whatever the layout; {_SHARE}"
    )


def convert_bundle(src: Path, out_dir: Path, options: ConvertOptions, tx: OutputTransaction) -> ConversionReport:
    if options.prepack or options.unpack or options.keep_packed:
        raise UsageError(
            "--prepack, --unpack and --keep-packed do not apply to a .task bundle (MediaPipe has no weight cache; "
            "its members are copied unchanged)",
            src,
        )
    why = kept_reason(src)
    if why:
        raise Unsupported(f"not rewritten: {why}", src)
    start = time.perf_counter()
    bundle = read_bundle(src)
    saving, packed, _ = planned_saving(src)
    final = out_dir / src.name
    write_bundle(bundle, tx.new_file(final), ALIGN)
    total = sum(m.size for m in bundle.members)
    report = ConversionReport(model=str(src), format="mediapipe", outputs=[str(final)])
    report.tensors_moved = len(bundle.members)
    report.bytes_in = report.bytes_out = report.bytes_written = total
    report.wall_time_s = time.perf_counter() - start
    report.notes.append(
        f"{len(bundle.members)} members re-laid, names, order and bytes unchanged, each at a 64 KiB-aligned offset: "
        f"MediaPipe no longer copies {saving / (1 << 20):,.1f} MiB of misaligned constants per task (it still "
        f"packs {packed / (1 << 20):,.1f} MiB per task; {_SHARE})"
    )
    return report


def compare_bundles(report: VerifyReport, original: Path, converted: Path) -> None:
    """``verify``: same members, same order, same bytes; and where the converted bundle stores each."""
    import os

    a, b = read_bundle(original), read_bundle(converted)
    names_a, names_b = [m.name for m in a.members], [m.name for m in b.members]
    if names_a != names_b:
        report.mismatches.append(f"members differ: {names_a} vs {names_b}")
        return
    fa, fb = os.open(a.path, os.O_RDONLY), os.open(b.path, os.O_RDONLY)
    try:
        for ma, mb in zip(a.members, b.members, strict=True):
            same, done = ma.size == mb.size, 0
            while same and done < ma.size:
                n = min(CHUNK, ma.size - done)
                same = os.pread(fa, n, ma.data_offset + done) == os.pread(fb, n, mb.data_offset + done)
                done += n
            report.payloads_compared += 1
            if not same:
                report.mismatches.append(f"member {ma.name!r}: its bytes differ")
    finally:
        os.close(fa)
        os.close(fb)
    report.paths.append("members compared byte for byte (MediaPipe reads them in place: equal bytes, equal results)")
    unaligned = [m.name for m in b.members if m.data_offset % ALIGN]
    if unaligned:
        report.notes.append(f"members not 64 KiB-aligned in {converted.name}: {', '.join(unaligned)}")
