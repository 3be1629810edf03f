"""A model file and every external-data file it references, opened once and held (``OpenedModel``): what
``weightshare.ort`` creates sessions from and reads the ``--prepack`` record through (``prepack_info``, which the
loader re-exports and ONNX's ``verify`` reads too, so format code never imports the public loader)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...._paths import external_data_roots, resolve_inside
from ...._platform import malloc_trim
from ....errors import InvalidModel, Unsupported
from ....report import JsonDict
from .prepack_record import read_record_fd

if TYPE_CHECKING:
    import onnxruntime as ort


# The oldest onnxruntime weightshare supports (pyproject's floor, run by .ci/run): older ones neither map external
# data for a model given as bytes (1.17-1.20: "Invalid fd", "cannot get file size") nor save pre-packed weights.
ORT_FLOOR = (1, 21)


def require_floor(where: str | os.PathLike[str] | None = None) -> None:
    """Refuse, in one line naming the fix, an onnxruntime older than ``ORT_FLOOR``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("onnxruntime")
    except PackageNotFoundError:
        return  # the import that follows says it is missing
    parts = tuple(int(p) if p.isdigit() else 0 for p in found.split(".")[:2])
    if parts < ORT_FLOOR:
        floor = ".".join(map(str, ORT_FLOOR))
        raise Unsupported(
            f"onnxruntime {found} is older than weightshare supports ({floor}: older releases cannot map external "
            f"data of a model given as bytes nor save pre-packed weights); pip install 'onnxruntime>={floor}'",
            where,
        )


def set_entry(so: ort.SessionOptions, key: str, value: str) -> None:
    """Set a config entry (ORT warns when one is overwritten: options reused for several sessions)."""
    try:
        if so.get_session_config_entry(key) == value:
            return
    except Exception:  # noqa: BLE001 - ORT raises a plain RuntimeError for a key that is not set
        pass
    so.add_session_config_entry(key, value)


def read_fd(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 24, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def open_file(path: Path, origin: Path) -> int:
    """An fd on the regular file ``path`` (its last component not a symlink)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        why = "is a symlink" if e.errno == errno.ELOOP else (e.strerror or str(e))
        raise InvalidModel(f"cannot open {path.name}: {why}", origin) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidModel(f"{path.name} is not a regular file", origin)
    return fd


class OpenedModel:
    """A model file and every external-data file it references, each opened once and held open."""

    def __init__(self, path: Path, data: bytes) -> None:
        self.path, self.data = path, data
        self.blobs: dict[str, int] = {}  # external-data location -> fd
        self.targets: dict[str, Path] = {}  # location -> the path ORT will open

    @classmethod
    def open(cls, path: Path) -> OpenedModel:
        from .probe import WireError, external_locations  # tempfile: not on the loader's import path

        fd = open_file(path, path)
        try:
            data = read_fd(fd)
        finally:
            os.close(fd)
        try:
            locations = external_locations(data)
        except WireError:
            raise InvalidModel("not an ONNX model (protobuf does not parse)", path) from None
        opened = cls(path, data)
        try:
            for loc in locations:
                if loc not in opened.blobs:
                    opened.targets[loc] = resolve_inside(
                        path.parent, loc, "external data", origin=path, roots=external_data_roots(path)
                    )
                    opened.blobs[loc] = open_file(opened.targets[loc], path)
        except BaseException:
            opened.close()
            raise
        return opened

    def record(self) -> tuple[JsonDict, str] | None:
        """The validated ``--prepack`` record of one of the blobs and that blob's location, or None."""
        for loc, fd in self.blobs.items():
            rec = read_record_fd(fd, self.path.parent / loc)
            if rec is not None:
                return rec, loc
        return None

    def unchanged(self) -> bool:
        """Every external-data path still names the file checked through its fd."""
        for loc, fd in self.blobs.items():
            try:
                now, held = os.stat(self.targets[loc], follow_symlinks=False), os.fstat(fd)
            except OSError:
                return False
            if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
                return False
        return True

    def session(
        self, so: ort.SessionOptions | None, providers: list[str], kwargs: dict[str, Any]
    ) -> ort.InferenceSession:
        """ORT on this model's bytes; its external data mapped from the files held here.

        ORT opens external data by path (its in-memory external-data API copies, so mapping by path is what
        keeps sessions sharing). Blob names carry their content digest and are never rewritten, so a path
        that names the same inode before and after session creation gave ORT the bytes checked here."""
        import onnxruntime as ort

        require_floor(self.path)
        so = so or ort.SessionOptions()
        set_entry(so, "session.model_external_initializers_file_folder_path", str(self.path.parent.resolve()))
        for _attempt in range(3):
            if self.unchanged():
                sess = ort.InferenceSession(self.data, so, providers=providers, **kwargs)
                if self.unchanged():
                    malloc_trim()
                    return sess
                del sess
        raise InvalidModel("its external-data files were replaced while the session was created; open it again")

    def close(self) -> None:
        for fd in self.blobs.values():
            os.close(fd)
        self.blobs.clear()

    def __enter__(self) -> OpenedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def prepack_info(model_path: str | os.PathLike[str]) -> tuple[JsonDict, Path] | None:
    """The validated ``--prepack`` record of the model's blob and the blob's path.

    Args:
        model_path: an ONNX model file.

    Returns:
        (record, blob path) for a ``convert --prepack`` output; None for any other model.

    Raises:
        InvalidModel: the record is malformed (absolute or escaping paths, wrong types)."""
    with OpenedModel.open(Path(model_path)) as opened:
        found = opened.record()
        return None if found is None else (found[0], Path(model_path).parent / found[1])
