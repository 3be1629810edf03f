"""Model folders: ``convert DIR -o OUT`` reproduces DIR's tree in OUT.

A Hugging Face, optimum or onnxruntime-genai folder holds models (``model.onnx``, ``onnx/decoder_model.onnx``) next
to the files that make them usable (``config.json``, ``tokenizer.json``, ``genai_config.json``, a README). Every
model is converted at its relative path; every other file is copied unchanged (streamed, its permission bits kept);
the files a model references for its weights (``model.onnx_data``) are not copied: the conversion replaces them by
its blob. Everything goes through the caller's ``OutputTransaction``: all of it appears, or none.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _inputs
from ._atomic import TMP_PREFIX, OutputTransaction, sweep_temporaries
from ._inputs import PlannedInput, hold, open_input, plan_input, planned_inputs
from ._outputs_record import RECORD, run_key
from ._paths import check_no_overlap, check_utf8_path
from ._replacement import attach
from ._run import convert_one, finish, peak_window, prepare_out_dir, stages_named
from ._stale import temporary
from .errors import OutputError, UnsafePath, Unsupported, UsageError
from .formats import Format, detect, model_suffixes
from .formats.base import KeepsAsIs
from .options import ConvertOptions
from .report import ConversionReport

__all__ = [
    "FolderPlan",
    "FolderReport",
    "ModelsStep",
    "copied_as_is",
    "copy_file",
    "is_model_folder",
    "plan_folder",
    "run_folder",
]


@dataclass
class FolderReport:
    """What ``convert_folder`` did: each model's report and the files copied unchanged (output paths)."""

    folder: str
    models: list[ConversionReport] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    copied_bytes: int = 0
    notes: list[str] = field(default_factory=list)  # models copied as they were (``KeepsAsIs``), and why
    wall_time_s: float = 0.0
    peak_rss_mib: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "folder": self.folder,
            "models": [m.to_dict() for m in self.models],
            "copied": self.copied,
            "copied_bytes": self.copied_bytes,
            "notes": self.notes,
            "wall_time_s": self.wall_time_s,
            "peak_rss_mib": self.peak_rss_mib,
        }


# Converts a folder's models (paths relative to the folder) into the transaction, adding to the report
ModelsStep = Callable[[Path, list[Path], Path, ConvertOptions, OutputTransaction, FolderReport], None]


def run_folder(
    folder: Path, out_dir: Path, opts: ConvertOptions, models_step: ModelsStep | None = None
) -> FolderReport:
    """``weightshare.convert_folder`` (documented there), after its options are checked (``check_options``).
    ``models_step`` converts the models (default: each on its own, ``_convert_each``); the walk, the copies, the
    record and the commit stay this function's."""
    if not is_model_folder(folder):
        raise UsageError("is not a folder of models (for one model, use convert)", folder)
    a, b = folder.resolve(), out_dir.resolve()
    if a == b or a in b.parents or b in a.parents:
        raise UsageError(f"output {out_dir} overlaps the model folder; choose an output outside it", folder)
    plan = plan_folder(folder)
    if not plan.models:
        raise UsageError("no models in this folder", folder)
    if opts.blob_name is not None and len(plan.models) > 1:
        raise UsageError("--blob names one model's blob; this folder has several models", folder)
    # a directory of OUT swapped for a link into the folder would have its outputs written over the inputs
    check_no_overlap([folder], [out_dir / rel for rel in plan.models + plan.copies])
    report = FolderReport(str(folder))
    report.notes += [
        f"{rel}: not copied: its name starts like weightshare's temporaries; rename it" for rel in plan.unlike
    ]
    start = time.perf_counter()
    notes: list[str] = []  # what the outputs record kept, and why
    with peak_window(), planned_inputs(plan.inputs), OutputTransaction() as tx:
        prepare_out_dir(out_dir, tx)
        sweep_temporaries(out_dir)  # a killed run's, in any subdirectory (side-file-only ones too)
        tx.guard(out_dir)  # one lock protects every temporary of the tree: open files stay few
        record = attach(tx, out_dir, opts.blob_grace_s, notes)
        roots = source_roots(folder)
        (models_step or _convert_each)(folder, plan.models, out_dir, opts, tx, report)
        for rel in plan.copies:
            tx.make_dirs(out_dir / rel.parent, under=out_dir)
            report.copied_bytes += copy_file(folder / rel, out_dir / rel, tx, roots)
            report.copied.append(str(out_dir / rel))
        record.add(run_key("folder", [folder]), tx.finals(), [folder])  # what a later run may drop
    (report.models[-1].notes if report.models else report.notes).extend(notes)
    return finish(report, start)


