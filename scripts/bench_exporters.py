"""The real exporters' forms, converted and measured side by side: convert / verify / PSS / latency / bits.

    python scripts/bench_exporters.py FORMS_DIR [FORM ...] [--reps 5] [--json]

FORMS_DIR is what ``scripts/build_exporter_forms.py`` built (run that first with the exporter venv:
``/work/exvenv/torch-genai/bin/python scripts/build_exporter_forms.py FORMS_DIR``). For every form and every route
(plain, ``--prepack``, ``--prepack --unpack ort-cpu`` for fp16 forms), in child processes:
  convert: exit code, wall time, process-tree peak RSS (``RUSAGE_CHILDREN``), the refusal line if any
  verify:  ``weightshare verify ORIGINAL CONVERTED`` exit code
  bits:    outputs of the converted model against ORT on the original, both at default options, np.array_equal at
           batch 1, 8 and 64 (decoders: sequence 1 and 16; BERTs: 16 tokens; an optimum seq2seq folder: its
           merged decoder, inputs made as verify makes them, the encoder run first)
  PSS:     1 and 4 sessions in one fresh process started with MALLOC_MMAP_THRESHOLD_=1048576, above a process
           that imported onnxruntime, twice: CPU arena off (``enable_cpu_mem_arena=False``: activations do not
           count) and at the default arena (what a user's session holds); genai folders: 1 and 4 ``og.Model``s at
           the session options of their genai_config.json (scripts/bench_genai.py's probe), one figure
  latency: median ms of one run at batch 1 (decoders: 16 tokens), original and converted interleaved in one process
  check:   ``weightshare check MODEL --json`` with no options: exit code and its weight figure per extra session at
           the model's default setting, printed next to the measured PSS per extra session ((4 - 1) / 3)
The portable route (``session.disable_prepacking=1``) is what plain conversion gives; --prepack is ORT's defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders)
import numpy as np

from weightshare._runtimes.memory import memory_now, run_child_peak

MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
ROUTES = {"plain": [], "--prepack": ["--prepack"], "--prepack --unpack ort-cpu": ["--prepack", "--unpack", "ort-cpu"]}


def feeds(session, kind: str, batch: int, seq: int, seed: int = 0) -> dict:
    if kind == "seq2seq":  # an optimum encoder-decoder: inputs made as verify makes them (encoder run first)
        from weightshare.formats.onnx.decode import session_feeds

        return session_feeds(Path(session._model_path), session, {"batch_size": batch}, {}, seed)[0]
    rng = np.random.default_rng(seed)
    if kind == "decoder":
        return {
            "input_ids": rng.integers(3, 4000, (batch, seq)).astype(np.int64),
            "attention_mask": np.ones((batch, seq), np.int64),
            "position_ids": np.tile(np.arange(seq, dtype=np.int64), (batch, 1)),
        }
    if kind == "bert":  # an ORT-optimizer BERT (int8, QDQ): token ids, segment 0, a mask of ones
        seq = seq or 16
        made = {
            "input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64),
            "token_type_ids": np.zeros((batch, seq), np.int64),
        }
        return {i.name: made.get(i.name, np.ones((batch, seq), np.int64)) for i in session.get_inputs()}
    x = session.get_inputs()[0]
    dtype = np.float16 if x.type == "tensor(float16)" else np.float32
    # the first dim is the batch; an image size where the model leaves a dim free, the model's dims elsewhere
    shape = [batch] + [d if isinstance(d, int) else (3 if i == 0 else 224) for i, d in enumerate(x.shape[1:])]
    return {x.name: rng.standard_normal(shape).astype(dtype)}


def _session(path: str, arena: bool = True):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_cpu_mem_arena = arena
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def probe_pss(path: str, kind: str, arena: str = "off") -> list[float]:
    """Child: PSS above an onnxruntime-importing baseline after 1..4 default-option sessions, arena off or on."""
    import onnxruntime  # noqa: F401

    from weightshare.ort import malloc_trim

    base, rows, held = memory_now()["pss_mib"], [], []
    for _ in range(4):
        s = _session(path, arena=arena == "on")
        s.run(None, feeds(s, kind, 1, 16 if kind == "decoder" else 0))
        malloc_trim()
        held.append(s)
        rows.append(round(memory_now()["pss_mib"] - base, 1))
    return rows


def pss(path: Path, kind: str, arena: str = "off") -> list[float]:
    if kind == "genai":
        cmd = [sys.executable, str(Path(__file__).with_name("bench_genai.py")), "--probe", "models", str(path), "1"]
        out = subprocess.run(cmd, env={**os.environ, **MALLOC}, capture_output=True, text=True, check=True)
    else:
        cmd = [sys.executable, __file__, "--probe", str(path), kind, arena]
        out = subprocess.run(cmd, env={**os.environ, **MALLOC}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bits(orig: Path, conv: Path, kind: str) -> tuple[bool, float]:
    """(every output np.array_equal at every shape, largest difference) at ORT defaults."""
    if kind == "genai":
        import genai_model as gm

        same, worst = True, 0.0
        for prompt in ([1, 5, 7, 9, 11], [3, 200, 17]):
            (ta, la), (tb, lb) = gm.generate(orig, prompt, 12), gm.generate(conv, prompt, 12)
            same &= ta == tb and all(np.array_equal(a, b) for a, b in zip(la, lb, strict=True))
            worst = max([worst] + [float(np.max(np.abs(a - b))) for a, b in zip(la, lb, strict=True)])
        return same, worst
    a, b = _session(str(orig)), _session(str(conv))
    same, worst = True, 0.0
    for batch in (1, 8, 64):
        for seq in (1, 16) if kind == "decoder" else (0,):  # a BERT at 16 tokens
            f = feeds(a, kind, batch, seq)
            for x, y in zip(a.run(None, f), b.run(None, f), strict=True):
                same &= bool(np.array_equal(x, y))
                worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))))
    return same, worst


def latency(orig: Path, conv: Path, kind: str, reps: int) -> tuple[float, float]:
    if kind == "genai":
        return float("nan"), float("nan")
    a, b = _session(str(orig)), _session(str(conv))
    f = feeds(a, kind, 1, 16 if kind == "decoder" else 0)
    ta, tb = [], []
    for _ in range(reps):
        for s, t in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            s.run(None, f)
            t.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(ta), 2), round(statistics.median(tb), 2)


def check(model: Path) -> dict:
    """`weightshare check MODEL --json`, no options: exit code, and per model its setting held to and its weight
    figure per extra session there (MiB), beside its activation figure."""
    cmd = [sys.executable, "-m", "weightshare", "check", str(model), "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    try:
        doc = json.loads(res.stdout)
    except ValueError:
        return {"exit": res.returncode, "models": []}
    models = []
    for m in doc.get("reports", []):  # the --json document: one record per model
        setting = m.get("default_setting") or ""
        figure = (m.get("copied_per_session_by_setting") or {}).get(setting)
        act = (m.get("activation_per_session_by_setting") or {}).get(setting)
        models.append(
            {
                "model": Path(m["model"]).name,
                "setting": setting,
                "weights_mib": None if figure is None else round(figure / (1 << 20), 1),
                "activations_mib": None if act is None else round(act / (1 << 20), 1),
            }
        )
    return {"exit": res.returncode, "models": models}


def _check_cell(c: dict) -> str:
    figures = ", ".join(f"{m['weights_mib']}" for m in c["models"] if m["weights_mib"] is not None)
    return f"exit {c['exit']}, {figures or '?'} MiB"


def convert(src: Path, out: Path, flags: list[str]) -> dict:
    t0 = time.perf_counter()
    res, peak = run_child_peak([sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q", *flags])
    return {
        "exit": res.returncode,
        "wall_s": round(time.perf_counter() - t0, 1),
        "tree_peak_mib": round(peak),
        "error": res.stderr.strip().splitlines()[-1][:300] if res.returncode else "",
    }


def bench_form(forms_dir: Path, form: str, work: Path, reps: int) -> dict:
    info = json.loads((forms_dir / form / "form.json").read_text())
    kind = info["kind"]
    src = forms_dir / form / (info.get("folder") or info["model"])
    orig_model = forms_dir / form / info["model"]
    routes = dict(ROUTES)
    if "fp16" not in form:
        routes.pop("--prepack --unpack ort-cpu")
    r: dict = {"form": form, "kind": kind, "original_pss": pss(src if kind == "genai" else orig_model, kind)}
    r["original_pss_arena"] = None if kind == "genai" else pss(orig_model, kind, "on")
    r["original_check"] = check(src if kind == "genai" else orig_model)
    r["routes"] = {}
    for name, flags in routes.items():
        out = work / form / name.replace(" ", "_")
        c = convert(src, out, flags)
        row: dict = {"convert": c}
        if c["exit"] == 0:
            conv_model = out / Path(info["model"]).name if kind != "genai" else out
            conv_file = out / "model.onnx" if kind == "genai" else conv_model
            steps = ["--decode-steps", "4"] if kind == "seq2seq" else []
            v = subprocess.run(
                [sys.executable, "-m", "weightshare", "verify", str(orig_model), str(conv_file), *steps],
                capture_output=True, text=True,
            )  # fmt: skip
            row["verify"] = v.returncode
            row["identical"], row["max_diff"] = bits(src if kind == "genai" else orig_model, conv_model, kind)
            row["pss"] = pss(conv_model, kind)
            row["pss_arena"] = None if kind == "genai" else pss(conv_model, kind, "on")
            row["latency_ms"] = latency(orig_model, conv_file, kind, reps)
            row["check"] = check(conv_model)
        r["routes"][name] = row
        print(f"  {form} {name}: {json.dumps(row)}", flush=True)
    return r


def _ratio(p: list[float]) -> str:
    return f"{p[0]} -> {p[3]} ({p[3] / p[0]:.2f}x)"


def _pss_cells(off: list[float], on: list[float] | None, kind: str) -> str:
    """Arena off | default arena; a genai folder has one figure, at its genai_config.json's session options."""
    return f"- | {_ratio(off)} (genai_config)" if kind == "genai" else f"{_ratio(off)} | {_ratio(on or off)}"


