"""What weightshare wrote into OUTDIR, so that a re-run removes what it no longer writes, and nothing else.

Every batch and folder run records, in ``OUTDIR/.weightshare-folder.json``, each file it wrote: its path relative
to OUTDIR and its identity right after the commit (device, inode, size, ctime in ns), keyed by its inputs (a hash
of their absolute paths, not the paths: users publish OUTDIR). A later run of the same inputs that no longer writes
a recorded file drops it; a run whose models all went to other runs drops what it wrote; a dropped file is removed
once dropped for ``--blob-grace`` seconds, only if it is still the file weightshare wrote:

- its directory is opened from a descriptor of OUTDIR one component at a time, never following a link (OUTDIR
  itself, as named, is followed once), and the file is stat'ed and unlinked relative to that descriptor;
- its identity equals the recorded one. ctime cannot be set by a user and changes on every write, chmod, rename
  and link, so an edited, replaced or re-linked file no longer matches. A content hash would prove the same at the
  cost of reading every byte of a multi-GiB blob (BLAKE3 ~1 GiB/s here) on every commit;
- no model beside it (or in OUTDIR) still names it, no format still needs it (``NEEDED``: an ExecuTorch .ptd
  that a program beside it reads), no recorded run still lists it, this run did not write it.

Anything else is kept, and a note names it. A file no record names (a user's file, an earlier version's output,
a blob of unknown origin) is never a candidate. The record is read, merged and written under the commit's OUTDIR
lock, after the renames, so concurrent runs keep each other's entries. It carries a seal (SHA-256 of its runs):
a record that is malformed, of another format, or edited by hand removes nothing (one warning note) and is
replaced by this run's entry alone.

The same proof decides replacement (``_replacement``, run first at commit): a run renames its outputs only over
nothing or over files the record names with their identity; a user's file, link or directory at an output path, an
output edited since, or any file when the record vouches for nothing stops the run, with nothing written.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from ._atomic import TMP_PREFIX, CommitHook

RECORD = ".weightshare-folder.json"  # at OUTDIR's root; also skipped when a converted folder is converted again
FORMAT = "weightshare-outputs/2"
OLD_FORMAT = "weightshare-outputs/1"  # before identities: its outputs are kept and named once
MAX_RUNS = 1024  # input sets (a batch: each model) remembered per OUTDIR; the least recently run are forgotten
MAX_RECORD = 64 << 20  # ~150 bytes a file: a folder of 100,000 files
_KEY = re.compile(r"[0-9a-f]{32}")
_DIGEST_NAMED = re.compile(r".+\.[0-9a-f]{12}\.[A-Za-z0-9]+")  # a blob's name (<base>.<digest12><suffix>)

Identity = list[int]  # [st_dev, st_ino, st_size, st_ctime_ns]


# What a format still needs although no model names it (a TFLite XNNPACK cache that matches its model, an
# ExecuTorch .ptd a program beside it reads): kept.
NEEDED: list[Callable[[Path], bool]] = []
# Suffixes of files a format reads as a model's data although they carry a model suffix (ExecuTorch's .ptd): such a
# file is removed, like a blob, only when nothing still needs it, and it never keeps its run's other files.
DATA_SUFFIXES: set[str] = set()


def before_record_write() -> None:
    """Called under the commit's locks between reading the record and writing it back (tests replace it)."""


def run_key(kind: str, inputs: list[Path]) -> str:
    """The record's key of a run's inputs: not the paths themselves, which would publish the converting
    machine's directories with OUTDIR; not resolved (a hub snapshot's link path stays one key across revisions)."""
    text = kind + "\n" + "\n".join(sorted(os.path.abspath(i) for i in inputs))
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def named_key(kind: str, name: str) -> str:
    """The record's key of a run known by a name within OUTDIR (a zoo: its blob's NAME), whatever its inputs."""
    return hashlib.sha256(f"{kind}\n{name}".encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _valid(rel: object) -> bool:
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        return False
    p = PurePosixPath(rel)
    return (
        not p.is_absolute()
        and ".." not in p.parts
        and p.name != RECORD
        and str(p) == rel
        and not any(part.startswith(TMP_PREFIX) or part in ("", ".") for part in p.parts)
    )


def _identity(x: object, extra: int = 0) -> bool:
    return isinstance(x, list) and len(x) == 4 + extra and all(type(v) is int for v in x[:4])


def _seal(runs: object) -> str:
    return hashlib.sha256(json.dumps(runs, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _well_formed(runs: object) -> bool:
    if not isinstance(runs, dict):
        return False
    for key, entry in runs.items():
        if not (isinstance(key, str) and _KEY.fullmatch(key) and isinstance(entry, dict)):
            return False
        outputs, dropped, at = entry.get("outputs"), entry.get("dropped"), entry.get("at")
        if not (isinstance(outputs, dict) and isinstance(dropped, dict) and isinstance(at, (int, float))):
            return False
        if not all(_valid(r) and _identity(i) for r, i in outputs.items()):
            return False
        if not all(_valid(r) and _identity(i, 1) and isinstance(i[4], (int, float)) for r, i in dropped.items()):
            return False
    return True


def open_dir_nofollow(out_fd: int, parts: tuple[str, ...]) -> list[int]:
    """Descriptors of each directory from OUTDIR down to ``parts``, none reached through a link (the caller
    closes them). Raises OSError (ELOOP, ENOTDIR) at a link or a file in the way."""
    fds = [os.dup(out_fd)]
    try:
        for part in parts:
            fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1]))
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def stat_below(out_fd: int, rel: str) -> os.stat_result | None:
    parts = PurePosixPath(rel).parts
    try:
        fds = open_dir_nofollow(out_fd, parts[:-1])
    except OSError:
        return None
    try:
        return os.stat(parts[-1], dir_fd=fds[-1], follow_symlinks=False)
    except OSError:
        return None
    finally:
        for fd in fds:
            os.close(fd)