def _convert_each(
    folder: Path, models: list[Path], out_dir: Path, opts: ConvertOptions, tx: OutputTransaction, report: FolderReport
) -> None:
    """Each model at its relative path, with its own blob beside it."""
    for rel in models:
        model, where = folder / rel, out_dir / rel.parent
        tx.make_dirs(where, under=out_dir)
        t0 = time.perf_counter()
        # opened once, checked against the plan; every read of it goes through that
        with hold(model), stages_named(opts, rel, len(models) > 1):
            fmt = detect(model)
            if not copied_as_is(folder, rel, fmt, out_dir, opts, tx, report):
                report.models.append(finish(convert_one(fmt, model, where, opts, tx), t0))


def copied_as_is(
    folder: Path, rel: Path, fmt: Format, out: Path, opts: ConvertOptions, tx: OutputTransaction, report: FolderReport
) -> bool:
    """A model converting would refuse (``KeepsAsIs``): copied as it is, and said so."""
    why = fmt.kept_as_is(folder / rel, opts) if isinstance(fmt, KeepsAsIs) else ""
    if why:
        report.copied_bytes += copy_file(folder / rel, out / rel, tx, source_roots(folder))
        report.copied.append(str(out / rel))
        report.notes.append(f"{rel}: copied as it was: {why}")
    return bool(why)


def is_model_folder(path: Path) -> bool:
    """A directory that is not itself a model package (an ``.mlpackage`` is a model)."""
    return path.is_dir() and path.suffix not in model_suffixes()


@dataclass
class FolderPlan:
    """What a folder conversion does, every path relative to the folder, in walk order (sorted)."""

    models: list[Path] = field(default_factory=list)
    copies: list[Path] = field(default_factory=list)
    weight_files: list[Path] = field(default_factory=list)  # referenced by a model: converted, not copied
    inputs: list[PlannedInput] = field(default_factory=list)  # every model and file as planned: their identities
    unlike: list[Path] = field(default_factory=list)  # named with the temporaries' prefix, not as one: not copied


def plan_folder(folder: Path) -> FolderPlan:
    """Walk ``folder``: its models, the weight files they reference, and the files to copy.

    A file may be a symlink only when its real path stays inside the folder, or, in a Hugging Face hub snapshot
    (``models--ORG--NAME/snapshots/REV``), inside that cache's ``blobs/`` (``source_roots``): a link anywhere
    else (``tokenizer_config.json -> /proc/self/environ``, ``-> ~/.ssh/id_rsa``) would copy a file that is not
    part of the model into OUTDIR.

    Raises:
        Unsupported: a symlink to a directory (a loop, or a tree outside the folder).
        UnsafePath: a symlink whose real path leaves the folder (and its hub cache).
        UsageError: a FIFO, socket or device (it would block or never end); a directory that cannot be listed.
    """
    suffixes = model_suffixes()
    roots = source_roots(folder)
    plan = FolderPlan()
    files: list[Path] = []

    def unlistable(e: OSError) -> None:
        # a subdirectory left out would be a silently incomplete OUTDIR
        raise UsageError(f"cannot list this directory: {e.strerror or e}", e.filename or folder)

    for root, dirs, names in os.walk(folder, onerror=unlistable):
        here = Path(root)
        rel = here.relative_to(folder)
        for name in (*dirs, *names):
            check_utf8_path(here / name)  # the report (and --json) names every file
        for d in sorted(dirs):
            if (here / d).is_symlink():
                raise Unsupported("is a symlink to a directory inside a model folder; copy or remove it", here / d)
            if Path(d).suffix in suffixes:
                plan.models.append(rel / d)  # a model package: converted, not walked
                _plan_one(plan, here / d, roots)
        plan.unlike += [rel / n for n in sorted((*dirs, *names)) if n.startswith(TMP_PREFIX) and not temporary(n)]
        dirs[:] = sorted(d for d in dirs if Path(d).suffix not in suffixes and not d.startswith(TMP_PREFIX))
        for name in sorted(names):
            if name.startswith(TMP_PREFIX) or name == RECORD:
                continue  # another run's temporary; a converted folder's record (it speaks of that folder only)
            source_file(here / name, roots)
            _plan_one(plan, here / name, roots)
            (plan.models if Path(name).suffix in suffixes else files).append(rel / name)
    plan.models.sort()
    with planned_inputs(plan.inputs):  # the models read for their weight files are the files planned
        referenced = _weight_files(folder, plan.models)
    plan.weight_files = [f for f in files if f in referenced]
    plan.copies = [f for f in files if f not in referenced]
    return plan


