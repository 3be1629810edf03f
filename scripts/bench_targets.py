"""The --prepack, check and verify targets on real exporter output, every figure and its target side by side.

    PYTHONPATH=$PWD python scripts/bench_targets.py --forms FORMS_DIR [FORM ...] [--workdir DIR] [--repeat N]
                                                    [--before REV]

FORMS_DIR is what ``scripts/build_exporter_forms.py`` built (optimum-t5, genai-phi3-int4 and matmul-conv by
default, then optimum-bart and optimum-marian when they are there: about 9 minutes on a shared 2-core machine;
optimum-t5-base, t5-base's shapes, 2.2 GiB, takes 10 minutes alone and runs when named). Per form, in one run:
- ``convert SRC -o OUT`` (plain) and ``convert SRC -o OUT --prepack``: CPU (user + system of the process tree,
  from wait4), bytes written (the tree's ``ru_oublock`` x 512, temporaries included), the outputs' size and the
  process-tree peak (the report's ``peak_rss_mib`` in ``--json``);
- the anchor: what ONNX Runtime itself spends to pre-pack, one level-ALL session per model saving its pre-packed
  weights (``session.save_external_prepacked_constant_initializers=1``), plus the plain conversion;
- ``check OUT`` of the --prepack output with an empty cache (cold): CPU of its tree and its largest process;
- ``verify ORIGINAL CONVERTED`` of the form's largest model against its --prepack output: the largest process.
Targets: --prepack CPU <= 1.0x the anchor for a family (a folder of several models), <= 1.5x for a single
model; bytes written <= 1.3x the outputs; process-tree peak <= 300 MiB; check's CPU <= the --prepack
conversion's and its largest process <= 1 GiB; verify's largest process <= 2x the larger model + 300 MiB.
With ``--repeat N`` the conversions, the anchor and check run N times each, interleaved, and the run with the least
CPU is kept (what neighbours on a shared machine add is never less than nothing). ``--before REV``: the same
``--prepack`` conversion by the package as of REV (``git archive``), interleaved with this tree's, side by side,
and which output files differ between the two. Helpers are bench_packonce's
(convert, anchor) and bench_check's (one costed run); the machine is shared, so CPU
seconds, not wall, are the figure.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders the imported benches use)
from bench_check import _costed
from bench_packonce import ANCHOR, checkout, measured, size_mib
from bench_packonce import convert as ws_convert

from weightshare.formats.onnx.verify import mapped

MiB = 1 << 20
DEFAULT = ("optimum-t5", "genai-phi3-int4", "matmul-conv")
OPTIONAL = ("optimum-bart", "optimum-marian")  # when built
LIMITS = {"family_cpu": 1.0, "single_cpu": 1.5, "written": 1.3, "peak_mib": 300, "check_mib": 1024}


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _source(forms: Path, form: str) -> tuple[Path, Path]:
    """(what convert is given: the model folder or the model, the folder holding the original models)."""
    info = json.loads((forms / form / "form.json").read_text())
    src = forms / form / (info.get("folder") or info["model"])
    return src, src if src.is_dir() else src.parent


def _least(r: dict, key: str, run: dict) -> None:
    """Keep ``run`` as ``r[key]`` when it spent less CPU than the one kept."""
    if key not in r or run["cpu_s"] < r[key]["cpu_s"]:
        r[key] = run


def bench_form(
    forms: Path, form: str, t: Path, repeat: int = 1, before: Path | None = None, before_rev: str = ""
) -> dict:
    """Every route and target of one form; a failing step is recorded with its error line, the others still run.
    ``before``: a package tree (as of ``before_rev``) whose ``--prepack`` conversion runs beside this one's."""
    src, folder = _source(forms, form)
    models = sorted(src.rglob("*.onnx")) if src.is_dir() else [src]
    family = len(models) > 1
    r: dict = {"form": form, "models": len(models), "mib": size_mib(folder), "family": family, "errors": []}
    r["before_rev"] = before_rev
    head = f"{len(models)} models (a family)" if family else "one model"
    print(f"\n== {form}: {head}, {r['mib']:.0f} MiB ==", flush=True)
    start = time.perf_counter()
    # each run ``repeat`` times, interleaved (plain, --prepack, anchor, check), the least CPU kept: a shared
    # machine's neighbours add to a run's CPU seconds, never take from them (one-run ratios moved by 0.25x)
    for _ in range(repeat):
        for d in ("plain", "prepack", "before", "anchor"):
            shutil.rmtree(t / d, ignore_errors=True)
        try:
            _least(r, "plain", ws_convert(src, t / "plain"))
            _least(r, "prepack", ws_convert(src, t / "prepack", "--prepack"))
            if before is not None:  # its ORT child imports the same tree (PYTHONPATH)
                run = ws_convert(src, t / "before", "--prepack", env={"PYTHONPATH": str(before)}, cwd=before)
                _least(r, "before", run)
        except SystemExit as e:  # bench_packonce's runner exits with the failing command's stderr
            r["errors"].append(f"convert: {str(e)[-600:]}")
            print(f"convert failed: {str(e)[-600:]}", flush=True)
            return r
        (t / "anchor").mkdir()
        try:
            anchor, _ = measured([sys.executable, "-c", ANCHOR, str(folder), str(t / "anchor")])
            anchor["outputs_mib"] = size_mib(t / "anchor")
            _least(r, "anchor", anchor)
        except SystemExit as e:
            r["errors"].append(f"anchor: {str(e)[-600:]}")
        shutil.rmtree(t / "cache", ignore_errors=True)
        rc, cpu, largest, err = _costed(["check", str(t / "prepack"), "-q"], {"XDG_CACHE_HOME": str(t / "cache")})
        if "check" not in r or cpu < r["check"]["cpu_s"]:
            r["check"] = {
                "exit": rc,
                "cpu_s": cpu,
                "largest_mib": largest / MiB,
                "error": err.splitlines()[-1:] if rc > 1 else [],
            }
    out = t / "prepack"
    if before is not None:
        r["differ"] = _differing(t / "before", out)
    original = max(models, key=mapped)
    converted = out / original.relative_to(src) if src.is_dir() else out / src.name
    larger = max(mapped(original), mapped(converted))
    rc, cpu, largest, err = _costed(["verify", str(original), str(converted), "-q"])
    r["verify"] = {
        "model": str(original.relative_to(folder)), "exit": rc, "cpu_s": cpu, "largest_mib": largest / MiB,
        "larger_mib": larger / MiB, "error": err.splitlines()[-1:] if rc else [],
    }  # fmt: skip
    r["bench_s"] = time.perf_counter() - start
    show(r)
    return r


