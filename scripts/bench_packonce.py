"""--prepack of a model family: each distinct weight packed once per run, by one ORT child, against ORT's own.

    python scripts/bench_packonce.py [--mib 48] [--workdir DIR] [--base d9d5adc]

optimum's decoder export (``model_forms.decoder_family``: decoder_model.onnx, decoder_with_past_model.onnx,
decoder_model_merged.onnx, the same fp32 weights in three data files) at ``--mib`` per model, and a T5-like folder
(``decoder_fixtures.t5_like``, hidden 1280: encoder, decoder and decoder_with_past, the decoders sharing their
weights), each converted as a folder, side by side in one run:
- plain ``convert``;
- ``--prepack`` as of ``--base`` (d9d5adc: one ORT child process per model), and now (one child serves the run),
  with the run's packing reuse off (``WEIGHTSHARE_PREPACK_REUSE=0``: every model packs its own) and on;
- the anchor: what ONNX Runtime itself spends, one level-ALL session per model saving its pre-packed weights
  (``session.save_external_prepacked_constant_initializers=1``: ORT persists what it pre-packs beside the weights).
Per route: wall, CPU (user + system of the process tree, from wait4), the process tree's peak (the report's
``peak_rss_mib``; for the anchor its one process's ``ru_maxrss``), bytes written (the tree's ``ru_oublock`` x 512:
page-cache bytes dirtied, temporaries included) and the outputs' size; for --prepack the one-node ORT sessions run
and the nodes that took an earlier packing, the ORT child processes started and the ORT sessions they ran (where
the reports say). Then each model alone, before and after, against its own anchor (ORT's save-prepacked of it +
its plain conversion), and whether the reuse or the one child changed a byte (the --prepack folders compared with
each other and with the base's) or an output (ORT on the original, batch 1 and 8).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders)
import model_forms as mf
import numpy as np
from bench_family import identical  # every output of every model, batch 1 and 8, both branches

NAMES = ("decoder_model.onnx", "decoder_with_past_model.onnx", "decoder_model_merged.onnx")
REUSE_ENV = "WEIGHTSHARE_PREPACK_REUSE"

ANCHOR = """
import os, sys
import onnxruntime as ort
src, out = sys.argv[1], sys.argv[2]
for name in sorted(os.listdir(src)):
    if not name.endswith(".onnx"):
        continue
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = os.path.join(out, name)
    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", name + ".bin")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    so.log_severity_level = 3
    ort.InferenceSession(os.path.join(src, name), so, providers=["CPUExecutionProvider"])
"""


def measured(
    cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[dict[str, float], str]:
    """Run ``cmd``; its wall, the tree's CPU, peak RSS and bytes written (wait4), and its stdout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, **(env or {})}, cwd=cwd)
        _pid, status, ru = os.wait4(p.pid, 0)  # the tree's usage: every descendant was waited for
        wall = time.perf_counter() - start
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if p.returncode != 0:
        raise SystemExit(f"{cmd[:4]}... failed: {stderr[-2000:]}")
    figures = {
        "wall_s": wall,
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "maxrss_mib": ru.ru_maxrss / 1024,
        "written_mib": ru.ru_oublock * 512 / 2**20,
    }
    return figures, stdout


def size_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.name.startswith(".")) / 2**20


