"""A toy model format, used only in tests, that proves a format is one folder plus one registration.

A ``.toymodel`` file is JSON: ``{"toymodel": 1, "tensors": {name: {"dtype", "shape", and either "data"
(base64, embedded) or "location"/"offset"/"length" (external)}}}``. ``weightshare convert`` moves every
embedded tensor of 1 KiB or more into the shared safetensors blob through the common pipeline; ``inspect``
and ``check`` see where each payload lives. It declares an ``--unpack`` value of its own, ``toy-f32``
(float16 tensors stored as float32), as a built-in format declares its options. Nothing here is imported by
weightshare itself.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from weightshare._inventory import ModelInventory, PayloadInfo, alignment_of
from weightshare._pipeline import BlobPayload, PreparedModel, blob_target, write_models
from weightshare._placement import PlannedTensor
from weightshare._tensors import BytesSource
from weightshare.errors import InvalidModel, Unsupported
from weightshare.formats import safetensors_container
from weightshare.formats.base import BenchRuntime, BlobContainer, FormatDefaults, FormatOptions
from weightshare.report import ConversionReport


def _load(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidModel(f"not a toy model ({e})", path) from None
    if not isinstance(doc, dict) or doc.get("toymodel") != 1 or not isinstance(doc.get("tensors"), dict):
        raise InvalidModel("not a toy model (no 'toymodel': 1 header)", path)
    return doc


def _f16_to_f32(data: bytes) -> bytes:
    import numpy as np

    return np.frombuffer(data, "<f2").astype("<f4").tobytes()


class ToyFormat(FormatDefaults):
    name = "toy"
    title = "Toy"
    suffixes = (".toymodel",)
    maps_in_place = frozenset({"external"})  # the toy runtime decodes embedded base64 per session
    maps_unaligned = False
    findings: dict = {}  # the format-neutral codes cover it
    settings: tuple[str, ...] = ()  # one runtime, no settings to tell apart
    options = FormatOptions(unpack={"toy-f32": "Toy: float16 tensors stored as the float32 the toy runtime computes"})

    @property
    def blob_container(self) -> BlobContainer:
        return safetensors_container()

    def claims(self, path: Path, head: bytes) -> bool:
        return path.suffix == ".toymodel" and head[:1] == b"{"

    def prepare(self, src: Path, out_dir: Path, options) -> PreparedModel:
        doc = _load(src)
        report = ConversionReport(model=str(src), format=self.name)
        moved: list[str] = []
        payloads = []
        for name, t in doc["tensors"].items():
            if "data" not in t:
                continue
            data = base64.b64decode(t["data"])
            if "toy-f32" in options.unpack and t["dtype"] == "float16":
                data = _f16_to_f32(data)
                t.update(dtype="float32", data=base64.b64encode(data).decode())  # inline or moved: float32 now
                report.unpacked += 1
            if len(data) < options.inline_threshold:
                report.inline_kept += 1
                continue
            payloads.append(
                BlobPayload(
                    PlannedTensor(name, t["dtype"], tuple(t["shape"]), len(data)),
                    BytesSource(data),
                    len(data),
                )
            )
            moved.append(name)

        def emit(blob_location: str, placements, tx) -> list[Path]:
            for i, name in enumerate(moved):  # placements are by payload position
                t = doc["tensors"][name]
                del t["data"]
                t.update(location=blob_location, offset=placements.offset(i), length=placements.nbytes(i))
            out = out_dir / src.name
            Path(tx.new_file(out)).write_text(json.dumps(doc, sort_keys=True))
            return [out]

        return PreparedModel(report, payloads, emit)

    def convert(self, src: Path, out_dir: Path, options, tx) -> ConversionReport:
        target = blob_target(src, out_dir, options.blob_name, self.blob_container)
        prepared = self.prepare(src, out_dir, options)
        write_models([prepared], out_dir, target, options, tx)
        return prepared.report

    def inventory(self, path: Path, hash_payloads: bool) -> ModelInventory:
        doc = _load(path)
        inv = ModelInventory(model=str(path), format=self.name, file_bytes=path.stat().st_size)
        for name, t in doc["tensors"].items():
            if "data" in t:
                n = len(base64.b64decode(t["data"]))
                # The toy runtime decodes base64 into private memory in every session.
                inv.payloads.append(
                    PayloadInfo(
                        name, t["dtype"], tuple(t["shape"]), n, "embedded", copied_per_session=n, would_move=n >= 1024
                    )
                )
            else:
                inv.payloads.append(
                    PayloadInfo(
                        name,
                        t["dtype"],
                        tuple(t["shape"]),
                        t["length"],
                        "external",
                        file=t["location"],
                        offset=t["offset"],
                        alignment=alignment_of(t["offset"]),
                    )
                )
        return inv

    def verify(self, report, original: Path, converted: Path, opts: dict, broken: bool) -> None:
        raise Unsupported("the toy format has no runtime", original)

    def bench_runtime(self, path: Path) -> BenchRuntime:
        raise Unsupported("the toy format has no runtime", path)


FORMAT = ToyFormat()
