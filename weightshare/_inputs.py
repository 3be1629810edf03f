"""Input files: opened once, read through the kept descriptor, checked against the run's plan.

Input files are opened once (``open_input``) and read through the kept descriptor, never reopened by name: a name
checked to lie inside the model directory cannot be swapped for a symlink between the check and the read.

A run's inputs are checked against its plan (``planned_inputs``): each input's identity (device, inode) is taken
when the run plans it, a link's by its resolved target (a Hugging Face hub snapshot links every file into the
cache's ``blobs/``). Every later open of a planned input opens that target without following a link and compares
the descriptor's identity with the plan, so a model swapped (for a link to a file outside the folder, or another
file) between planning and conversion is refused, never read. While a driver converts one model it ``hold``s it:
that model is opened once and every read of it, by any reader, goes through that descriptor (``open_fd``).
"""

from __future__ import annotations

import os
import stat
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InvalidModel, UnsafePath


class InputFile:
    """A regular input file opened once; every payload read goes through ``fd``.

    Closed by ``close()`` or when the last reference goes away (sources of many
    tensors share one ``InputFile``, so none of them owns it).
    """

    __slots__ = ("__weakref__", "_closer", "fd", "path", "size")

    def __init__(self, fd: int, path: str, size: int):
        self.fd, self.path, self.size = fd, path, size
        self._closer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self._closer()