def show(results: list[dict]) -> None:
    head = f"| {'form':17} | {'route':26} | convert | tree peak | verify | bits (b1/8/64) | PSS 1 -> 4 (x), arena off "
    head += "| PSS 1 -> 4 (x), default arena "
    head += "| PSS per extra session | check: exit, weights MiB/session | ms orig/conv |"
    print("\n" + head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in results:
        if "failed" in r:
            print(f"| {r['form']:17} | failed: {r['failed']} |")
            continue
        o = r["original_pss"]
        print(
            f"| {r['form']:17} | {'original':26} | - | - | - | - | {_pss_cells(o, r['original_pss_arena'], r['kind'])} "
            f"| {(o[3] - o[0]) / 3:.1f} MiB | {_check_cell(r['original_check'])} | - |"
        )
        for name, row in r["routes"].items():
            c = row["convert"]
            if c["exit"]:
                print(f"| {r['form']:17} | {name:26} | exit {c['exit']} | {c['tree_peak_mib']} MiB " + "| - " * 7 + "|")
                print(f"|   | refused: | {c['error'][:160]} |||||||")
                continue
            p, (la, lb) = row["pss"], row["latency_ms"]
            bit = "equal" if row["identical"] else f"differ {row['max_diff']:.2g}"
            print(
                f"| {r['form']:17} | {name:26} | {c['wall_s']} s | {c['tree_peak_mib']} MiB | {row['verify']} | {bit} "
                f"| {_pss_cells(p, row['pss_arena'], r['kind'])} | {(p[3] - p[0]) / 3:.1f} MiB "
                f"| {_check_cell(row['check'])} "
                f"| {la}/{lb} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("forms_dir", nargs="?")
    ap.add_argument("forms", nargs="*")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--probe", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print(json.dumps(probe_pss(*args.probe)))
        return
    import onnxruntime as ort

    forms_dir = Path(args.forms_dir)
    forms = args.forms or sorted(p.name for p in forms_dir.iterdir() if (p / "form.json").exists())
    print(f"onnxruntime {ort.__version__}, {os.cpu_count()} CPUs (shared); forms: {', '.join(forms)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-exporters-", dir=args.workdir) as tmp:
        results = []
        for f in forms:
            try:
                results.append(bench_form(forms_dir, f, Path(tmp), args.reps))
            except (subprocess.CalledProcessError, RuntimeError) as e:  # one form's harness failing: say so, go on
                err = e.stderr.strip().splitlines()[-1] if isinstance(e, subprocess.CalledProcessError) else str(e)
                print(f"  {f}: failed: {err[:300]}", flush=True)
                results.append({"form": f, "failed": err[:160]})
        shutil.rmtree(tmp, ignore_errors=True)
    show(results)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