def identity_of(st: os.stat_result) -> Identity:
    return [st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns]


def identity_at(out_fd: int, rel: str, st: os.stat_result) -> Identity:
    """``identity_of`` OUTDIR/``rel`` (``st``: its lstat); a directory's (a Core ML package) covers its whole tree,
    in place of its size: a file added, edited or removed deep inside changes no ctime of the directory itself."""
    if not stat.S_ISDIR(st.st_mode):
        return identity_of(st)
    tree = hashlib.sha256()
    fds = open_dir_nofollow(out_fd, PurePosixPath(rel).parts)
    try:
        for root, dirs, files, root_fd in os.fwalk(".", dir_fd=fds[-1], follow_symlinks=False):
            dirs.sort()  # links to directories are listed here, stat-ed below as links, never entered
            for name in sorted((*dirs, *files)):
                e = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
                line = f"{root}/{name}\0{e.st_mode} {e.st_ino} {e.st_size} {e.st_ctime_ns}\n"
                tree.update(line.encode("utf-8", "surrogateescape"))
    finally:
        for fd in fds:
            os.close(fd)
    return [st.st_dev, st.st_ino, int.from_bytes(tree.digest()[:7], "big"), st.st_ctime_ns]


class OutputsRecord(CommitHook):
    """The record's update, run last at commit (``attach``), under the OUTDIR lock."""

    def __init__(self, out: Path, grace_s: float, notes: list[str]) -> None:
        self.out, self.grace_s, self.notes = Path(out), grace_s, notes
        self.runs: dict[str, list[Path]] = {}  # key -> this run's files for it
        self.inputs: list[Path] = []
        self.void = ""  # why the record read last vouches for nothing ("" when it is sound or absent)

    def add(self, key: str, finals: list[Path], inputs: list[Path]) -> None:
        self.runs.setdefault(key, []).extend(finals)
        self.inputs += inputs

    def relative(self, final: Path) -> str | None:
        rel = os.path.relpath(os.path.abspath(final), os.path.abspath(self.out)).replace(os.sep, "/")
        return rel if _valid(rel) else None

    def after(self) -> None:
        try:
            out_fd = os.open(self.out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # OUTDIR as named: followed once
        except OSError:
            return
        try:
            self._update(out_fd)
        except OSError as e:  # housekeeping: the outputs are committed; an unwritten record only keeps more
            self.notes.append(f"warning: {RECORD} not updated ({e.strerror or e}); nothing was removed")
        finally:
            os.close(out_fd)

    def _update(self, out_fd: int) -> None:
        now = time.time()
        runs = self.read_runs(out_fd)
        mine: dict[str, dict[str, Identity]] = {}
        written: set[str] = set()
        for key, finals in self.runs.items():
            mine[key] = {}
            for final in finals:
                rel = self.relative(final)
                if rel is None:
                    continue
                written.add(rel)
                st = stat_below(out_fd, rel)
                if st is not None:  # else written through a link below OUTDIR: never ours to remove
                    mine[key][rel] = identity_at(out_fd, rel, st)
        for key, entry in runs.items():  # what this run wrote is its own now: the old identities are stale
            if key in mine:
                continue
            entry["outputs"] = {r: i for r, i in entry["outputs"].items() if r not in written}
            entry["dropped"] = {r: i for r, i in entry["dropped"].items() if r not in written}
            if entry["outputs"] and not any(_is_model(r) for r in entry["outputs"]):
                # every model it wrote was replaced by another run's: nothing it wrote is needed for them
                entry["dropped"].update({r: [*i, now] for r, i in entry["outputs"].items()})
                entry["outputs"] = {}
        for key, files in mine.items():
            previous = runs.get(key, {"outputs": {}, "dropped": {}})
            dropped = {r: i for r, i in previous["dropped"].items() if r not in written}
            for r, i in previous["outputs"].items():
                if r not in written and r not in dropped:
                    dropped[r] = [*i, now]  # no longer written: its grace period starts with this commit
            runs[key] = {"outputs": files, "dropped": dropped, "at": now}
        live = written | {r for e in runs.values() for r in e["outputs"]}
        due = sorted(
            {r for e in runs.values() for r, i in e["dropped"].items() if now - i[4] >= self.grace_s},
            key=lambda r: (not _is_model(r), r),  # models first: a blob only they named is free once they are gone
        )
        for r in due:
            kept = None if r in live else self._remove(out_fd, r, [i for e in runs.values() for i in _at(e, r)])
            if kept == "named":
                continue  # a model still names it: dropped still, tried again by a later run
            for e in runs.values():
                e["dropped"].pop(r, None)
            if kept is not None:
                self.notes.append(f"kept {r}: {kept}")
        self._note_unrecorded(out_fd, written, runs)
        others = sorted((kv for kv in runs.items() if kv[0] not in mine), key=lambda kv: kv[1]["at"])
        keep = max(0, MAX_RUNS - len(mine))  # this run's entries always stay: forgetting them would keep their files
        runs = dict(others[len(others) - keep :] if keep else []) | {k: runs[k] for k in mine}
        before_record_write()
        self.write_runs(out_fd, runs)

    def read_runs(self, out_fd: int, quiet: bool = False) -> dict[str, dict[str, Any]]:
        """The record's runs; {} when there is none or it vouches for nothing (noted unless ``quiet``)."""
        try:
            fd = os.open(RECORD, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=out_fd)
        except FileNotFoundError:
            return {}
        except OSError:
            return self._foreign("is not a regular file", quiet)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RECORD:
                return self._foreign("is not a regular file of a plausible size", quiet)
            raw = os.read(fd, MAX_RECORD + 1)
        finally:
            os.close(fd)
        try:
            data = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return self._foreign("is not JSON", quiet)
        if isinstance(data, dict) and data.get("format") == OLD_FORMAT:
            self.void = "is an earlier weightshare version's, with no file identities"
            if not quiet:
                self._note_old(data.get("runs"))
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return self._foreign("is not a record of this weightshare version", quiet)
        runs = data.get("runs")
        if not _well_formed(runs) or data.get("seal") != _seal(runs):
            return self._foreign("was edited or is damaged (its seal does not match)", quiet)
        assert isinstance(runs, dict)
        return runs

    def _foreign(self, why: str, quiet: bool = False) -> dict[str, dict[str, Any]]:
        self.void = why
        if quiet:
            return {}
        self.notes.append(
            f"warning: {self.out / RECORD} {why}: nothing was removed; it is replaced by this run's record"
        )
        return {}

    def _note_old(self, runs: object) -> None:
        listed = sorted(
            {
                r
                for e in (runs.values() if isinstance(runs, dict) else [])
                if isinstance(e, dict)
                for r in (e.get("outputs") or [])
                if _valid(r)
            }
        )
        if listed:
            shown = ", ".join(listed[:8]) + (f" and {len(listed) - 8} more" if len(listed) > 8 else "")
            self.notes.append(
                f"{len(listed)} files an earlier weightshare version recorded in {RECORD} carry no identity and are "
                f"kept from now on: {shown} (remove by hand those no model needs)"
            )

    def _remove(self, out_fd: int, rel: str, recorded: list[Identity]) -> str | None:
        """Unlink OUTDIR/``rel`` if it is still the file recorded; else why it is kept ("named": a model beside
        it names it). None when removed or already gone."""
        parts = PurePosixPath(rel).parts
        try:
            fds = open_dir_nofollow(out_fd, parts[:-1])
        except FileNotFoundError:
            return None
        except OSError:
            return "its directory is a link or not a directory (nothing below OUTDIR is followed)"
        try:
            try:
                st = os.stat(parts[-1], dir_fd=fds[-1], follow_symlinks=False)
            except FileNotFoundError:
                return None
            if not stat.S_ISREG(st.st_mode):
                return "not a regular file (a link or a directory)"
            if not any(identity_of(st) == i[:4] for i in recorded):
                return "changed or replaced since weightshare wrote it"
            if (st.st_dev, st.st_ino) in self._input_ids():
                return "an input of this run"
            if not _is_model(rel) and self._named(rel):
                return "named"
            os.unlink(parts[-1], dir_fd=fds[-1])
            for level in range(len(parts) - 1, 0, -1):  # a subfolder the folder no longer has, if now empty
                try:
                    os.rmdir(parts[level - 1], dir_fd=fds[level - 1])
                except OSError:
                    break
            return None
        finally:
            for fd in fds:
                os.close(fd)

    def _input_ids(self) -> set[tuple[int, int]]:
        ids = set()
        for i in self.inputs:
            try:
                st = os.stat(i)
            except OSError:
                continue
            ids.add((st.st_dev, st.st_ino))
        return ids

    def _named(self, rel: str) -> bool:
        """A model in the file's directory or in OUTDIR names it (a blob some model still references), or a format
        still needs it (``NEEDED``)."""
        from ._pipeline import referenced_names

        path = self.out / rel
        return bool(referenced_names([path], {path.parent, self.out})) or any(still(path) for still in NEEDED)

    def _note_unrecorded(self, out_fd: int, written: set[str], runs: dict[str, dict[str, Any]]) -> None:
        """Blobs beside this run's that no record names and no model references: kept, and said so once per run."""
        known = written | {r for e in runs.values() for r in (*e["outputs"], *e["dropped"])}
        dirs = {str(PurePosixPath(r).parent) for r in written if _DIGEST_NAMED.fullmatch(PurePosixPath(r).name)}
        found = []
        for d in sorted(dirs):
            parts = () if d == "." else PurePosixPath(d).parts
            try:
                fds = open_dir_nofollow(out_fd, parts)
            except OSError:
                continue
            try:
                names = os.listdir(fds[-1])
            finally:
                for fd in fds:
                    os.close(fd)
            for name in sorted(names):
                rel = name if d == "." else f"{d}/{name}"
                if rel in known or not _DIGEST_NAMED.fullmatch(name) or name.startswith(TMP_PREFIX):
                    continue
                st = stat_below(out_fd, rel)
                if st is not None and stat.S_ISREG(st.st_mode) and not self._named(rel):
                    found.append(rel)
        if found:
            shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
            self.notes.append(
                f"kept {shown}: no record of weightshare names {'it' if len(found) == 1 else 'them'} (written by an "
                "earlier version, or not by weightshare) and no model references it; remove by hand if not needed"
            )

    def write_runs(self, out_fd: int, runs: dict[str, dict[str, Any]]) -> None:
        text = json.dumps({"format": FORMAT, "runs": runs, "seal": _seal(runs)}, indent=1, sort_keys=True) + "\n"
        tmp = self.tmp_name
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=out_fd)
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp, dir_fd=out_fd)
            raise
        os.close(fd)
        try:
            os.replace(tmp, RECORD, src_dir_fd=out_fd, dst_dir_fd=out_fd)
        except BaseException:
            os.unlink(tmp, dir_fd=out_fd)
            raise

    tmp_name = ""  # set by ``attach``: a name this transaction's guard protects

    def remove_recorded(self, keys: set[str]) -> bool:
        """Remove every file the record proves the runs ``keys`` wrote in OUTDIR (models first), then the record
        itself if it names no other run and nothing was kept (``weightshare demo --clean``: a user's own
        conversion into the same OUTDIR is another run, and stays); each file kept is a note. True if any went."""
        try:
            out_fd = os.open(self.out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            every = self.read_runs(out_fd)
            runs, gone, noted = {k: e for k, e in every.items() if k in keys}, False, len(self.notes)
            named = sorted({r for e in runs.values() for r in (*e["outputs"], *e["dropped"])})
            for r in sorted(named, key=lambda r: (not _is_model(r), r)):
                ids = [
                    i for e in runs.values() for i in (*_at(e, r), *([e["outputs"][r]] if r in e["outputs"] else []))
                ]
                kept = self._remove(out_fd, r, ids)
                if kept is not None:
                    self.notes.append(
                        f"kept {self.out / r}: {'a model beside it names it' if kept == 'named' else kept}"
                    )
                gone = gone or kept is None
            if runs and len(runs) == len(every) and len(self.notes) == noted:
                os.unlink(RECORD, dir_fd=out_fd)
            return gone
        finally:
            os.close(out_fd)


def _at(entry: dict[str, Any], rel: str) -> list[Identity]:
    i = entry["dropped"].get(rel)
    return [i] if i is not None else []


def _is_model(rel: str) -> bool:
    from ._paths import model_file_suffixes

    suffixes = model_file_suffixes()  # first: it imports the formats, which declare their DATA_SUFFIXES
    suffix = PurePosixPath(rel).suffix
    return (suffixes is None or suffix in suffixes) and suffix not in DATA_SUFFIXES
