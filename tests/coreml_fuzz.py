"""Mutation fuzzing of .mlpackage inputs, shared by tests/test_fuzz_coreml.py and scripts/fuzz.py.

A package is three files that each can lie: Manifest.json (item paths, the root
model), the model spec (a protobuf whose ``BlobFileValue``s name a file and a
record offset) and weight.bin (a header count, 64-byte records with dtype, size,
data offset and padding bits). Each input damages one of them, either with the
byte-level mutations of ``fuzz_harness.mutate`` or with a structured lie that
parses (a record field, a blob offset or file name, a manifest path), which is
what reaches past the parsers into the converter.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from fuzz_harness import FuzzStats, convert_and_check, mutate

MANIFEST = "Manifest.json"
MODEL = "Data/com.apple.CoreML/model.mlmodel"
WEIGHTS = "Data/com.apple.CoreML/weights/weight.bin"
TARGETS = (WEIGHTS, MODEL, MANIFEST)

# Values that lie about sizes and offsets: zero, off by one around the 64-byte grid, 32/64-bit edges.
LIES = (0, 1, 63, 64, 65, 127, 128, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 32, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 1)
FILE_NAMES = (
    "",
    "@model_path/",
    "@model_path/weights",
    "@model_path/weights/",
    "@model_path/../Manifest.json",
    "@model_path/../../../../etc/passwd",
    "/etc/passwd",
    "@model_path//etc/passwd",
    "@model_path/weights/nope.bin",
    "@model_path/model.mlmodel",
    "@model_path/./weights/weight.bin",
    "@model_path/weights/weight.bin\x00x",
    "C:\\weights\\weight.bin",
    "@model_path/weights\\weight.bin",
)


@dataclass
class PackageSeed:
    """A valid package held in memory: its directory name and every file, by path relative to it."""

    name: str
    files: dict[str, bytes]

    @classmethod
    def read(cls, pkg: Path) -> PackageSeed:
        files = {p.relative_to(pkg).as_posix(): p.read_bytes() for p in sorted(pkg.rglob("*")) if p.is_file()}
        return cls(pkg.name, files)

    def blob_offsets(self) -> list[int]:
        from coremltools.proto import Model_pb2

        from weightshare.formats.coreml.convert import iter_blob_file_values

        spec = Model_pb2.Model()
        spec.ParseFromString(self.files[MODEL])
        return sorted({v.offset for v in iter_blob_file_values(spec.mlProgram)})


def coreml_seeds(d: Path) -> list[PackageSeed]:
    """Small packages covering the layouts convert meets: fp16 iOS16, nested blocks, iOS18 sub-byte constexpr
    inputs, iOS16 constexpr attributes, and a coremltools multifunction package (two functions, shared records)."""
    import coreml_fixtures as F

    mlp = F.mlp(d / "m.mlpackage", "iOS16", hidden=64)
    pkgs = [
        mlp,
        F.nested(d / "n.mlpackage"),
        F.odd_subbyte(d / "s.mlpackage", "lut3"),
        F.compressed(d / "c.mlpackage", "lut2-16"),
    ]
    pkgs.append(F.multifunction(d / "mf.mlpackage", [mlp, pkgs[2]], ["a", "b"]))
    return [PackageSeed.read(p) for p in pkgs]


def _lie_in_record(seed: PackageSeed, data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """Overwrite one field of a record a BlobFileValue points at (or of the header)."""
    out = bytearray(data)
    offsets = seed.blob_offsets()
    if not offsets or rng.random() < 0.15:
        fmt, pos = "<I", rng.choice((0, 4))  # header count or version
    else:
        fmt, field = rng.choice((("<I", 0), ("<I", 4), ("<Q", 8), ("<Q", 16), ("<Q", 24)))
        pos = rng.choice(offsets) + field
    if pos + struct.calcsize(fmt) > len(out):
        return "record-short", data[:pos]
    limit = (1 << 8 * struct.calcsize(fmt)) - 1
    value = rng.choice(LIES + (rng.randrange(len(out) + 1),)) & limit
    if fmt == "<I" and pos % 64 == 4 and rng.random() < 0.5:
        value = rng.randrange(20)  # a dtype: known, unknown, sub-byte
    struct.pack_into(fmt, out, pos, value)
    return "record", bytes(out)


def _lie_in_spec(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """Point one BlobFileValue elsewhere, or give it a hostile file name."""
    from coremltools.proto import Model_pb2

    from weightshare.formats.coreml.convert import iter_blob_file_values

    spec = Model_pb2.Model()
    spec.ParseFromString(data)
    values = list(iter_blob_file_values(spec.mlProgram))
    if not values:
        return "spec-none", data
    bfv = rng.choice(values)
    if rng.random() < 0.6:
        bfv.offset = rng.choice(LIES + ((bfv.offset + rng.choice((-64, -1, 1, 64))) % (1 << 64),))
        return "spec-offset", spec.SerializeToString()
    bfv.fileName = rng.choice(FILE_NAMES)
    return "spec-file", spec.SerializeToString()


def _lie_in_manifest(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    manifest = json.loads(data)
    items = manifest["itemInfoEntries"]
    ident = rng.choice(sorted(items))
    choice = rng.randrange(4)
    if choice == 0:
        items[ident]["path"] = rng.choice(
            (
                "",
                ".",
                "..",
                "../x",
                "/etc",
                "com.apple.CoreML",
                "com.apple.CoreML/weights",
                "com.apple.CoreML/weights/weight.bin",
                "x" * 300,
                "com.apple.CoreML/nope",
            )
        )
    elif choice == 1:
        manifest["rootModelIdentifier"] = rng.choice(sorted(items) + ["", "nope"])
    elif choice == 2:
        items[ident]["name"] = rng.choice(("weights", "model", ""))
        items[ident]["author"] = rng.choice(("com.apple.CoreML", "x"))
    else:
        items[ident] = rng.choice((None, 1, [], {}, {"path": 7}))
    return "manifest", json.dumps(manifest).encode()


def mutate_package(seed: PackageSeed, rng: random.Random, target: str | None = None) -> tuple[str, dict[str, bytes]]:
    """(kind, files): ``seed`` with one of its files damaged, byte-wise or with a structured lie."""
    target = target or rng.choice(TARGETS)
    data = seed.files[target]
    if rng.random() < 0.5:
        kind, new = mutate(data, rng)
    elif target == WEIGHTS:
        kind, new = _lie_in_record(seed, data, rng)
    elif target == MODEL:
        kind, new = _lie_in_spec(data, rng)
    else:
        kind, new = _lie_in_manifest(data, rng)
    short = {WEIGHTS: "weights", MODEL: "spec", MANIFEST: "manifest"}[target]
    return f"{short}:{kind}", {**seed.files, target: new}


def _clear(directory: Path) -> None:
    if directory.exists():
        for p in directory.iterdir():
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def _warm_up() -> None:
    """Import what convert imports lazily (coremltools' protos: tens of MiB) before allocations are traced."""
    from weightshare.formats.coreml import convert  # noqa: F401
    from weightshare.formats.coreml.package import spec_protos

    spec_protos()


def check_package(name: str, files: dict[str, bytes], workdir: Path, stats: FuzzStats, kind: str = "") -> None:
    """Convert the package ``files`` as ``workdir/in/name``; raise AssertionError on any broken invariant.

    Like ``fuzz_harness.check_one``: a conversion or a one-line ``WeightshareError`` naming a file, nothing left
    in OUTDIR after a failure, and no allocation beyond the package's size plus a fixed slack.
    """
    src, out = workdir / "in" / name, workdir / "out"
    _clear(workdir / "in")
    _clear(out)
    for rel, content in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    size = sum(len(c) for c in files.values())
    _warm_up()
    convert_and_check(src, out, size, stats, kind)


def save_package(files: dict[str, bytes], dest: Path) -> Path:
    for rel, content in files.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(content)
    return dest
