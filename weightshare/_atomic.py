"""All-or-nothing outputs.

Every output file (or directory) is first written under a temporary name in its final directory, so the final
``os.replace`` is a same-filesystem rename. Until ``commit()`` nothing exists under a final name; an exception,
Ctrl-C, SIGTERM or a full disk removes the temporaries and leaves earlier outputs untouched. One transaction holds
every output of a run, so a run with several models commits all of them or none.

Temporaries are named ``.weightshare-tmp-<pid>-<token>-...`` (``token``: the transaction's) and are protected
by an exclusive ``flock`` held by the process writing them, from creation to the end of the transaction: a
temporary directory by a lock on itself, the temporary files by one guard file per transaction,
``.weightshare-tmp-<pid>-<token>.guard``, in their directory or an ancestor of it (a folder conversion guards
OUTDIR once for its whole tree), so that a run staging thousands of files holds a few descriptors, not one per
file. A later run removes only temporaries no live lock protects (neither their guard's nor their own), and only
what is provably weightshare's (``_stale``): a PID from another PID namespace (another container sharing the
volume) may look dead here, but its lock is still visible through the shared file.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from ._paths import no_link_below
from ._platform import require_posix, same_file
from ._stale import TMP_PREFIX, clean_stale_temporaries, guard_name, sweep_temporaries
from .errors import OutputError, UsageError

__all__ = [
    "TMP_PREFIX",
    "CommitHook",
    "OutputTransaction",
    "clean_stale_temporaries",
    "locked_dirs",
    "locked_stage",
    "sweep_temporaries",
]

try:
    import fcntl
except ImportError:  # Windows: the package still imports; an OutputTransaction refuses (require_posix)
    fcntl = None  # type: ignore[assignment]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def locked_stage(directory: Path, label: str) -> Iterator[Path]:
    """A private working directory inside ``directory`` for the length of the block, then removed.

    Named ``.weightshare-tmp-<random>-<label>`` (nothing derived from the PID, which another PID namespace
    sharing the volume may use at the same time) and held under an exclusive flock from creation to removal,
    so ``clean_stale_temporaries`` of a concurrent run leaves it alone; once its writer is gone (even by
    kill -9) the lock goes with it and the next run's cleanup removes it.
    """
    for _attempt in range(10):
        path = Path(directory) / f"{TMP_PREFIX}{secrets.token_hex(8)}-{label}"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        except OSError as e:
            raise OutputError(f"cannot create a staging directory: {e.strerror}", directory) from None
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if same_file(path, fd):
            break
        os.close(fd)  # a concurrent cleanup removed it between mkdir and flock: take another name
    else:
        raise OutputError("cannot create a staging directory (removed again and again)", directory)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)  # still holding the lock: nobody else removes it meanwhile
        os.close(fd)


@contextmanager
def locked_dirs(directories: Iterable[Path]) -> Iterator[None]:
    """Hold an exclusive flock on each output directory while renaming: two conversions into one OUTDIR commit
    one after the other, the last one winning with a model and a blob that belong together, never a mix. Resolved
    and deduplicated first: flock-ing one directory through ``out`` and ``/abs/out`` would wait on itself."""
    fds = []
    try:
        for d in sorted({str(Path(x).resolve()) for x in directories}):
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
    return bool(renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0)


@dataclass
class _Temp:
    tmp: Path
    final: Path
    is_dir: bool
    fd: int | None = None  # holds the temporary's flock
    mode: int | None = None  # permission bits at commit; None: 0o666 less the umask


@dataclass
class _Done:
    """One rename done at commit, and how to undo it if a later rename fails."""

    final: Path
    old: Path | None  # where the previous output now lives (a backup link or the swapped-out tree)
    exchanged: bool = False


class CommitHook:
    """Work done under the OUTDIR locks around the renames (e.g. collecting old blobs); ``undone``: after a rename
    failed and what the renames replaced was put back (the put-back files were linked and renamed: new ctimes)."""

    def before(self) -> None:
        pass

    def after(self) -> None:
        pass

    def undone(self) -> None:
        pass


class OutputTransaction:
    """Collects temporary outputs and renames them into place together.

    Example:
        with OutputTransaction() as tx:
            tmp = tx.new_file(out_dir / "model.onnx")
            tmp.write_bytes(data)
        # renamed into place here; on an exception, nothing was.
    """

    def __init__(self) -> None:
        require_posix("writing outputs")
        self._pending: list[_Temp] = []
        self._made_dirs: list[Path] = []
        self._hooks: list[CommitHook] = []
        self._after: list[Callable[[], None]] = []  # run after the renames, under the directory locks
        self._done = False
        self._token = secrets.token_hex(6)
        self._guards: dict[Path, tuple[Path, int]] = {}  # guarded directory -> (guard file, fd holding its flock)
        self.record_dir: Path | None = None  # OUTDIR, locked at commit, whose outputs record decides every removal

    def temp_name(self, final: Path) -> Path:
        return final.parent / f"{TMP_PREFIX}{os.getpid()}-{self._token}-{secrets.token_hex(4)}-{final.name}"[:255]

    def guard(self, directory: Path) -> None:
        """Protect every temporary file this transaction creates in ``directory`` or below with one lock (a
        folder conversion guards OUTDIR once); without it, each directory with temporaries gets its own guard."""
        directory = Path(directory)
        if directory in self._guards:
            return
        path = directory / guard_name(os.getpid(), self._token)
        for _attempt in range(10):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                path.unlink(missing_ok=True)  # ours by name (pid and token): a leftover of this very run
                continue
            except OSError as e:
                raise OutputError(f"cannot create output file: {e.strerror}", directory) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                same = same_file(path, fd)
            except BaseException:  # Ctrl-C between creating and locking: nothing stays behind
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            if same:
                self._guards[directory] = (path, fd)
                return
            os.close(fd)  # a concurrent cleanup removed it between creation and lock: create it again
        raise OutputError("cannot create a temporary output (removed again and again)", directory)

    def _guarded_dir(self, directory: Path) -> bool:
        return any(d in self._guards for d in (directory, *directory.parents))

    def _create(self, final: Path, is_dir: bool) -> Path:
        """Register, create and lock a temporary; registered first so an interrupt in between leaves nothing.

        A temporary file is protected by its directory's guard (``guard``), taken before it exists, and holds
        no descriptor of its own; a temporary directory holds a lock on itself."""
        final = Path(final)
        if not self._guarded_dir(final.parent):  # a directory too: the guard proves it a dead run's (``_stale``)
            self.guard(final.parent)
        for _attempt in range(10):
            t = _Temp(self.temp_name(final), final, is_dir)
            self._pending.append(t)
            try:
                if not is_dir:
                    os.close(os.open(t.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                    return t.tmp
                os.mkdir(t.tmp, 0o777)
                t.fd = os.open(t.tmp, os.O_RDONLY | os.O_DIRECTORY)
                fcntl.flock(t.fd, fcntl.LOCK_EX)
                if same_file(t.tmp, t.fd):
                    return t.tmp
                # another run's stale cleanup removed it between creation and lock: try a new name
            except OSError as e:
                what = "directory" if is_dir else "file"
                raise OutputError(f"cannot create output {what}: {e.strerror}", final) from None
        raise OutputError("cannot create a temporary output (removed again and again)", final)

    def new_file(self, final: Path, mode: int | None = None) -> Path:
        """Create an empty temporary file that ``commit`` renames to ``final``, with ``mode`` (permission bits)
        if given (a copied file keeps its source's), else 0o666 less the umask."""
        tmp = self._create(final, False)
        self._pending[-1].mode = mode
        return tmp

    def new_dir(self, final: Path) -> Path:
        """Create an empty temporary directory that ``commit`` renames to ``final``."""
        return self._create(final, True)

    def make_dirs(self, path: Path, under: Path | None = None) -> None:
        """``mkdir -p path``; the directories created here are removed again (when empty) on abort. ``under``:
        OUTDIR, below which no directory may be a link (``_paths.no_link_below``)."""
        if under is not None:
            no_link_below(Path(under), Path(path))
        missing = []
        p = Path(path)
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o777)
            except FileExistsError:
                continue
            except OSError as e:
                raise OutputError(f"cannot create output directory: {e.strerror}", d) from None
            self._made_dirs.append(d)

    def retarget(self, tmp: Path, final: Path) -> None:
        """Rename ``tmp`` to ``final`` at commit instead (a name known only after writing, e.g. a digest)."""
        for t in self._pending:
            if t.tmp == tmp:
                t.final = Path(final)
                return
        raise KeyError(tmp)

    def add_hook(self, hook: CommitHook) -> None:
        self._hooks.append(hook)

    def staged(self, final: Path) -> Path | None:
        """The temporary path that ``commit`` will rename to ``final`` (None when nothing is staged there)."""
        return next((t.tmp for t in self._pending if t.final == Path(final)), None)

    def finals(self) -> list[Path]:
        """Every path ``commit`` will write (what this run outputs)."""
        return [t.final for t in self._pending]

    def after_commit(self, action: Callable[[], None]) -> None:
        """Run ``action()`` once every output is in place (e.g. removing files the new outputs supersede)."""
        self._after.append(action)

    def commit(self) -> None:
        """Rename every temporary into place: files in the order they were created, then directories.

        A model file should be created after the blob it references, so a reader never sees a model whose blob is
        not there yet. Files inside a staged directory are renamed within it before the directory itself moves. If
        a rename fails, the renames already done are undone.
        """
        mode_file = 0o666 & ~_umask()
        try:
            self._refuse_collisions()
            for t in self._pending:
                if not t.is_dir:  # one descriptor at a time, however many files were staged
                    fd = os.open(t.tmp, os.O_RDONLY | os.O_NOFOLLOW)
                    try:
                        os.fsync(fd)
                        os.fchmod(fd, mode_file if t.mode is None else t.mode)
                    finally:
                        os.close(fd)
            files = [t for t in self._pending if not t.is_dir]
            dirs = [t for t in reversed(self._pending) if t.is_dir]
            with locked_dirs({t.final.parent for t in self._pending} | {d for d in [self.record_dir] if d}):
                for hook in self._hooks:
                    hook.before()
                self._rename_all(files + dirs)
                for hook in self._hooks:
                    hook.after()
                for action in self._after:
                    action()
        except OSError as e:
            self.abort()
            raise OutputError(f"cannot move output into place: {e.strerror}", e.filename) from None
        except BaseException:  # Ctrl-C during fsync or rename: nothing half-done stays behind
            self.abort()
            raise
        self._release()
        self._done = True

    def _refuse_collisions(self) -> None:
        """Two outputs of this run on one path: the later would silently replace the earlier (a model's
        companion onto another model, a cache onto a blob); refused before any rename."""
        seen: set[Path] = set()
        for t in self._pending:
            final = t.final.parent.resolve() / t.final.name
            if final in seen:
                raise UsageError(
                    f"two outputs of this run would be written to {t.final.name}; nothing was written", t.final
                )
            seen.add(final)

    def _rename_all(self, pending: list[_Temp]) -> None:
        done: list[_Done] = []
        try:
            for t in pending:
                done.append(self._rename(t))
        except BaseException:
            for d in reversed(done):
                _undo(d)
            for hook in self._hooks:
                hook.undone()
            raise
        for d in done:  # every rename succeeded: drop what they replaced
            if d.old is not None:
                _remove(d.old)

    def _rename(self, t: _Temp) -> _Done:
        final = t.final
        if t.is_dir and final.is_dir() and not final.is_symlink():
            if _exchange(t.tmp, final):  # one atomic step: readers see the old or the new tree
                return _Done(final, t.tmp, exchanged=True)
            trash = self.temp_name(final)
            os.replace(final, trash)
            os.replace(t.tmp, final)
            return _Done(final, trash)
        backup = None
        if not t.is_dir and final.is_file() and not final.is_symlink():
            backup = self.temp_name(final)
            try:
                os.link(final, backup)  # kept until every rename of the run succeeded, to undo this one
            except OSError:
                backup = None
        try:
            os.replace(t.tmp, final)
        except BaseException:
            if backup is not None:
                _remove(backup)
            raise
        return _Done(final, backup)

    def _release(self) -> None:
        for t in self._pending:
            if t.fd is not None:
                os.close(t.fd)
                t.fd = None
        left = [t.tmp for t in self._pending if os.path.lexists(t.tmp)]  # a removal that failed (abort)
        self._pending.clear()
        for path, fd in self._guards.values():  # after every temporary is renamed or removed
            try:
                if not any(path.parent in p.parents for p in left):  # else kept: the proof they are a dead run's
                    os.unlink(path)
            except OSError:
                pass
            os.close(fd)
        self._guards.clear()

    def abort(self) -> None:
        for t in self._pending:
            if t.is_dir:
                shutil.rmtree(t.tmp, ignore_errors=True)
            else:
                try:
                    os.unlink(t.tmp)
                except OSError:
                    pass
        self._release()
        for d in reversed(self._made_dirs):
            try:
                os.rmdir(d)  # only if still empty
            except OSError:
                pass
        self._made_dirs.clear()
        self._done = True

    def __enter__(self) -> OutputTransaction:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None and not self._done:
            self.commit()
        elif not self._done:
            self.abort()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def _undo(d: _Done) -> None:
    """Put back what one rename replaced; best effort (we are already failing)."""
    try:
        if d.exchanged and d.old is not None:
            _exchange(d.old, d.final)  # the new tree goes back to the temporary, which abort removes
        elif d.old is not None:
            os.replace(d.old, d.final)
        else:
            _remove(d.final)
    except OSError:
        pass
