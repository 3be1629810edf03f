"""What a run wrote into OUTDIR, so that a re-run of the same inputs leaves OUTDIR as if freshly converted.

A folder conversion records, in ``OUTDIR/.weightshare-folder.json`` (committed with its outputs), the files it
wrote, keyed by its inputs (their absolute paths, not resolved: a hub snapshot's link path stays one key across
revisions). The next run of the same inputs compares: an output of the earlier run that this run did not write (a
model or side file gone from the folder, its blob) is dropped from that commit on and removed once it has been
dropped for ``--blob-grace`` seconds (readers that opened the old model still find it meanwhile), under the
commit's directory locks.

The record is a file anyone can edit: only plain relative paths inside OUTDIR are ever removed, never a symlink,
a directory, a temporary, an input, a file another recorded run still lists, or a file a model in its directory
still names (a blob some other model references).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path, PurePosixPath
from typing import Any

from ._atomic import TMP_PREFIX, CommitHook, OutputTransaction

RECORD = ".weightshare-folder.json"  # written by folder conversions (a zoo has its own)
MAX_RUNS = 64  # input sets remembered per OUTDIR (the least recently run are forgotten)
MAX_RECORD = 4 << 20


def _valid(rel: object) -> bool:
    if not isinstance(rel, str) or not rel or "\x00" in rel or "\\" in rel:
        return False
    p = PurePosixPath(rel)
    return (
        not p.is_absolute()
        and ".." not in p.parts
        and p.name != RECORD
        and not any(part.startswith(TMP_PREFIX) or part in ("", ".") for part in p.parts)
    )


def _read(out: Path) -> dict[str, dict[str, Any]]:
    path = out / RECORD
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_RECORD:
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    runs = data.get("runs") if isinstance(data, dict) else None
    return (
        {k: v for k, v in runs.items() if isinstance(k, str) and isinstance(v, dict)} if isinstance(runs, dict) else {}
    )


def record_run(tx: OutputTransaction, out_dir: Path, inputs: list[Path], grace_s: float) -> None:
    """At the end of a run's transaction body: stage the new record, and remove at commit what is due."""
    out = Path(out_dir)
    key = "\n".join(sorted(os.path.abspath(i) for i in inputs))
    base = os.path.abspath(out)
    written: set[str] = set()
    for final in tx.finals():
        rel = os.path.relpath(os.path.abspath(final), base)
        if _valid(rel.replace(os.sep, "/")):
            written.add(rel.replace(os.sep, "/"))
    runs = _read(out)
    previous = runs.get(key, {})
    now = time.time()
    old_dropped = previous.get("dropped", {})
    dropped: dict[str, float] = {
        r: float(t)
        for r, t in (old_dropped.items() if isinstance(old_dropped, dict) else [])
        if _valid(r) and isinstance(t, (int, float)) and r not in written and t == t
    }
    old_outputs = previous.get("outputs", [])
    for r in old_outputs if isinstance(old_outputs, list) else []:
        if _valid(r) and r not in written and r not in dropped:
            dropped[r] = now  # no longer written: its grace period starts with this commit
    due = sorted(r for r, t in dropped.items() if now - t >= grace_s)
    for r in due:
        del dropped[r]
    runs[key] = {"outputs": sorted(written), "dropped": dropped, "at": now}
    kept = sorted(runs.items(), key=lambda kv: kv[1].get("at", 0) if isinstance(kv[1].get("at"), (int, float)) else 0)
    runs = dict(kept[-MAX_RUNS:])
    others = (
        {r for k, v in runs.items() if k != key for r in (v.get("outputs") or []) if isinstance(r, str)}
        | set(dropped)
        | written
    )
    tmp = tx.new_file(out / RECORD)
    tmp.write_text(json.dumps({"format": "weightshare-outputs/1", "runs": runs}, indent=1) + "\n", encoding="utf-8")
    if due:
        tx.add_hook(_RemoveDue(out, [r for r in due if r not in others], inputs))


class _RemoveDue(CommitHook):
    """After the renames, under the OUTDIR locks: remove the outputs whose grace period is over."""

    def __init__(self, out: Path, due: list[str], inputs: list[Path]) -> None:
        self.out, self.due = out, due
        self.inputs = {os.path.realpath(i) for i in inputs}

    def after(self) -> None:
        from ._paths import model_file_suffixes
        from ._pipeline import referenced_names

        suffixes = model_file_suffixes() or ()  # none known: nothing is taken for a model, each is checked
        # models first: a blob that only a dropped model referenced is free once that model is gone
        for rel in sorted(self.due, key=lambda r: PurePosixPath(r).suffix not in suffixes):
            path = self.out / rel
            try:
                if path.is_symlink() or not path.is_file() or os.path.realpath(path) in self.inputs:
                    continue
                if path.suffix not in suffixes and referenced_names([path], {path.parent, self.out}):
                    continue  # still named by a model beside it: not stale
                path.unlink()
            except OSError:
                continue
            parent = path.parent
            while parent != self.out and self.out in parent.parents:
                try:
                    parent.rmdir()  # only if now empty (a subfolder the folder no longer has)
                except OSError:
                    break
                parent = parent.parent


class DroppedCompanions(CommitHook):
    """A model's companions that an earlier run with other options wrote and this run does not (``--prepack``'s
    portable twin after a plain re-conversion): removed once dropped for ``grace_s`` seconds.

    Registered before the blob collector, so that a blob only the dropped twin referenced is seen unreferenced
    in the same commit. The grace period starts at the commit that replaced the model the companion belonged to
    (its mtime is set then, as for blobs): a reader that opened the old model still finds its companion."""

    def __init__(self, model: Path, companions: list[Path], grace_s: float) -> None:
        self.model, self.companions, self.grace_s = model, companions, grace_s
        self.was_live: set[Path] = set()

    def before(self) -> None:
        import re

        self.was_live = set()
        try:
            old = self.model.read_bytes() if self.model.is_file() and not self.model.is_symlink() else b""
        except OSError:
            return
        for c in self.companions:
            try:
                if c.is_symlink() or not c.is_file():
                    continue
                names = set(re.findall(rb"[\w.+-]+\.[0-9a-f]{12}\.safetensors", c.read_bytes()))
            except OSError:
                continue
            if any(n in old for n in names):  # the model being replaced shares the companion's blob: a pair
                self.was_live.add(c)

    def after(self) -> None:
        now = time.time()
        for c in self.companions:
            try:
                if c.is_symlink() or not c.is_file():
                    continue
                if c in self.was_live:
                    os.utime(c, follow_symlinks=False)  # dropped from now on: the grace period starts here
                    if self.grace_s > 0:
                        continue
                elif now - c.stat(follow_symlinks=False).st_mtime < self.grace_s:
                    continue
                c.unlink()
            except OSError:
                continue


def dropped_companions(fmt: Any, src: Path, out: Path, options: Any) -> list[Path]:
    """The companions ``fmt`` (a ``Format``, which this module sits below) writes for ``src`` under other options
    (``Format.outputs``) that this run does not."""
    import dataclasses

    listed = fmt.outputs
    mine = set(listed(src, out, options))
    every = set(listed(src, out, dataclasses.replace(options, prepack=True))) | set(
        listed(src, out, dataclasses.replace(options, prepack=False))
    )
    return sorted(every - mine)