def _fd_real_path(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None  # no /proc (macOS, some sandboxes): the O_NOFOLLOW and dev/ino checks remain


@dataclass(frozen=True, slots=True)
class PlannedInput:
    """An input as its run planned it: the path named, the file it was then (a link's resolved target), and that
    file's identity."""

    path: str  # absolute, as named (may be a link)
    target: str  # its real path when planned
    dev: int
    ino: int
    is_dir: bool


def plan_input(path: str | os.PathLike[str]) -> PlannedInput | None:
    """The identity of ``path`` now (links followed); None when it cannot be read (its reader says why)."""
    name = os.path.abspath(os.fspath(path))
    try:
        st = os.stat(name)
    except OSError:
        return None
    return PlannedInput(name, os.path.realpath(name), st.st_dev, st.st_ino, stat.S_ISDIR(st.st_mode))


def plan_inputs(paths: Iterable[str | os.PathLike[str]]) -> list[PlannedInput]:
    return [p for p in map(plan_input, paths) if p is not None]


@dataclass
class _RunInputs:
    by_name: dict[str, PlannedInput] = field(default_factory=dict)  # by the path named and by its target
    held: dict[str, InputFile] = field(default_factory=dict)  # by PlannedInput.path
    named: list[str] = field(default_factory=list)  # the paths the user named (a batch's files)


_run: ContextVar[_RunInputs | None] = ContextVar("weightshare_run_inputs", default=None)


@contextmanager
def planned_inputs(planned: Iterable[PlannedInput], named: bool = False) -> Iterator[list[PlannedInput]]:
    """Check every open of these inputs against their planned identity while the context lasts (nested: the
    outer run's inputs stay planned too). ``named``: the user named each of them (``named_inputs``)."""
    outer = _run.get()
    run = _RunInputs(dict(outer.by_name) if outer is not None else {})
    items = list(planned)
    run.named = [p.path for p in items] if named else list(outer.named if outer is not None else [])
    for p in items:
        run.by_name[p.path] = run.by_name[p.target] = p
    token = _run.set(run)
    try:
        yield items
    finally:
        _run.reset(token)
        for f in run.held.values():
            f.close()


def named_inputs() -> list[Path]:
    """The files the user named for the current run (a batch's files, as given on the command line)."""
    run = _run.get()
    return [Path(p) for p in run.named] if run is not None else []


def is_planned(path: str | os.PathLike[str]) -> bool:
    """Whether the current run planned ``path`` (then ``open_input(path)`` opens what was planned)."""
    return _planned(path) is not None


def _planned(path: str | os.PathLike[str]) -> tuple[_RunInputs, PlannedInput] | None:
    run = _run.get()
    if run is None or not run.by_name:
        return None
    p = run.by_name.get(os.path.abspath(os.fspath(path)))
    return (run, p) if p is not None else None


def _open_planned(p: PlannedInput, where: str | os.PathLike[str]) -> int:
    """Open ``p``'s planned target (no link followed there) and check the descriptor is the planned file."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    if p.is_dir:
        flags |= getattr(os, "O_DIRECTORY", 0)
    now = os.path.realpath(p.path)
    if now != p.target:  # re-pointed: the planned target is still safe to read, but it is no longer the input
        raise UnsafePath(f"changed after it was checked (now resolves to {now[:200]}); refusing to read it", where)
    try:
        fd = os.open(p.target, flags)
    except OSError as e:
        raise UnsafePath(f"changed after it was checked ({e.strerror}); refusing to read it", where) from None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (p.dev, p.ino):
        os.close(fd)
        raise UnsafePath("changed after it was checked (replaced by another file); refusing to read it", where)
    return fd


@contextmanager
def hold(path: str | os.PathLike[str]) -> Iterator[None]:
    """Open a planned input once, checked against the plan; every read of it in the context goes through that
    descriptor (``open_input``, ``open_fd``). A path the run did not plan is left as it is."""
    found = _planned(path)
    if found is None or found[1].is_dir:
        if found is not None:  # a package directory: its identity checked now; its files are opened inside it
            os.close(_open_planned(found[1], path))
        yield
        return
    run, p = found
    if p.path in run.held:
        yield
        return
    fd = _open_planned(p, path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidModel(f"{os.path.basename(p.path)!r} is not a regular file", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    run.held[p.path] = InputFile(fd, p.path, st.st_size)
    try:
        yield
    finally:
        run.held.pop(p.path).close()


def open_fd(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor of ``path`` the caller closes: a duplicate of the held one for an input being
    converted, a checked open for another planned input, else ``os.open``."""
    found = _planned(path)
    if found is None:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    run, p = found
    held = run.held.get(p.path)
    if held is not None:
        return os.dup(held.fd)
    fd = _open_planned(p, path)
    os.set_blocking(fd, True)
    return fd


def open_input(
    path: str | os.PathLike[str],
    inside: str | os.PathLike[str] | tuple[Path, ...] | None = None,
    origin: str | os.PathLike[str] | None = None,
) -> InputFile:
    """Open ``path`` for reading, once, refusing anything but a regular file.

    With ``inside`` (the model directory; ``path`` must already have passed
    ``resolve_inside``), the last component must not be a symlink and the opened
    descriptor's real path must lie inside ``inside`` (or one of them, ``external_data_roots``): a file swapped
    for a symlink, or a directory on the way swapped, after the check is refused, never read.
    The open is non-blocking so that a FIFO is refused instead of waiting for a writer.
    An input the run planned is opened at its planned target and checked against the plan (``planned_inputs``); one
    being converted is not opened again (``hold``).
    """
    path = os.fspath(path)
    where = origin if origin is not None else path
    found = _planned(path)
    if found is not None and not found[1].is_dir:
        return _open_planned_input(found[0], found[1], path, inside, where)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if inside is not None:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if inside is not None and os.path.islink(path):
            raise UnsafePath(f"{os.path.basename(path)!r} became a symlink while being opened", where) from None
        raise InvalidModel(f"cannot open {os.path.basename(path)!r}: {e.strerror}", where) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidModel(f"{os.path.basename(path)!r} is not a regular file", where)
        if inside is not None:
            _check_opened_inside(fd, st, path, inside, where)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return InputFile(fd, path, st.st_size)


def _open_planned_input(
    run: _RunInputs,
    p: PlannedInput,
    path: str,
    inside: str | os.PathLike[str] | tuple[Path, ...] | None,
    where: str | os.PathLike[str],
) -> InputFile:
    held = run.held.get(p.path)
    fd = os.dup(held.fd) if held is not None else _open_planned(p, where)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidModel(f"{os.path.basename(path)!r} is not a regular file", where)
        if inside is not None:
            _check_opened_inside(fd, st, p.target, inside, where)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return InputFile(fd, path, st.st_size)


def _planned_real(base: str | os.PathLike[str]) -> str:
    """A directory's real path as the run planned it (a package swapped for a link afterwards does not move the
    bound), else as it is now."""
    found = _planned(base)
    if found is not None:
        return found[1].target
    run, name = _run.get(), os.path.abspath(os.fspath(base))
    for p in run.by_name.values() if run is not None else ():
        if p.is_dir and name.startswith(p.path + os.sep):  # inside a planned package: below its planned target
            return os.path.realpath(p.target + name[len(p.path) :])
    return os.path.realpath(base)


def _check_opened_inside(
    fd: int,
    st: os.stat_result,
    path: str,
    inside: str | os.PathLike[str] | tuple[Path, ...],
    where: str | os.PathLike[str],
) -> None:
    bases = [_planned_real(b) for b in inside] if isinstance(inside, tuple) else [_planned_real(inside)]
    real = _fd_real_path(fd)
    if real is None:  # fall back to: the name now resolves to the very file we hold, and inside base
        real = os.path.realpath(path)
        now = os.stat(real)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise UnsafePath(f"{os.path.basename(path)!r} changed while being opened", where)
    if not any(os.path.commonpath([base, real]) == base for base in bases):
        raise UnsafePath(f"{os.path.basename(path)!r} resolves outside the model directory once opened", where)
