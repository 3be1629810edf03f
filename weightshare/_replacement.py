"""What a run may replace in OUTDIR: only what the outputs record (``_outputs_record``) proves weightshare wrote.

At commit, under the OUTDIR lock and before any rename (``ReplacementProof.before``, the transaction's first hook),
each output path must hold nothing, or a file, directory or link that the record names at that path with the
identity it had right after weightshare wrote it (device, inode, size, ctime: the removal rule's proof). Anything
else stops the run with nothing written: a user's file, link or directory at an output path, an output edited,
chmod-ed or replaced since, a path below a link or a file in OUTDIR, and every file when the record vouches for
nothing (missing, edited, damaged, an earlier version's). The record is read under the lock, so a concurrent run's
outputs, recorded before this one commits, are this run's to replace.

A rename that fails at commit puts back what the renames replaced, each through a link and a rename (same inode,
new ctime); ``ReplacementProof.undone`` records the new identities, so that they stay provably weightshare's.
"""

from __future__ import annotations

import os
import stat
import weakref
from pathlib import Path, PurePosixPath

from ._atomic import CommitHook, OutputTransaction
from ._outputs_record import RECORD, Identity, OutputsRecord, identity_at, open_dir_nofollow, stat_below
from .errors import OutputError, UsageError

_UNRECORDED = "exists, and no weightshare record says it wrote it (your file, or an earlier version's)"


def attach(tx: OutputTransaction, out: Path, grace_s: float, notes: list[str]) -> OutputsRecord:
    """The run's record update, run last at ``tx``'s commit under the OUTDIR lock (the caller ``add``s its files),
    and before it, ahead of any rename, the proof that every output path may be replaced."""
    record = OutputsRecord(out, grace_s, notes)
    tx.guard(out)  # the record's temporary is this transaction's: a concurrent run's cleanup leaves it alone
    record.tmp_name = tx.temp_name(Path(out) / RECORD).name
    tx.record_dir = Path(out)
    tx.add_hook(ReplacementProof(record, tx))  # the first hook: before any rename
    tx.after_commit(record.after)  # after every hook: nothing else touches the outputs once they are recorded
    return record


class ReplacementProof(CommitHook):
    """``before``: refuse to replace what ``record`` does not prove weightshare wrote; ``undone``: restamp."""

    def __init__(self, record: OutputsRecord, tx: OutputTransaction) -> None:
        self.record, self.tx = record, weakref.ref(tx)  # not a cycle: the run's ORT child ends when ``tx`` goes
        self.vetted: dict[str, Identity] = {}  # what this run's outputs replace, as recorded

    def before(self) -> None:
        tx = self.tx()
        assert tx is not None  # it is committing
        out, rec = self.record.out, self.record
        try:
            out_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # OUTDIR as named: followed once
        except OSError as e:
            raise OutputError(f"cannot open output directory: {e.strerror}", out) from None
        try:
            _refuse_a_non_record(out_fd, out)
            recorded: dict[str, list[Identity]] = {}
            for entry in rec.read_runs(out_fd, quiet=True).values():
                for r, i in (*entry["outputs"].items(), *entry["dropped"].items()):
                    recorded.setdefault(r, []).append(i[:4])
            for final in tx.finals():
                rel = rec.relative(final)
                why, now = _unproven(out_fd, rel, recorded) if rel is not None else (_unproven_outside(final), None)
                if rel is not None and now is not None:
                    self.vetted[rel] = now  # what this run replaces, as recorded
                if why == _UNRECORDED and rec.void:
                    why = f"exists, and {RECORD} {rec.void}, so nothing proves weightshare wrote it"
                if why is not None:
                    raise UsageError(
                        f"{why}: nothing was written (weightshare replaces only the outputs its {RECORD} records; "
                        "move it away or choose another output directory)",
                        final,
                    )
        finally:
            os.close(out_fd)

    def undone(self) -> None:
        """The files the failed commit put back: their new identities recorded (best effort, as the undo)."""
        try:
            out_fd = os.open(self.record.out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            runs, moved = self.record.read_runs(out_fd, quiet=True), {}
            for rel, old in self.vetted.items():
                st = stat_below(out_fd, rel)
                now = identity_at(out_fd, rel, st) if st is not None else None
                if now is not None and now[:3] == old[:3] and now != old:
                    moved[rel] = (old, now)
            for entry in runs.values():
                for part in (entry["outputs"], entry["dropped"]):
                    for rel, (old, new) in moved.items():
                        if rel in part and part[rel][:4] == old:
                            part[rel] = new + part[rel][4:]
            if moved and runs:
                self.record.write_runs(out_fd, runs)
        except OSError:
            pass  # a file the record no longer vouches for is only kept, and the next run says so
        finally:
            os.close(out_fd)


def _refuse_a_non_record(out_fd: int, out: Path) -> None:
    """The record's own path is written too: a link, directory or other non-file there is never weightshare's
    record (it writes a regular file, by a rename), so it stays; a regular file there is a record, sound or void."""
    try:
        st = os.stat(RECORD, dir_fd=out_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        what = "a link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "not a file"
        raise UsageError(
            f"is {what}, not weightshare's record: nothing was written (move it away or choose another output "
            "directory)",
            Path(out) / RECORD,
        )


def _unproven(out_fd: int, rel: str, recorded: dict[str, list[Identity]]) -> tuple[str | None, Identity | None]:
    """(why OUTDIR/``rel`` may not be replaced: something is there that the record does not name with its
    identity, or None when nothing is there or the record proves weightshare wrote it; that identity, if any)."""
    parts = PurePosixPath(rel).parts
    try:
        fds = open_dir_nofollow(out_fd, parts[:-1])
    except FileNotFoundError:
        return None, None  # its directory is still to be made: nothing can be there
    except OSError:
        return "lies below a link or a file in the output directory", None
    try:
        st = os.stat(parts[-1], dir_fd=fds[-1], follow_symlinks=False)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return f"cannot be examined ({e.strerror})", None
    finally:
        for fd in fds:
            os.close(fd)
    try:
        now = identity_at(out_fd, rel, st)
    except OSError as e:
        return f"cannot be examined ({e.strerror})", None
    if any(now == i for i in recorded.get(rel, [])):
        return None, now
    if stat.S_ISLNK(st.st_mode):
        return "is a link weightshare did not write", now
    old_style = [st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns]  # a directory as recorded before its tree counted
    if stat.S_ISDIR(st.st_mode) and old_style in recorded.get(rel, []):
        return "was recorded by an earlier weightshare version, whose record cannot vouch for the files inside it", now
    if rel in recorded:
        return "was changed or replaced since weightshare wrote it", now
    return _UNRECORDED, now


def _unproven_outside(final: Path) -> str | None:
    """An output outside OUTDIR (none is planned there): refused if anything is at its path."""
    return "exists (outside the output directory)" if os.path.lexists(final) else None
