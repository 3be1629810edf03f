"""The .mlpackage directory: Manifest.json, the root model spec, and where ``@model_path`` points.

An .mlpackage is ``Manifest.json`` plus ``Data/``; the manifest's ``itemInfoEntries``
map identifiers to paths under ``Data/`` and ``rootModelIdentifier`` names the
model spec (``com.apple.CoreML/model.mlmodel``). coremltools' ``ModelPackage``
finds the weights as the item named ``weights`` by author ``com.apple.CoreML``.
In the program, ``BlobFileValue.fileName`` is ``@model_path/<relative path>``,
relative to the directory of the model spec.

Everything read from the package is untrusted: item paths and blob file names
must stay inside the package (``resolve_inside``), sizes are bounded before
reading, and symlinks are refused rather than followed or copied.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from ..._paths import resolve_inside
from ...errors import InvalidModel, OutputError, UnsafePath, Unsupported
from ...report import JsonDict

if TYPE_CHECKING:
    from coremltools.proto import Model_pb2

MANIFEST = "Manifest.json"
AUTHOR = "com.apple.CoreML"
MODEL_NAME = "model.mlmodel"
WEIGHTS_NAME = "weights"
WEIGHT_FILE = "weight.bin"
MODEL_PATH_PREFIX = "@model_path/"
MAX_MANIFEST_BYTES = 16 << 20
MAX_SPEC_BYTES = (2 << 30) - 1  # protobuf's own limit for one message


@contextmanager
def quiet_coremltools() -> Iterator[None]:
    """Import coremltools without its Linux warnings on stderr.

    Importing any part of coremltools runs its package __init__, which on Linux logs
    "Failed to load _MLModelProxy ..." warnings (no Core ML framework); through logging's
    last-resort handler they would reach stderr and break the CLI's one-line errors.
    """
    logger = logging.getLogger("coremltools")
    level = logger.level
    if level == logging.NOTSET:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def spec_protos() -> tuple[ModuleType, ModuleType]:
    """coremltools' Model_pb2 and MIL_pb2 modules."""
    with quiet_coremltools():
        from coremltools.proto import MIL_pb2, Model_pb2
    return Model_pb2, MIL_pb2


@dataclass
class Package:
    """A parsed .mlpackage: its manifest, the root model item and the parsed spec."""

    root: Path
    manifest: JsonDict
    root_id: str
    model_path: Path  # resolved path of the root model spec file
    spec: Model_pb2.Model
    weights_id: str | None = None
    items: dict[str, JsonDict] = field(default_factory=dict)

    @property
    def data_dir(self) -> Path:
        return self.root / "Data"

    @property
    def model_dir(self) -> Path:
        """What ``@model_path`` stands for in blob file names."""
        return self.model_path.parent

    def model_item_path(self) -> str:
        path: str = self.items[self.root_id]["path"]
        return path


def _manifest_error(message: str, path: Path) -> InvalidModel:
    return InvalidModel(f"Manifest.json {message}", path)


def read_manifest(root: Path) -> JsonDict:
    path = root / MANIFEST
    if path.is_symlink():
        raise UnsafePath("Manifest.json is a symlink; refusing to follow it", path)
    if not path.is_file():
        raise InvalidModel("no Manifest.json: not an .mlpackage", root)
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise _manifest_error(f"is larger than {MAX_MANIFEST_BYTES >> 20} MiB", path)
    try:
        manifest = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _manifest_error(f"is not valid JSON ({getattr(e, 'msg', e)})", path) from None
    if not isinstance(manifest, dict):
        raise _manifest_error("is not a JSON object", path)
    items = manifest.get("itemInfoEntries")
    if not isinstance(items, dict) or not items:
        raise _manifest_error("has no itemInfoEntries", path)
    for ident, item in items.items():
        if not isinstance(item, dict) or not isinstance(item.get("path"), str):
            raise _manifest_error(f"item {ident!r} has no path", path)
    root_id = manifest.get("rootModelIdentifier")
    if not isinstance(root_id, str) or root_id not in items:
        raise _manifest_error("rootModelIdentifier does not name an item", path)
    return manifest


def _regular_file(path: Path, what: str, origin: Path) -> bool:
    """Whether ``path`` is a regular file and not a symlink; a name the OS cannot even look up is the model's fault."""
    try:
        return not path.is_symlink() and path.is_file()
    except OSError as e:  # ENAMETOOLONG, ELOOP, ... from a name taken from the model
        raise InvalidModel(f"{what} path cannot be looked up ({e.strerror})", origin) from None