def checkout(rev: str, where: Path) -> Path:
    """The package as of ``rev`` (``git archive``), to run the same CLI as it was."""
    repo = Path(__file__).resolve().parents[1]
    where.mkdir()
    tar = subprocess.run(["git", "-C", str(repo), "archive", rev, "weightshare"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=tar.stdout, check=True)
    return where


def convert(
    src: Path, out: Path, *flags: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> dict[str, float]:
    """``python -m weightshare convert`` (from ``cwd``, which ``-m`` puts first on the path)."""
    cmd = [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q", "--json", *flags]
    figures, stdout = measured(cmd, env, cwd)
    reports = json.loads(stdout)["reports"]  # a folder run: the folder's figures in each record
    figures["peak_mib"] = max(max(r["peak_rss_mib"], (r.get("folder") or {}).get("peak_rss_mib", 0)) for r in reports)
    figures["outputs_mib"] = size_mib(out)
    if any("node_sessions" in r.get("prepack", {}) for r in reports):  # counted since the reuse
        # the packing sessions (several nodes' since they are batched: ``pack_sessions``), one per node before
        figures["sessions"] = sum(
            r["prepack"].get("pack_sessions", r["prepack"].get("node_sessions", 0)) for r in reports if r.get("prepack")
        )
        figures["reused"] = sum(r["prepack"].get("nodes_reused", 0) for r in reports if r.get("prepack"))
    if any("ort_child_started" in r.get("prepack", {}) for r in reports):  # counted since one child per run
        figures["children"] = sum(bool(r["prepack"]["ort_child_started"]) for r in reports if r.get("prepack"))
        figures["ort_sessions"] = sum(r["prepack"]["ort_sessions"] for r in reports if r.get("prepack"))
    elif any(r.get("prepack") for r in reports):  # before: one child per model
        figures["children"] = sum(1 for r in reports if r.get("prepack"))
    return figures


def same_files(a: Path, b: Path) -> bool:
    def files(d: Path) -> dict[str, bytes]:
        return {f.name: f.read_bytes() for f in sorted(d.iterdir()) if f.is_file() and not f.name.startswith(".")}

    return files(a) == files(b)


def row(label: str, f: dict[str, float], base: dict[str, float]) -> str:
    packing = f"{f['sessions']:.0f} / {f['reused']:.0f}" if "sessions" in f else "-"
    children = f"{f['children']:.0f}" if "children" in f else "-"
    children += f" / {f['ort_sessions']:.0f}" if "ort_sessions" in f else ""
    peak = f.get("peak_mib", f["maxrss_mib"])
    return (
        f"{label:34}{f['wall_s']:>8.1f}{f['cpu_s']:>8.1f}{f['cpu_s'] / base['cpu_s']:>7.1f}x{peak:>9.0f}"
        f"{f['written_mib']:>10.0f}{f['outputs_mib']:>9.0f}{f['written_mib'] / f['outputs_mib']:>7.2f}x{packing:>12}"
        f"{children:>13}"
    )


T5_HEADS, T5_SIZE = 20, 64  # hidden 1280: decoder 39 MiB, decoder_with_past 26 MiB, encoder 6.6 MiB


def t5_feeds(path: Path, batch: int) -> dict[str, np.ndarray]:
    """Inputs for ``decoder_fixtures.t5_like``'s models: token ids, masks of ones, random past."""
    import decoder_fixtures as fx
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    rng = np.random.default_rng(batch)
    named = {"num_heads": T5_HEADS, "d_kv": T5_SIZE, "d_model": T5_HEADS * T5_SIZE, "batch_size": batch}
    named |= {"past_decoder_sequence_length": 5, "encoder_sequence_length": 6, "encoder_sequence_length_out": 6}
    named["decoder_sequence_length"] = 1 if "with_past" in path.name else 3
    feeds = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        shape = [named[d.dim_param] if d.dim_param else d.dim_value for d in tt.shape.dim]
        if vi.name == "input_ids":
            feeds[vi.name] = rng.integers(0, fx.VOCAB, shape, dtype=np.int64)
        elif tt.elem_type == onnx.TensorProto.INT64:
            feeds[vi.name] = np.ones(shape, np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(shape, dtype=np.float32)
    return feeds


def t5_identical(src: Path, out: Path) -> bool:
    import onnxruntime as ort

    ok = True
    for m in sorted(src.glob("*.onnx")):
        a, b = ort.InferenceSession(str(m)), ort.InferenceSession(str(out / m.name))
        for batch in (1, 8):
            feeds = t5_feeds(m, batch)
            ok = ok and all(np.array_equal(x, y) for x, y in zip(a.run(None, feeds), b.run(None, feeds)))
    return ok


def anchor_of(src: Path, out: Path) -> dict[str, float]:
    """ORT's own: one level-ALL session per model of ``src`` saving its pre-packed weights into ``out``."""
    out.mkdir()
    figures, _ = measured([sys.executable, "-c", ANCHOR, str(src), str(out)])
    figures["outputs_mib"] = size_mib(out)
    return figures


def family(t: Path, title: str, src: Path, check: Callable[[Path, Path], bool], old: Path | None) -> None:
    """Every route on the folder ``src``, side by side."""
    print(f"\n== {title}: {size_mib(src):.0f} MiB ==")
    routes: dict[str, dict[str, float]] = {}
    routes["convert (plain)"] = convert(src, t / "plain")
    if old is not None:
        path = os.pathsep.join([str(old), os.environ.get("PYTHONPATH", "")])
        routes[f"--prepack at {old.name} (before)"] = convert(
            src, t / "base_out", "--prepack", env={"PYTHONPATH": path}, cwd=old
        )
    routes["--prepack, reuse off"] = convert(src, t / "reuse_off", "--prepack", env={REUSE_ENV: "0"})
    routes["--prepack (after)"] = convert(src, t / "after", "--prepack")
    anchor = routes["ORT save-prepacked, 1 session/model"] = anchor_of(src, t / "anchor")
    base = routes["convert (plain)"]
    head = f"{'':34}{'wall s':>8}{'CPU s':>8}{'/plain':>8}{'peak MiB':>9}{'written':>10}{'outputs':>9}{'w/out':>8}"
    print(head + f"{'sessions/reused':>16}{'children/ORT':>13}")
    for label, f in routes.items():
        print(row(label, f, base))
    after = routes["--prepack (after)"]
    target = anchor["cpu_s"] + base["cpu_s"]
    line = f"target: --prepack CPU <= ORT's save-prepacked + plain = {target:.1f} s: {after['cpu_s']:.1f} s"
    if old is not None:
        before = routes[f"--prepack at {old.name} (before)"]
        line += f" ({after['cpu_s'] / target:.2f}x; before {before['cpu_s']:.1f} s, {before['cpu_s'] / target:.2f}x)"
        print(line)
        same = same_files(t / "base_out", t / "after")
        # since the final blob is written in place of the staged one (header room reserved), offsets differ
        print(f"the same files as at {old.name}: {same}" + ("" if same else " (blob layout changed; outputs below)"))
    else:
        print(line + f" ({after['cpu_s'] / target:.2f}x)")
    print(f"reuse changed no byte (reuse off and on compared): {same_files(t / 'reuse_off', t / 'after')}")
    print(f"outputs bit-identical to the originals (batch 1 and 8): {check(src, t / 'after')}")


def single(t: Path, src: Path, stem: str, what: str, old: Path | None) -> None:
    """One model of the family alone: before and after against its anchor (ORT's save-prepacked + plain)."""
    one = t / stem
    one.mkdir()
    for f in src.iterdir():
        if f.name.startswith(f"{stem}."):
            os.link(f, one / f.name)
    model = one / f"{stem}.onnx"
    plain = convert(model, t / f"{stem}_plain")
    anchor = anchor_of(one, t / f"{stem}_anchor")
    target = anchor["cpu_s"] + plain["cpu_s"]
    after = convert(model, t / f"{stem}_out", "--prepack")
    line = (
        f"{stem}.onnx alone ({what}): anchor {target:.2f} s (ORT {anchor['cpu_s']:.2f} + plain {plain['cpu_s']:.2f}); "
        f"--prepack {after['cpu_s']:.2f} s ({after['cpu_s'] / target:.2f}x)"
    )
    if old is not None:
        path = os.pathsep.join([str(old), os.environ.get("PYTHONPATH", "")])
        before = convert(model, t / f"{stem}_base", "--prepack", env={"PYTHONPATH": path}, cwd=old)
        line += f", before {before['cpu_s']:.2f} s ({before['cpu_s'] / target:.2f}x)"
    line += (
        f"; {after['written_mib']:.0f} MiB written for {after['outputs_mib']:.0f} MiB of outputs "
        f"({after['written_mib'] / after['outputs_mib']:.2f}x)"
    )
    print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=48.0, help="weights per model of the decoder family")
    ap.add_argument("--workdir", default=None, help="where the models are built (a disk, not tmpfs: bytes written)")
    ap.add_argument("--base", default="d9d5adc", help="also run --prepack as of this commit ('' to skip)")
    args = ap.parse_args()
    import decoder_fixtures as fx
    import onnxruntime as ort

    print(f"onnxruntime {ort.__version__}, {os.cpu_count()} CPUs (shared: wall is noisy, CPU is the figure)")
    with tempfile.TemporaryDirectory(prefix="bench-packonce-", dir=args.workdir) as tmp:
        t = Path(tmp)
        old = checkout(args.base, t / args.base) if args.base else None
        (t / "decoders").mkdir()
        src = t / "decoders" / "src"
        mf.decoder_family(src, mib=args.mib)
        title = "optimum decoder family (decoder, decoder_with_past, merged; the same fp32 weights in each)"
        family(t / "decoders", title, src, identical, old)
        (t / "t5").mkdir()
        fx.t5_like(t / "t5" / "src", heads=T5_HEADS, size=T5_SIZE)
        title = "T5-like folder (encoder, decoder, decoder_with_past; the decoders share their weights)"
        family(t / "t5", title, t / "t5" / "src", t5_identical, old)
        print()
        for stem, what in (("decoder_model", "cut in segments"), ("decoder_model_merged", "one piece: an If")):
            single(t, src, stem, what, old)
        for stem, what in (("decoder_model", "T5-like, one piece"), ("encoder_model", "T5-like encoder")):
            single(t / "t5", t / "t5" / "src", stem, what, old)


if __name__ == "__main__":
    main()
