"""All-or-nothing outputs.

Every output file (or directory) is first written under a temporary name in its
final directory, so the final ``os.replace`` is a same-filesystem rename. Until
``commit()`` nothing exists under a final name; an exception, Ctrl-C or a full
disk removes the temporaries and leaves earlier outputs untouched. Temporaries
are recognisable (``.weightshare-tmp-<pid>-...``) so that a later run can remove
the ones a killed process left behind.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path

from .errors import OutputError

TMP_PREFIX = ".weightshare-tmp-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temporaries(directory: Path) -> list[Path]:
    """Remove temporaries left by weightshare processes that no longer run."""
    removed = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        if not entry.name.startswith(TMP_PREFIX):
            continue
        try:
            pid = int(entry.name[len(TMP_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid() or _pid_alive(pid):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


@contextmanager
def _locked(directories):
    """Hold an exclusive flock on each output directory while renaming.

    Two conversions into the same OUTDIR then commit one after the other, so the
    last one wins with a model and a blob that belong together, never a mix.
    """
    fds = []
    try:
        for d in sorted(str(x) for x in directories):
            fd = os.open(d, os.O_RDONLY)
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        for fd in fds:
            os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


class OutputTransaction:
    """Collects temporary outputs and renames them into place together.

    Example:
        with OutputTransaction() as tx:
            tmp = tx.new_file(out_dir / "model.onnx")
            tmp.write_bytes(data)
        # both renamed into place here; on an exception, nothing was.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path, bool]] = []  # (tmp, final, is_dir)
        self._after: list = []  # callables run after the renames, still under the directory locks
        self._done = False

    def _tmp_name(self, final: Path) -> Path:
        return final.parent / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{final.name}"

    def new_file(self, final: Path) -> Path:
        """Create an empty temporary file that ``commit`` renames to ``final``."""
        final = Path(final)
        tmp = self._tmp_name(final)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as e:
            raise OutputError(f"cannot create output file: {e.strerror}", final) from None
        os.close(fd)
        self._pending.append((tmp, final, False))
        return tmp

    def new_dir(self, final: Path) -> Path:
        """Create an empty temporary directory that ``commit`` renames to ``final``."""
        final = Path(final)
        tmp = self._tmp_name(final)
        try:
            os.mkdir(tmp, 0o777)
        except OSError as e:
            raise OutputError(f"cannot create output directory: {e.strerror}", final) from None
        self._pending.append((tmp, final, True))
        return tmp

    def staged(self, final: Path) -> Path | None:
        """The temporary path that ``commit`` will rename to ``final`` (None when nothing is staged there)."""
        return next((tmp for tmp, f, _is_dir in self._pending if f == Path(final)), None)

    def after_commit(self, action) -> None:
        """Run ``action()`` once every output is in place (e.g. removing files the new outputs supersede)."""
        self._after.append(action)

    def commit(self) -> None:
        """Rename every temporary into place: files in the order they were created, then directories.

        A model file should be created after the blob it references, so a reader
        never sees a model whose blob is not there yet. Files inside a staged
        directory are renamed within it before the directory itself moves.
        """
        mode_file = 0o666 & ~_umask()
        try:
            for tmp, _final, is_dir in self._pending:
                if not is_dir:
                    with open(tmp, "rb+") as f:
                        os.fsync(f.fileno())
                    os.chmod(tmp, mode_file)
            # Files first (some live inside a staged directory), then directories, innermost last-created first.
            files = [p for p in self._pending if not p[2]]
            dirs = [p for p in reversed(self._pending) if p[2]]
            with _locked({final.parent for _tmp, final, _is_dir in self._pending}):
                self._rename_all(files + dirs)
                for action in self._after:
                    action()
        except OSError as e:
            self.abort()
            raise OutputError(f"cannot move output into place: {e.strerror}", e.filename) from None
        except BaseException:  # Ctrl-C during fsync or rename: nothing half-done stays behind
            self.abort()
            raise
        self._done = True

    def _rename_all(self, pending: list[tuple[Path, Path, bool]]) -> None:
        for tmp, final, is_dir in pending:
            if is_dir and final.is_dir() and not final.is_symlink():
                if _exchange(tmp, final):  # one atomic step: readers see the old or the new tree
                    shutil.rmtree(tmp, ignore_errors=True)
                    continue
                trash = self._tmp_name(final)
                os.replace(final, trash)
                os.replace(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(tmp, final)

    def abort(self) -> None:
        for tmp, _final, is_dir in self._pending:
            if is_dir:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        self._pending.clear()
        self._done = True

    def __enter__(self) -> "OutputTransaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self._done:
            self.commit()
        elif not self._done:
            self.abort()