def _plan_one(plan: FolderPlan, path: Path, roots: tuple[Path, ...]) -> None:
    """Record ``path``'s identity; its real path as recorded (what every later open must be) must lie in
    ``roots``, whatever the path showed when it was checked a moment before."""
    p = plan_input(path)
    if p is None:
        raise UsageError("cannot read: it disappeared while the folder was walked", path)
    target = Path(p.target)
    if not any(target == r or r in target.parents for r in roots):
        raise UnsafePath(f"resolves to {p.target[:200]}, outside the model folder; refusing to read it", path)
    plan.inputs.append(p)


def source_roots(folder: Path) -> tuple[Path, ...]:
    """Where the real path of a file in ``folder`` may lie: the folder itself (resolved) and, when the folder is
    (inside) a Hugging Face hub snapshot, ``models--ORG--NAME/blobs`` of that cache."""
    real = folder.resolve()
    roots = [real]
    for d in (real, *real.parents):
        if d.parent.name == "snapshots" and (d.parent.parent / "blobs").is_dir():
            roots.append(d.parent.parent / "blobs")
            break
    return tuple(roots)


def source_file(path: Path, roots: tuple[Path, ...]) -> os.stat_result:
    """Check that ``path`` is a regular file whose real path lies in ``roots``; its stat (links followed)."""
    try:
        st = os.stat(path)  # follows a symlink to a file (Hugging Face caches link into blobs/)
    except OSError as e:
        raise UsageError(f"cannot read: {e.strerror}", path) from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError("is not a regular file (a FIFO, socket or device); refusing to read it", path)
    if path.is_symlink():
        real = path.resolve()
        if not any(real == r or r in real.parents for r in roots):
            raise UnsafePath(
                f"is a symlink to {str(real)[:200]}, outside the model folder; refusing to copy it "
                "(copy the file into the folder, or remove the link)",
                path,
            )
    return st


def _weight_files(folder: Path, models: list[Path]) -> set[Path]:
    """Files that ``models`` reference for their weights (external data), relative to ``folder``."""
    from ._dispatch import inventory

    found: set[Path] = set()
    for model in models:
        for name in inventory(folder / model, hash_payloads=False).external_files:
            rel = Path(os.path.relpath(os.path.normpath(folder / model.parent / name), folder))
            if rel.parts[:1] != ("..",):  # outside the folder: the conversion refuses it (UnsafePath)
                found.add(rel)
    return found


def copy_file(src: Path, final: Path, tx: OutputTransaction, roots: tuple[Path, ...] | None = None) -> int:
    """Stage a byte-identical copy of ``src`` at ``final``, with ``src``'s permission bits; returns its size.

    ``src`` is opened once, at its checked real path, without following a link there, and the opened file must
    still lie inside ``roots`` (``source_roots``): a link swapped after the walk is refused, never copied."""
    roots = roots if roots is not None else (src.parent.resolve(),)
    source_file(src, roots)
    # planned: the file the walk checked (its recorded target, same identity); else wherever it resolves now
    f = open_input(src if _inputs.is_planned(src) else src.resolve(), roots, src)
    try:
        tmp = tx.new_file(final, stat.S_IMODE(os.fstat(f.fd).st_mode))
        try:
            with open(tmp, "wb") as out:
                done = 0
                while done < f.size:  # streamed in the kernel, never the whole file in memory
                    n = os.sendfile(out.fileno(), f.fd, done, min(f.size - done, 1 << 30))
                    if n == 0:
                        raise UsageError("changed while it was copied (shorter than when opened)", src)
                    done += n
        except OSError as e:
            raise OutputError(f"cannot write the copy: {e.strerror or e}", final) from None
        return f.size
    finally:
        f.close()
