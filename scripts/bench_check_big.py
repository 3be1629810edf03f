"""`check` of large `--prepack` outputs, before and after, side by side in one run: CPU, largest process, verdicts.

    PYTHONPATH=$PWD python scripts/bench_check_big.py --forms /work/forms --before /tmp/before [--form matmul-conv]

``--before``: a checkout of the code to compare with (``git archive REV | tar -x -C DIR``). Each form is converted
once with ``--prepack`` by this checkout, then checked cold (an empty cache) by each checkout under
``bench_check._costed`` (the tree's CPU seconds, the largest process's ``ru_maxrss``); the verdicts are read back
by a warm `check --json` (the cold run's cached measurements, no runtime child): the exit code, each model's findings
(code, severity) and its measured figures per setting. Targets: the largest process within 2 x the largest model's
mapped size + the measuring child's floor, and <= 1 GiB for the forms up to a few hundred MiB; the verdicts equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_check import _costed  # noqa: E402

from weightshare._runtimes.bound import FLOOR_BYTES, PER_CPU_BYTES, _cpus, mapped_bytes  # noqa: E402

MiB = 1 << 20
FORMS = ("matmul-conv", "optimum-t5")


def _source(forms: Path, form: str) -> Path:
    info = json.loads((forms / form / "form.json").read_text())
    return forms / form / (info.get("folder") or info["model"])


def _largest_mapped(out: Path) -> int:
    best = 0
    for m in out.rglob("*.onnx"):
        datas = [f.name for f in m.parent.iterdir() if f.suffix in (".safetensors", ".data", ".bin")]
        best = max(best, mapped_bytes(m, [d for d in datas if d.startswith(m.name.split(".")[0] + ".")]))
    return best


def _verdicts(out: Path, cache: Path, code: Path) -> tuple[int, dict[str, list[str]], dict[str, dict[str, float]]]:
    """(exit, model -> sorted "severity code", model -> setting -> measured MiB) from a warm check --json."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(code), "WEIGHTSHARE_NO_MEASURE": ""}
    cmd = [sys.executable, "-m", "weightshare", "check", str(out), "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=code)
    doc = json.loads(res.stdout)
    found: dict[str, list[str]] = {}
    for f in doc["findings"]:
        found.setdefault(Path(f["model"] or f["file"]).name, []).append(f"{f['severity']} {f['code']}")
    figures = {
        Path(r["model"]).name: {
            **{s: round(n / MiB, 1) for s, n in sorted(r["copied_per_session_by_setting"].items())},
            **{f"activation {s}": round(n / MiB, 1) for s, n in sorted(r["activation_per_session_by_setting"].items())},
        }
        for r in doc["reports"]
    }
    return doc["exit_code"], {k: sorted(v) for k, v in sorted(found.items())}, figures


def bench(forms: Path, form: str, before: Path, after: Path, t: Path) -> None:
    src = _source(forms, form)
    out = t / form
    rc, cpu, _, err = _costed(["convert", str(src), "-o", str(out), "--prepack", "-q"], {"PYTHONPATH": str(after)})
    assert rc == 0, err
    models = sorted(out.rglob("*.onnx"))
    largest = _largest_mapped(out)
    bound = 2 * largest + FLOOR_BYTES + PER_CPU_BYTES * _cpus()
    print(
        f"\n== {form}: --prepack output {len(models)} models, largest mapped {largest / MiB:.0f} MiB "
        f"(--prepack conversion: {cpu:.1f} CPU s); measuring child's bound 2 x {largest / MiB:.0f} + "
        f"{FLOOR_BYTES >> 20} + {PER_CPU_BYTES >> 20} x {_cpus()} = {bound / MiB:.0f} MiB ==",
        flush=True,
    )
    rows = []
    for label, code in (("before", before), ("after", after)):
        cache = t / f"cache-{form}-{label}"
        cache.mkdir()
        rc, ccpu, big, err = _costed(["check", str(out), "-q"], {"XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(code)})
        exit_code, found, figures = _verdicts(out, cache, code)
        rows.append((label, rc, ccpu, big, found, figures))
        print(
            f"  check cold, {label:6}: exit {rc}, {ccpu:6.1f} CPU s ({ccpu / cpu:.2f}x the conversion), largest "
            f"process {big / MiB:5.0f} MiB (within the bound: {'yes' if big <= bound else 'NO'}; <= 1024 MiB: "
            f"{'yes' if big <= 1024 * MiB else 'no'})",
            flush=True,
        )
        if rc > 1:
            print(f"    {err.splitlines()[-1:]}")
    (_, rc0, _, _, found0, fig0), (_, rc1, _, _, found1, fig1) = rows

    def gate(found: dict[str, list[str]]) -> dict[str, list[str]]:
        kept = {k: [f for f in v if not f.startswith("info ")] for k, v in found.items()}
        return {k: v for k, v in kept.items() if v}

    print(
        f"  verdicts equal: exit and errors/warnings {'yes' if (rc0, gate(found0)) == (rc1, gate(found1)) else 'NO'}"
        f", info findings too {'yes' if found0 == found1 else 'NO'}"
    )
    for name in sorted(set(fig0) | set(fig1)):
        a, b = fig0.get(name, {}), fig1.get(name, {})
        cells = ", ".join(f"{s} {a.get(s, '-')} -> {b.get(s, '-')}" for s in sorted(set(a) | set(b)))
        listed = ", ".join(found1.get(name, [])) or "none"
        print(f"    {name}: measured MiB/session (before -> after) {cells}; findings {listed}")
        if found0.get(name) != found1.get(name):
            print(f"      before: {', '.join(found0.get(name, [])) or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--forms", type=Path, default=Path("/work/forms"))
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--form", action="append")
    args = ap.parse_args()
    after = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=after).stdout
    print(f"# PYTHONPATH=$PWD python scripts/bench_check_big.py --before {args.before} (after: {head.strip()})")
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for form in args.form or FORMS:
            bench(args.forms, form, args.before.resolve(), after, Path(tmp))


if __name__ == "__main__":
    main()
