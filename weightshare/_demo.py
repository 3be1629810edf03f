"""`weightshare demo`: the whole story on a sample model, offline."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import api
from ._atomic import OutputTransaction
from ._outputs_record import OutputsRecord, run_key
from ._paths import no_link_below
from ._replacement import attach
from ._samples import mlp_onnx
from .options import ConvertOptions
from .report import JsonDict


def clean_demo(workdir: Path) -> tuple[bool, list[str]]:
    """Remove what ``run_demo`` wrote in ``workdir``: every file the outputs records of ``workdir`` and of its
    ``converted``/``prepacked`` OUTDIRs prove it wrote, then each of these directories if that left it empty
    (``--dir`` may name a user's folder: a file of the same name that the demo did not write is kept, and said so).
    (whether anything was removed, a note for each file kept)."""
    workdir = Path(workdir)
    notes: list[str] = []
    if not workdir.is_dir():
        return False, notes
    real = workdir.resolve()  # --dir itself, as named, is followed once (as the demo's run did); nothing below it
    removed, original = False, workdir / "mlp_fp16.onnx"
    for d in (real / "converted", real / "prepacked", real):
        if d.is_symlink() or not d.is_dir():
            continue
        # the demo's runs only (keyed by its model's path as named): a user's own conversion into converted/ stays
        key = run_key("demo" if d == real else "model", [original])
        removed = OutputsRecord(d, 0, notes).remove_recorded({key}) or removed
        if d != real:
            _rmdir_if_empty(d)
    if not workdir.is_symlink():
        _rmdir_if_empty(workdir)
    return removed or not workdir.exists(), notes


def _rmdir_if_empty(d: Path) -> None:
    try:
        os.rmdir(d)
    except OSError:
        pass  # not empty (a file kept), or gone


def run_demo(
    workdir: Path, sessions: int = 4, layers: int = 12, progress: Callable[[str], object] = lambda msg: None
) -> JsonDict:
    from ._runtimes.ort import measure_sessions, new_session

    workdir = Path(workdir)
    for d in (workdir / "converted", workdir / "prepacked"):  # a link there would put them where --clean never looks
        no_link_below(workdir, d)
    workdir.mkdir(parents=True, exist_ok=True)
    original = workdir / "mlp_fp16.onnx"
    progress(f"building {original} ({layers} layers of 2048x2048 fp16 behind Cast)")
    with OutputTransaction() as tx:  # recorded, so that --clean removes it and a user's file of its name is kept
        record = attach(tx, workdir, 0, [])
        mlp_onnx(tx.new_file(original), layers=layers, dim=2048, weights="float16")
        record.add(run_key("demo", [original]), tx.finals(), [])
    progress("converting")
    report = api.convert(original, workdir / "converted")
    converted = Path(report.outputs[0])

    progress("converting with --prepack (ONNX Runtime's packed weights in the blob too)")
    pre_report = api.convert(original, workdir / "prepacked", ConvertOptions(prepack=True))
    prepacked = Path(pre_report.outputs[0])

    x = np.random.default_rng(0).standard_normal((1, 2048), dtype=np.float32)
    outputs_equal = bool(
        np.array_equal(
            new_session(str(original)).run(None, {"x": x})[0], new_session(str(converted)).run(None, {"x": x})[0]
        )
    )
    prepacked_equal = bool(
        np.array_equal(
            new_session(str(original), False).run(None, {"x": x})[0],
            new_session(str(prepacked), False).run(None, {"x": x})[0],
        )
    )
    rows = []
    for variant, path, share, outputs in (
        ("original: fp16 + Cast, disable_prepacking", original, True, []),
        ("converted: fp32 blob, disable_prepacking", converted, True, report.outputs[1:]),
        ("original: fp16 + Cast, default options", original, False, []),
        ("converted --prepack, default options", prepacked, False, pre_report.outputs[2:]),
    ):
        progress(f"opening {sessions} sessions of {path.name} in a fresh process")
        m = _measure(measure_sessions, str(path), [1, sessions], share)
        one, n = m[0]["pss_mib"], m[-1]["pss_mib"]
        size = path.stat().st_size + sum(Path(p).stat().st_size for p in outputs)
        rows.append(
            {
                "variant": variant,
                "file_bytes": size,
                "pss_1_mib": one,
                "pss_n_mib": n,
                "per_session_mib": round((n - one) / max(1, sessions - 1), 1),
            }
        )
    return {
        "rows": rows,
        "converted": str(converted),
        "outputs_equal": outputs_equal,
        "report": report.to_dict(),
        "prepacked": str(prepacked),
        "prepacked_outputs_equal": prepacked_equal,
        "ratio_original": rows[0]["pss_n_mib"] / rows[0]["pss_1_mib"],
        "ratio_converted": rows[1]["pss_n_mib"] / rows[1]["pss_1_mib"],
        "ratio_original_default": rows[2]["pss_n_mib"] / rows[2]["pss_1_mib"],
        "ratio_prepacked": rows[3]["pss_n_mib"] / rows[3]["pss_1_mib"],
    }


def _measure(
    measure_sessions: Callable[[str, list[int], bool], list[JsonDict]], path: str, counts: list[int], share: bool
) -> list[JsonDict]:
    """Default-option sessions in a process started with MALLOC_MMAP_THRESHOLD_ (ORT's validation
    buffers otherwise stay in glibc's heap); the variable is inherited by the probe process only."""
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if not share:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "1048576"
    try:
        return measure_sessions(path, counts, share)
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
