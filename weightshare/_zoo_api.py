"""A zoo: many models into one directory, all of them referencing one shared blob (``weightshare.convert_zoo``,
``weightshare.convert(..., shared_blob=NAME)``)."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from ._atomic import OutputTransaction
from ._disk import DiskPeak
from ._folder import FolderReport, copied_as_is, is_model_folder, run_folder
from ._inputs import hold, plan_inputs, planned_inputs
from ._outputs_record import RECORD, named_key
from ._pipeline import PreparedModel, blob_target, write_models
from ._replacement import attach
from ._run import check_input, check_outputs, convert_one, finish, peak_window, prepare_out_dir, stages_named
from .errors import Unsupported, UsageError
from .formats import Format, detect
from .options import ConvertOptions
from .report import ZooReport

if TYPE_CHECKING:  # imported where used: `convert` needs none of them (start-up time)
    from .formats.base import BlobContainer


_ZOO_MARKER = ".weightshare-zoo.json"  # what the zoo holds (its blob, its models); it decides no removal


def run_zoo(sources: list[Path], out: Path, options: ConvertOptions) -> ZooReport:
    """``weightshare.convert_zoo`` (documented there): ``sources`` expanded, options checked (``check_options``),
    ``options.shared_blob`` set. One model folder given alone keeps its tree (``run_family_folder``)."""
    shared_blob = options.shared_blob
    if shared_blob is None:
        raise UsageError("a zoo needs its blob's name (--shared-blob)")
    if len(sources) == 1 and is_model_folder(sources[0]):
        return run_family_folder(sources[0], out, options)
    if not sources:
        raise UsageError("no models to convert")
    if out.exists() and not out.is_dir():
        raise UsageError("output must be a directory", out)
    if out.exists() and any(out.iterdir()) and not any((out / n).exists() for n in (_ZOO_MARKER, RECORD)):
        raise UsageError(
            "output directory is not empty and was not written by --shared-blob; choose an empty or new directory", out
        )
    for s in sources:
        if s.resolve().parent == out.resolve():
            raise UsageError("an input lies in the output directory, which is rewritten as a whole", s)
    check_outputs(sources, [out / s.name for s in sources])
    for s in sources:
        check_input(s)
    # every later open of a source is checked against its identity now (a link: its target's)
    notes: list[str] = []  # what the outputs record kept, and why
    with planned_inputs(plan_inputs(sources), named=True):
        formats = [detect(s) for s in sources]
        blob_target(None, out, shared_blob, _shared_container(sources, formats))  # the name refused before writing
        start = time.perf_counter()
        with peak_window(), OutputTransaction() as tx:
            prepare_out_dir(out, tx)
            record = attach(tx, out, options.blob_grace_s, notes)
            report = write_zoo(sources, formats, out, options, tx)
            marker = tx.new_file(out / _ZOO_MARKER)
            names = [Path(o).name for m in report.models for o in m.outputs if o != report.blob]
            marker.write_text(json.dumps({"blob": Path(report.blob).name, "models": names}, indent=1) + "\n")
            # keyed by the zoo (OUTDIR's blob NAME), not its models: a model dropped from the inputs is dropped here
            record.add(named_key("zoo", shared_blob), tx.finals(), sources)
    report.models[-1].notes.extend(notes)
    finish(report, start)  # the process tree's peak: the converter and the ORT children it ran
    for m in report.models:
        m.wall_time_s, m.peak_rss_mib = report.wall_time_s, report.peak_rss_mib
    return report


def write_zoo(
    sources: list[Path], formats: list[Format], out: Path, options: ConvertOptions, tx: OutputTransaction
) -> ZooReport:
    """Stage ``sources`` (planned) into ``out`` with one blob they all reference; the report of what was staged."""
    assert options.shared_blob is not None
    target = blob_target(None, out, options.shared_blob, _shared_container(sources, formats))
    with ExitStack() as stages:
        disk = stages.enter_context(DiskPeak(out)) if options.prepack else None  # entered first: exits last
        plan = getattr(formats[0], "plan_shared", None)
        if plan is not None and all(f is formats[0] for f in formats):  # one staged blob for every model
            plan(sources, out, options, stages)
        prepared = []
        for fmt, src in zip(formats, sources):
            # opened once, checked against the plan; its payload sources keep that descriptor
            with hold(src), stages_named(options, src.name, len(sources) > 1):
                prepared.append(_prepare_zoo_model(fmt, src, out, options, stages))
        for p, src in zip(prepared, sources):
            p.name_prefix = f"{src.stem}/" if len(prepared) > 1 else ""
        for fmt in {id(f): f for f in formats}.values():  # what models sharing one blob record together
            join = getattr(fmt, "join_shared", None)
            if join is not None:
                join([p for p, f in zip(prepared, formats) if f is fmt], options)
        writers = [p.extra.get("write_blob") for p in prepared]
        whole = bool(writers) and all(w is not None and w == writers[0] for w in writers)  # one staging, every model
        write_models(prepared, out, target, options, tx, writers[0] if whole else None)
    blob = next((o for p in prepared for o in p.report.outputs if o.endswith(target.container.suffix)), "")
    report = ZooReport(blob=blob, models=[p.report for p in prepared], blob_bytes=prepared[0].report.blob_bytes)
    report.blobs = [blob] if blob else []
    if disk is not None:
        for fmt, m in zip(formats, report.models):
            note = getattr(fmt, "report_disk", None)  # the format says what its temporary disk was for
            if note is not None and m.prepack:
                note(m, disk.peak)
    return report


def run_family_folder(folder: Path, out: Path, options: ConvertOptions) -> ZooReport:
    """A model folder with ``--shared-blob``: its tree and side files kept, as ``convert DIR`` keeps them, and the
    models of each directory in one blob there. ONNX external data must lie in the model's directory or below it
    (ONNX Runtime refuses ``../`` and absolute locations), so models in different directories cannot share one
    file: each directory holding models gets its own (an optimum export's ``onnx/``: the whole family)."""
    zoos: list[ZooReport] = []

    def step(
        folder: Path, models: list[Path], out_dir: Path, opts: ConvertOptions, tx: OutputTransaction, fr: FolderReport
    ) -> None:
        groups: dict[Path, list[Path]] = {}
        for rel in models:
            groups.setdefault(rel.parent, []).append(rel)
        for where, rels in groups.items():
            tx.make_dirs(out_dir / where, under=out_dir)
            sources, formats = [], []
            for rel in rels:
                with hold(folder / rel):
                    fmt = detect(folder / rel)
                    if copied_as_is(folder, rel, fmt, out_dir, opts, tx, fr):
                        continue
                    if fmt.blob_container is None:  # its weights stay in its own files: converted as a folder run does
                        t0 = time.perf_counter()
                        fr.models.append(finish(convert_one(fmt, folder / rel, out_dir / where, opts, tx), t0))
                        continue
                sources.append(folder / rel)
                formats.append(fmt)
            if sources:
                t0 = time.perf_counter()
                zoo = write_zoo(sources, formats, out_dir / where, opts, tx)
                for m in zoo.models:
                    finish(m, t0)
                fr.models += zoo.models
                zoos.append(zoo)

    fr = run_folder(folder, out, options, step)
    report = ZooReport(
        blob=next((z.blob for z in zoos if z.blob), ""),
        models=fr.models,
        blob_bytes=sum(z.blob_bytes for z in zoos),
        wall_time_s=fr.wall_time_s,
        peak_rss_mib=fr.peak_rss_mib,
    )
    report.blobs = [b for z in zoos for b in z.blobs]
    report.folder, report.copied, report.copied_bytes, report.notes = fr.folder, fr.copied, fr.copied_bytes, fr.notes
    return report


def _shared_container(sources: list[Path], formats: list[Format]) -> BlobContainer:
    """The container of a zoo's one blob: the one every model's format declares (``Format.blob_container``)."""
    first = formats[0].blob_container
    for src, fmt in zip(sources, formats):
        container = fmt.blob_container
        if container is None:
            raise Unsupported(f"{fmt.name} models keep their weights in their own files: they cannot share a blob", src)
        if first is None or container != first:
            raise Unsupported("these models' formats keep a shared blob in different containers", src)
    assert first is not None
    return first


def _prepare_zoo_model(fmt: Format, src: Path, out: Path, options: ConvertOptions, stages: ExitStack) -> PreparedModel:
    """One zoo model's payloads: the format's ``prepare_shared`` when it has one (it may stage files that ``stages``
    removes, e.g. ONNX --prepack), else its ``prepare``."""
    prepare_shared = getattr(fmt, "prepare_shared", None)
    if prepare_shared is not None:
        prepared: PreparedModel = prepare_shared(src, out, options, stages)
        return prepared
    return fmt.prepare(src, out, options)