def _differing(a: Path, b: Path) -> list[str]:
    """The output files (by name, the run's own bookkeeping left out) that are not the same bytes in ``a`` and ``b``."""
    names = {f.name for d in (a, b) for f in d.iterdir() if f.is_file() and not f.name.startswith(".")}
    return sorted(n for n in names if not ((a / n).exists() and (b / n).exists() and filecmp.cmp(a / n, b / n, False)))


def _row(label: str, f: dict) -> str:
    peak = f.get("peak_mib", f["maxrss_mib"])
    packing = f"{f['sessions']:.0f} / {f['reused']:.0f}" if "sessions" in f else "-"
    return (
        f"{label:40}{f['cpu_s']:>8.1f}{f['wall_s']:>8.1f}{peak:>10.0f}{f['written_mib']:>10.0f}{f['outputs_mib']:>9.0f}"
        f"{f['written_mib'] / f['outputs_mib']:>7.2f}x{packing:>16}"
    )


def targets(r: dict) -> list[tuple[str, str, bool]]:
    """(target, figures, met) of one form."""
    rows: list[tuple[str, str, bool]] = []
    p, plain = r["prepack"], r["plain"]
    if "anchor" in r:
        anchor = r["anchor"]["cpu_s"] + plain["cpu_s"]
        limit = LIMITS["family_cpu" if r["family"] else "single_cpu"]
        rows.append((
            f"--prepack CPU <= {limit:.1f}x anchor (ORT save-prepacked + plain = {anchor:.1f} s)",
            f"{p['cpu_s']:.1f} s ({p['cpu_s'] / anchor:.2f}x)", p["cpu_s"] <= limit * anchor,
        ))  # fmt: skip
    ratio = p["written_mib"] / p["outputs_mib"]
    rows.append((
        f"--prepack bytes written <= {LIMITS['written']}x outputs ({p['outputs_mib']:.0f} MiB)",
        f"{p['written_mib']:.0f} MiB ({ratio:.2f}x)", ratio <= LIMITS["written"],
    ))  # fmt: skip
    rows.append((
        f"--prepack process-tree peak <= {LIMITS['peak_mib']} MiB",
        f"{p['peak_mib']:.0f} MiB", p["peak_mib"] <= LIMITS["peak_mib"],
    ))  # fmt: skip
    c = r["check"]
    rows.append((
        f"check OUT cold: CPU <= --prepack's {p['cpu_s']:.1f} s, largest process <= {LIMITS['check_mib']} MiB",
        f"exit {c['exit']}, {c['cpu_s']:.1f} s ({c['cpu_s'] / p['cpu_s']:.2f}x), {c['largest_mib']:.0f} MiB",
        c["exit"] <= 1 and c["cpu_s"] <= p["cpu_s"] and c["largest_mib"] <= LIMITS["check_mib"],
    ))  # fmt: skip
    v = r["verify"]
    limit = 2 * v["larger_mib"] + 300
    rows.append((
        f"verify {v['model']}: largest process <= 2 x {v['larger_mib']:.0f} + 300 = {limit:.0f} MiB",
        f"exit {v['exit']}, {v['largest_mib']:.0f} MiB, CPU {v['cpu_s']:.1f} s",
        v["exit"] == 0 and v["largest_mib"] <= limit,
    ))  # fmt: skip
    return rows