def read_package(root: Path) -> Package:
    """Read and check an .mlpackage; parse its model spec (small: weights live in weight.bin)."""
    Model_pb2, _ = spec_protos()
    root = Path(root)
    if not root.is_dir():
        raise InvalidModel("is not an .mlpackage directory", root)
    manifest = read_manifest(root)
    manifest_path = root / MANIFEST
    items = manifest["itemInfoEntries"]
    root_id = manifest["rootModelIdentifier"]
    model_path = resolve_inside(root / "Data", items[root_id]["path"], "root model item", manifest_path)
    if not _regular_file(model_path, "root model item", manifest_path):
        raise InvalidModel(f"root model item {items[root_id]['path']!r} is not a file", manifest_path)
    size = model_path.stat().st_size
    if size > MAX_SPEC_BYTES:
        raise InvalidModel("model spec is larger than protobuf's 2 GiB limit", model_path)
    spec = Model_pb2.Model()
    try:
        spec.ParseFromString(model_path.read_bytes())
    except (DecodeError, RuntimeError, ValueError) as e:
        raise InvalidModel(f"model spec is not a valid Core ML Model protobuf ({e})", model_path) from None
    kind = spec.WhichOneof("Type")
    if kind != "mlProgram":
        raise Unsupported(
            f"model type {kind or 'none'!r} is not an ML Program; only ML Programs keep their weights "
            "in weight.bin (convert a NeuralNetwork with coremltools to an ML Program first)",
            model_path,
        )
    weights_id = None
    for ident, item in items.items():  # never the root model item, whatever its name says (found by fuzzing)
        if ident != root_id and item.get("name") == WEIGHTS_NAME and item.get("author") == AUTHOR:
            weights_id = ident
            break
    return Package(root, manifest, root_id, model_path, spec, weights_id, items)


def resolve_blob_file(pkg: Package, file_name: str) -> Path:
    """Map a ``BlobFileValue.fileName`` to a file inside the package."""
    if not file_name.startswith(MODEL_PATH_PREFIX):
        raise UnsafePath(
            f"BlobFileValue file {file_name!r} does not start with {MODEL_PATH_PREFIX!r} "
            "(an absolute or foreign path, outside the package)",
            pkg.model_path,
        )
    rel = file_name[len(MODEL_PATH_PREFIX) :]
    path = resolve_inside(pkg.model_dir, rel, "BlobFileValue file", pkg.model_path)
    data = pkg.data_dir.resolve()
    if data not in path.parents:
        raise UnsafePath(f"BlobFileValue file {file_name!r} is outside the package", pkg.model_path)
    if not _regular_file(path, "BlobFileValue file", pkg.model_path):
        raise InvalidModel(
            f"BlobFileValue file {file_name!r} does not exist (missing from the package)", pkg.model_path
        )
    return path


def stable_id(*parts: str) -> str:
    """A deterministic item identifier (same inputs, same output bytes)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "weightshare:" + "/".join(parts))).upper()


def dump_manifest(manifest: JsonDict) -> bytes:
    # The layout coremltools' ModelPackage writes: 4-space indent, sorted keys.
    return json.dumps(manifest, indent=4, sort_keys=True).encode() + b"\n"


def copy_tree(src: Path, dst: Path, skip: set[Path]) -> list[Path]:
    """Copy every regular file under ``src`` to ``dst`` byte for byte, except ``skip`` (resolved paths).

    Returns the files copied. Symlinks are refused: copying one could pull a file from
    outside the package into the output.
    """
    copied = []
    src = Path(src)
    for dirpath, dirnames, filenames in os.walk(src):
        here = Path(dirpath)
        rel = here.relative_to(src)
        for name in dirnames + filenames:
            if (here / name).is_symlink():
                raise UnsafePath(f"package contains a symlink {str(rel / name)!r}; refusing to follow it", src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        dirnames.sort()
        for name in sorted(filenames):
            path = here / name
            if path.resolve() in skip:
                continue
            if not path.is_file():
                raise Unsupported(f"package contains a special file {str(rel / name)!r}", src)
            try:
                shutil.copyfile(path, dst / rel / name)
            except OSError as e:
                raise OutputError(f"cannot copy {str(rel / name)!r}: {e.strerror}", dst) from None
            copied.append(rel / name)
    return copied


def write_file(path: Path, data: bytes) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise OutputError(f"cannot write output file: {e.strerror}", path) from None
