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


def main() -> None:
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