def show(r: dict) -> None:
    head = f"{'':40}{'CPU s':>8}{'wall s':>8}{'peak MiB':>10}{'written':>10}{'outputs':>9}{'w/out':>8}"
    print(head + f"{'sessions/reused':>16}")
    print(_row("convert (plain)", r["plain"]))
    print(_row("convert --prepack", r["prepack"]))
    if "before" in r:
        print(_row(f"convert --prepack, before ({r['before_rev']})", r["before"]))
    if "anchor" in r:
        print(_row("ORT save-prepacked, 1 session/model", r["anchor"]) + "  (peak: its one process)")
    for e in r["errors"] + r["check"]["error"] + r["verify"]["error"]:
        print(f"  error: {e}")
    for target, figures, ok in targets(r):
        print(f"  {target}: {figures}: {_met(ok)}")
    if "before" in r:
        b, p = r["before"], r["prepack"]
        sessions = f"ORT sessions {b.get('ort_sessions', 0):.0f} -> {p.get('ort_sessions', 0):.0f}"
        differ = f"differ: {', '.join(r['differ'])}" if r["differ"] else "every file the same bytes"
        print(f"  --prepack vs before: CPU {b['cpu_s']:.1f} -> {p['cpu_s']:.1f} s ({p['cpu_s'] / b['cpu_s']:.2f}x), "
              f"{sessions}; outputs: {differ}")  # fmt: skip
    print(f"  (this form's runs: {r['bench_s']:.0f} s wall)", flush=True)


def summary(results: list[dict]) -> None:
    names = ["--prepack CPU", "bytes written", "tree peak", "check cold", "verify peak"]
    print(f"\n{'form':20}" + "".join(f"{n:>15}" for n in names))
    for r in results:
        if "prepack" not in r:
            print(f"{r['form']:20}" + f"{'convert failed':>15}")
            continue
        cells = [_met(ok) for _, _, ok in targets(r)]
        if "anchor" not in r:
            cells.insert(0, "no anchor")
        print(f"{r['form']:20}" + "".join(f"{c:>15}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("forms", nargs="*", help=f"forms (default: {', '.join(DEFAULT)}, then {', '.join(OPTIONAL)})")
    ap.add_argument("--forms", dest="forms_dir", required=True, help="what build_exporter_forms.py built")
    ap.add_argument("--workdir", default=None, help="a disk, not tmpfs (bytes written)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each step, the least CPU kept (default 1)")
    ap.add_argument("--before", default=None, help="a git revision whose --prepack runs beside this tree's")
    args = ap.parse_args()
    import onnxruntime as ort

    forms_dir = Path(args.forms_dir)
    names = args.forms or [*DEFAULT, *(f for f in OPTIONAL if (forms_dir / f / "form.json").exists())]
    missing = [f for f in names if not (forms_dir / f / "form.json").exists()]
    if missing:
        sys.exit(
            f"{forms_dir}: no form {', '.join(missing)}; build it with scripts/build_exporter_forms.py "
            f"{forms_dir} {' '.join(missing)} (in the exporter's venv)"
        )
    print(
        f"onnxruntime {ort.__version__}, {os.cpu_count()} CPUs (shared: CPU seconds are the figure, the least of "
        f"{max(1, args.repeat)} runs each); {forms_dir}"
    )
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-targets-before-") as old:
        before = checkout(args.before, Path(old) / "tree") if args.before else None
        for form in names:
            with tempfile.TemporaryDirectory(prefix=f"bench-targets-{form}-", dir=args.workdir) as tmp:
                results.append(bench_form(forms_dir, form, Path(tmp), max(1, args.repeat), before, args.before or ""))
    summary(results)
    print(f"\n{len(results)} forms in {time.perf_counter() - start:.0f} s wall")


if __name__ == "__main__":
    main()
