"""Does `check` agree with measured sharing? The model-form corpus at a given size, converted plain and with
--prepack, side by side in one run.

For every form and variant: `check --target ort-default --json`'s exit code and its figure for one more session
at default options, against an independent measurement (``weightshare._runtimes.ort.measure_sessions``: 1 and 4
sessions in a fresh process started with MALLOC_MMAP_THRESHOLD_=1048576, as the sharing criterion says): the PSS
ratio of 4 sessions to 1 and the PSS per extra session.
"agree" means: exit 0 exactly when 4 sessions <= 1.10x one, and the figure within 2x of the measured cost (or
both under 1 MiB).

    python scripts/bench_check.py 100                    # every form, ~100 MiB of weights each
    python scripts/bench_check.py 100 fp32 conv qdq      # some of them
    python scripts/bench_check.py --tflite 32            # TFLite FULLY_CONNECTED (fp32, fp16, int8 weight-only)
    python scripts/bench_check.py --stability 5          # 5 runs of check, vision/audio forms, one verdict?

``--stability N``: `check MODEL --json` with no options, N times, on models with large activations and small
weights (YOLO-like CNN, ViT-like encoder, Whisper-like encoder (ONNX); a conv TFLite model), each as built and
converted with --prepack: every run's exit code and weight figure at the model's default setting side by side,
and whether the N verdicts agree.

``--cost``: what `check` and `verify` cost against the conversion they judge (the targets: CPU <= the
--prepack conversion, largest process <= 1 GiB, verify <= 2 x the larger model + 300 MiB), in one run on a
generated model folder (an fp32 MLP, a Conv net and a merged decoder, ~MIB MiB in all, default 128) converted with
`convert DIR -o OUT --prepack`: the conversion's CPU time; `check OUT`'s CPU time cold (an empty cache) and warm
(its measured verdicts reused) and its largest process (peak RSS of the biggest process of the run: ``ru_maxrss``
of ``RUSAGE_CHILDREN`` in a wrapper process started for each run); `verify` of the largest model and `verify
--decode-steps 4` of a t5-like ONNX decoder (its encoder beside it) and of a litert-torch-style two-signature
TFLite LM, each run's largest process against "2 x the larger model's mapped size + 300 MiB". ``--baseline DIR``:
the check and verify rows once more with the weightshare of another checkout (before/after side by side; the
conversion is this checkout's, so both checks judge the same folder against the same figure).

    python scripts/bench_check.py --cost 128 [--baseline /path/to/old/checkout]

``--tflite``: one FULLY_CONNECTED of ~MIB of fp32 weights, stored fp32, fp16 behind DEQUANTIZE or int8 weight-only
behind DEQUANTIZE, as given and converted; per setting (litert-builtin, litert-xnnpack) `check --target SETTING
--json` against 1 and 4 interpreters in a fresh process (``weightshare.formats.tflite.measure.measure_interpreters``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import _builders  # noqa: F401  (tests/ on the path: the model builders)
from model_forms import FORMS, build

from weightshare._runtimes.ort import measure_sessions
from weightshare.formats.onnx.measure import MALLOC_ENV

MiB = 1 << 20


def _check(model: Path, setting: str = "ort-default") -> tuple[int, int]:
    res = subprocess.run(
        [sys.executable, "-m", "weightshare", "check", str(model), "--target", setting, "--json"],
        capture_output=True,
        text=True,
    )
    doc = json.loads(res.stdout)
    (summary,) = [m for m in doc["reports"] if m["model"] == str(model)]
    return res.returncode, summary["copied_per_session_by_setting"].get(setting, 0)


def _growth(rows: list[dict[str, float]]) -> tuple[float, float]:
    """(PSS ratio 4/1, MiB per extra session): the growth without program code's PSS, on one session's PSS."""
    by = {r["sessions"]: r for r in rows}
    per = (by[4]["data_pss_mib"] - by[1]["data_pss_mib"]) / 3
    return (by[1]["pss_mib"] + 3 * per) / by[1]["pss_mib"], per


def _agree(code: int, figure: int, ratio: float, per: float) -> str:
    ok = code == (0 if ratio <= 1.10 else 1) and ((per < 1 and figure < MiB) or per / 2 <= figure / MiB <= 2 * per)
    return "yes" if ok else "NO"


def tflite(mib: float) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_check_measured_tflite import fc

    from weightshare.formats.tflite.measure import measure_interpreters

    k = 1024
    n = max(64, int(mib * MiB / (4 * k)))
    print(f"{'model':24s} {'setting':15s} {'exit':>4s} {'check MiB/i':>11s} {'PSS MiB/i':>9s} {'ratio 4/1':>9s}  agree")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("fp32", "fp16", "int8"):
            (Path(tmp) / kind).mkdir()
            src = fc(Path(tmp) / kind / "fc.tflite", kind, n, k)
            out = Path(tmp) / kind / "out"
            conv = subprocess.run(
                [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q"], capture_output=True
            )
            assert conv.returncode == 0, conv.stderr
            for label, model in (("as given", src), ("converted", out / "fc.tflite")):
                for setting, share in (("litert-builtin", True), ("litert-xnnpack", False)):
                    code, figure = _check(model, setting)
                    ratio, per = _growth(measure_interpreters(str(model), [1, 4], share, env=MALLOC_ENV))
                    print(
                        f"{kind + ' ' + label:24s} {setting:15s} {code:4d} {figure / MiB:11.1f} {per:9.1f} "
                        f"{ratio:9.2f}  {_agree(code, figure, ratio, per)}",
                        flush=True,
                    )


def _check_default(model: Path) -> tuple[int, float, str]:
    """(exit code, weight figure MiB per extra session at the model's default setting, that setting), no options."""
    res = subprocess.run(
        [sys.executable, "-m", "weightshare", "check", str(model), "--json"], capture_output=True, text=True
    )
    doc = json.loads(res.stdout)
    (summary,) = [m for m in doc["reports"] if m["model"] == str(model)]
    setting = summary["default_setting"]
    return res.returncode, summary["copied_per_session_by_setting"].get(setting, 0) / MiB, setting


def _stability_models(d: Path) -> list[tuple[str, Path, list[str]]]:
    """(name, model, convert flags) of the vision/audio forms: ONNX YOLO-like, ViT-like, Whisper-like encoder;
    a conv TFLite model."""
    from model_forms import vit_like, whisper_encoder
    from prepack_samples import cnn_onnx
    from tflite_fixtures import conv_vision

    built = [
        ("yolo-like", cnn_onnx(d / "yolo.onnx", channels=32, blocks=6, spatial=256)),
        ("vit-like", vit_like(d / "vit.onnx")),
        (
            "whisper-encoder-like",
            whisper_encoder(d / "whisper.onnx", 256, 4, mel_bins=80, positions=750, dynamic=False),
        ),
        ("conv-tflite", conv_vision(d / "conv.tflite")),
    ]
    out = []
    for name, model in built:
        out.append((name, model, []))
        out.append((name + " --prepack", model, ["--prepack"]))
    return out


def stability(runs: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    print(
        f"{'model':32s} {'setting':22s} "
        + " ".join(f"{'run ' + str(i + 1):>12s}" for i in range(runs))
        + "  one verdict"
    )
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for name, src, flags in _stability_models(d):
            model = src
            if flags:
                out = d / (src.stem + "-prepack")
                cmd = [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q", *flags]
                subprocess.run(cmd, check=True, capture_output=True)
                model = out / src.name
            got = [_check_default(model) for _ in range(runs)]
            cells = " ".join(f"{f'exit {c}, {f:.1f}':>12s}" for c, f, _ in got)
            same = "yes" if len({c for c, _, _ in got}) == 1 else "NO"
            print(f"{name:32s} {got[0][2]:22s} {cells}  {same}", flush=True)


_WRAP = (  # one run's CPU time (its whole tree, every descendant waited for) and its largest process
    "import json, resource, subprocess, sys\n"
    "r = subprocess.run(sys.argv[1:], capture_output=True)\n"
    "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "sys.stderr.buffer.write(r.stderr[-4000:])\n"
    "print(json.dumps({'rc': r.returncode, 'cpu': u.ru_utime + u.ru_stime, 'largest': u.ru_maxrss * 1024}))\n"
)


def _costed(args: list[str], env: dict[str, str] | None = None) -> tuple[int, float, int, str]:
    """(exit code, CPU seconds of the run's process tree, peak RSS bytes of its largest process, stderr's tail).
    A PYTHONPATH in ``env`` (another checkout) is also the run's working directory: ``python -m`` puts the working
    directory before PYTHONPATH, so run from this checkout it would import this checkout's weightshare."""
    import os

    cmd = [sys.executable, "-c", _WRAP, sys.executable, "-m", "weightshare", *args]
    cwd = (env or {}).get("PYTHONPATH") or None
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd)
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    return doc["rc"], doc["cpu"], doc["largest"], res.stderr.strip()[-300:]


def _cost_models(src: Path, mib: float) -> None:
    build("fp32", src / "mlp.onnx", mib / 2)
    build("conv", src / "cnn.onnx", mib / 4)
    build("merged_decoder", src / "decoder_model_merged.onnx", mib / 4)


def cost(mib: float, baseline: str = "") -> None:
    """The cost targets of check and verify, side by side in one run (module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from decoder_fixtures import t5_like
    from tflite_fixtures import two_signature_lm

    from weightshare._runtimes.bound import mapped_bytes
    from weightshare.formats.onnx.verify import mapped as onnx_mapped
    from weightshare.formats.tflite.verify import mapped as tflite_mapped

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        src, out = d / "src", d / "out"
        src.mkdir()
        _cost_models(src, mib)
        size = sum(mapped_bytes(m, [m.stem + ".data"]) for m in src.glob("*.onnx"))
        rc, convert_cpu, convert_largest, err = _costed(["convert", str(src), "-o", str(out), "--prepack", "-q"])
        assert rc == 0, err
        models = sorted(out.rglob("*.onnx"))
        print(
            f"folder: {len(list(src.glob('*.onnx')))} ONNX models, {size / MiB:.0f} MiB; --prepack output: "
            f"{len(models)} models (portable twins included), "
            f"{sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / MiB:.0f} MiB"
        )
        print(f"{'run':58s} {'exit':>4s} {'CPU s':>7s} {'largest process MiB':>20s}  target")
        print(f"{'convert DIR --prepack':58s} {rc:4d} {convert_cpu:7.1f} {convert_largest / MiB:20.0f}")
        trees = [("", "")] + ([(" (baseline)", baseline)] if baseline else [])
        for label in ("check OUT (cold: empty cache)", "check OUT (warm: verdicts cached)"):
            for tag, tree in trees:  # each tree its own cache: the baseline's cold run is cold too
                env = {"XDG_CACHE_HOME": str(d / f"cache{len(tag)}"), **({"PYTHONPATH": tree} if tree else {})}
                rc, cpu, largest, err = _costed(["check", str(out), "-q"], env)
                ok = cpu <= convert_cpu and largest <= 1 << 30
                print(
                    f"{label + tag:58s} {rc:4d} {cpu:7.1f} {largest / MiB:20.0f}  CPU <= convert's "
                    f"{convert_cpu:.1f} s, largest <= 1024 MiB: {'met' if ok else 'NOT met'}",
                    flush=True,
                )
        (d / "lm").mkdir()
        lm = two_signature_lm(d / "lm" / "lm.tflite", vocab=32768, width=512)
        rc, _, _, err = _costed(["convert", str(lm), "-o", str(d / "lm_out"), "-q"])
        assert rc == 0, err
        t5 = t5_like(d / "t5", heads=16, size=128)  # encoder 16 MiB, decoder 97 MiB, with past 65 MiB
        rc, _, _, err = _costed(["convert", str(d / "t5"), "-o", str(d / "t5_out"), "-q"])
        assert rc == 0, err
        decoder = t5[1]
        largest_src = max(src.glob("*.onnx"), key=onnx_mapped)
        runs = [
            (f"verify {largest_src.name} (--prepack)", largest_src, out / largest_src.name, [], onnx_mapped),
            (
                "verify --decode-steps 4, ONNX t5-like decoder",
                decoder,
                d / "t5_out" / decoder.name,
                ["--decode-steps", "4"],
                onnx_mapped,
            ),
            (
                "verify --decode-steps 4, TFLite 2-signature LM",
                lm,
                d / "lm_out" / lm.name,
                ["--decode-steps", "4"],
                tflite_mapped,
            ),
        ]
        for label, original, converted, extra, mapped in runs:
            larger = max(mapped(original), mapped(converted))
            target = 2 * larger + 300 * MiB
            for tag, tree in trees:
                env = {"PYTHONPATH": tree} if tree else None
                rc, cpu, largest, err = _costed(["verify", str(original), str(converted), "-q", *extra], env)
                print(
                    f"{label + tag:58s} {rc:4d} {cpu:7.1f} {largest / MiB:20.0f}  <= 2 x {larger / MiB:.0f} + 300 = "
                    f"{target / MiB:.0f} MiB: {'met' if largest <= target else 'NOT met'}",
                    flush=True,
                )


def main() -> None:
    if sys.argv[1:2] == ["--cost"]:
        rest = sys.argv[2:]
        baseline = rest[rest.index("--baseline") + 1] if "--baseline" in rest else ""
        numbers = [a for a in rest if a.replace(".", "").isdigit()]
        cost(float(numbers[0]) if numbers else 128.0, baseline)
        return
    if sys.argv[1:2] == ["--stability"]:
        stability(int(sys.argv[2]) if len(sys.argv) > 2 else 5)
        return
    if sys.argv[1:2] == ["--tflite"]:
        tflite(float(sys.argv[2]) if len(sys.argv) > 2 else 32.0)
        return
    mib = float(sys.argv[1]) if len(sys.argv) > 1 else 100.0
    names = sys.argv[2:] or list(FORMS)
    print(f"{'form':28s} {'variant':8s} {'exit':>4s} {'check MiB/s':>11s} {'PSS MiB/s':>9s} {'ratio 4/1':>9s}  agree")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            src = build(name, Path(tmp) / name / "m.onnx", mib)
            for variant, extra in (("plain", []), ("prepack", ["--prepack"])):
                out = Path(tmp) / name / variant
                conv = subprocess.run(
                    [sys.executable, "-m", "weightshare", "convert", str(src), "-o", str(out), "-q", *extra],
                    capture_output=True,
                    text=True,
                )
                if conv.returncode != 0:
                    print(f"{name:28s} {variant:8s} convert failed: {conv.stderr.strip()[:100]}")
                    continue
                code, figure = _check(out / "m.onnx")
                rows = {
                    r["sessions"]: r["pss_mib"]
                    for r in measure_sessions(str(out / "m.onnx"), [1, 4], False, MALLOC_ENV)
                }
                ratio, per = rows[4] / rows[1], (rows[4] - rows[1]) / 3
                agree = code == (0 if ratio <= 1.10 else 1) and (
                    (per < 1 and figure < MiB) or per / 2 <= figure / MiB <= 2 * per
                )
                print(
                    f"{name:28s} {variant:8s} {code:4d} {figure / MiB:11.1f} {per:9.1f} {ratio:9.2f}  "
                    f"{'yes' if agree else 'NO'}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
