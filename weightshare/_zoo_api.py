"""A zoo: many models into one directory, all of them referencing one shared blob (``weightshare.convert_zoo``,
``weightshare.convert(..., shared_blob=NAME)``)."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from ._atomic import CommitHook, OutputTransaction
from ._disk import DiskPeak
from ._inputs import hold, plan_inputs, planned_inputs
from ._paths import plain_file_name
from ._pipeline import PreparedModel, blob_target, write_models
from ._run import check_input, check_outputs, finish, peak_window, prepare_out_dir
from .errors import Unsupported, UsageError
from .formats import Format, detect, model_suffixes
from .options import ConvertOptions
from .report import ZooReport

if TYPE_CHECKING:  # imported where used: `convert` needs none of them (start-up time)
    from .formats.base import BlobContainer


_ZOO_MARKER = ".weightshare-zoo.json"


class _DropRemovedModels(CommitHook):
    """After a zoo commit: remove the models the previous zoo listed and this one does not."""

    def __init__(self, out: Path, keep: list[str]) -> None:
        self.out, self.keep = out, set(keep)
        self.old: list[str] = []

    def before(self) -> None:
        try:
            self.old = list(json.loads((self.out / _ZOO_MARKER).read_text()).get("models", []))
        except (OSError, ValueError, AttributeError):
            self.old = []

    def after(self) -> None:
        for name in self.old:
            # The marker is a file anyone can edit: only plain, visible model file names of an earlier zoo
            # (never the marker itself, a temporary, a path, or a name with a NUL byte).
            if not plain_file_name(name) or name in self.keep or not str(name).endswith(model_suffixes()):
                continue
            try:
                (self.out / name).unlink()
            except OSError:
                pass


def run_zoo(sources: list[Path], out: Path, options: ConvertOptions) -> ZooReport:
    """``weightshare.convert_zoo`` (documented there): ``sources`` expanded, options checked (``check_options``),
    ``options.shared_blob`` set."""
    shared_blob = options.shared_blob
    if shared_blob is None:
        raise UsageError("a zoo needs its blob's name (--shared-blob)")
    if not sources:
        raise UsageError("no models to convert")
    if out.exists() and not out.is_dir():
        raise UsageError("output must be a directory", out)
    if out.exists() and any(out.iterdir()) and not (out / _ZOO_MARKER).exists():
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
    with planned_inputs(plan_inputs(sources), named=True):
        formats = [detect(s) for s in sources]
        target = blob_target(None, out, shared_blob, _shared_container(sources, formats))
        start = time.perf_counter()
        with peak_window(), OutputTransaction() as tx, ExitStack() as stages:
            prepare_out_dir(out, tx)
            disk = (
                stages.enter_context(DiskPeak(out)) if options.prepack else None
            )  # zoo-wide; entered first: exits last
            prepared = []
            for fmt, src in zip(formats, sources):
                with hold(src):  # opened once, checked against the plan; its payload sources keep that descriptor
                    prepared.append(_prepare_zoo_model(fmt, src, out, options, stages))
            for p, src in zip(prepared, sources):
                p.name_prefix = f"{src.stem}/" if len(prepared) > 1 else ""
            for fmt in {id(f): f for f in formats}.values():  # what models sharing one blob record together
                join = getattr(fmt, "join_shared", None)
                if join is not None:
                    join([p for p, f in zip(prepared, formats) if f is fmt], options)
            write_models(prepared, out, target, options, tx)
            blob = next((o for p in prepared for o in p.report.outputs if o.endswith(".safetensors")), "")
            report = ZooReport(blob=blob, models=[p.report for p in prepared], blob_bytes=prepared[0].report.blob_bytes)
            names = [s.name for s in sources]
            written = [Path(o).name for p in prepared for o in p.report.outputs if not o.endswith(".safetensors")]
            marker = tx.new_file(out / _ZOO_MARKER)
            marker.write_text(json.dumps({"blob": Path(blob).name, "models": names}, indent=1) + "\n")
            tx.add_hook(_DropRemovedModels(out, list(dict.fromkeys(names + written))))
    if disk is not None:
        for fmt, m in zip(formats, report.models):
            note = getattr(fmt, "report_disk", None)  # the format says what its temporary disk was for
            if note is not None and m.prepack:
                note(m, disk.peak)
    finish(report, start)  # the process tree's peak: the converter and the ORT children it ran
    for m in report.models:
        m.wall_time_s, m.peak_rss_mib = report.wall_time_s, report.peak_rss_mib
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
