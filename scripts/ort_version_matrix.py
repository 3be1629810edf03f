"""What a ``--prepack`` output made under this onnxruntime computes under others: version x route, measured.

    python scripts/ort_version_matrix.py --venv 1.21.0=/venvs/ort121 --venv 1.22.1=/venvs/ort122 \\
        --venv 1.26.0=/venvs/ort126 --venv 1.30.0=/venvs/ort130 [--out docs/ort_versions.txt]

Builds two models (fp32 MatMul + Gemm + Conv, ``prepack_samples.mixed_onnx``; an unfused fp16 encoder,
``model_forms`` "fp16"), converts each with ``--prepack`` under the onnxruntime running this script (the
converting version), then, in each venv given (its python, this checkout on PYTHONPATH) and in this one:

- raw: ``onnxruntime.InferenceSession("out/model.onnx")`` at default options, against the original in the same
  runtime at batch 1 and 16: exact (np.array_equal), differs (max |d|) or refused (the load fails);
- helper: ``weightshare.ort.session("out/model.onnx")``: packed (the prepacked graph) or portable (the portable
  model), and exact or differs against the original at the same (default) options;
- check: ``weightshare check out/model.onnx --no-measure``: passes (exit 0) or refused (exit 1, the codes);
- verify: ``weightshare verify original out/model.onnx``: exact (exit 0) or fails (exit 1, the first line).

Also the memory figure the no-options route would pay if out/model.onnx held the portable model: the bytes each
default-option session pre-packs for itself (the packed copies the blob records). Writes the table to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

_PROBE = r"""
import json, logging, subprocess, sys
import numpy as np
import onnxruntime as ort
sys.path.insert(0, sys.argv[3])
src, packed, tests = sys.argv[1], sys.argv[2], sys.argv[3]

def feeds(batch):
    if src.endswith("mixed.onnx"):
        from prepack_samples import sample_input
        return sample_input(src, batch)
    import model_forms as mf
    return mf.feeds(src, batch)

def compare(sess):
    original = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    worst = 0.0
    for batch in (1, 16):
        f = feeds(batch)
        for a, b in zip(original.run(None, f), sess.run(None, f)):
            if not np.array_equal(a, b):
                worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
    return "exact" if worst == 0 else f"differs {worst:.2g}"

out = {"version": ort.__version__}
for key, path in (("raw", packed), ("unstamped", packed.replace(".onnx", ".unstamped.onnx"))):
    try:
        out[key] = compare(ort.InferenceSession(path, providers=["CPUExecutionProvider"]))
    except Exception as e:
        out[key] = "refused: " + str(e).splitlines()[0][-120:]
said = []
class H(logging.Handler):
    def emit(self, r): said.append(r.getMessage())
logging.getLogger("weightshare.ort").addHandler(H())
logging.getLogger("weightshare.ort").setLevel(logging.INFO)
try:
    import weightshare.ort as wort
    sess = wort.session(packed)
    which = "packed" if any("prepacked graph" in s for s in said) else "portable"
    out["helper"] = f"{which}, {compare(sess)}"
except Exception as e:
    out["helper"] = "refused: " + str(e).splitlines()[0][-120:]
def cli(*args):
    return subprocess.run([sys.executable, "-m", "weightshare", *args], capture_output=True, text=True)
res = cli("check", packed, "--no-measure")
codes = sorted({l.split(": ")[2] for l in res.stdout.splitlines() if l.count(": ") >= 3 and ": error: " in l})
out["check"] = "passes" if res.returncode == 0 else f"refused ({', '.join(codes) or res.returncode})"
res = cli("verify", src, packed)
fails = [l for l in res.stdout.splitlines() if l.startswith("FAIL: ")]
why = "names the version" if fails and "was packed for onnxruntime" in fails[0] else (fails or ["?"])[0][:40]
out["verify"] = "exact" if res.returncode == 0 else f"fails, {why}"
print(json.dumps(out))
"""


def build(tmp: Path) -> list[tuple[str, Path, Path, int]]:
    import model_forms as mf
    from prepack_samples import mixed_onnx

    import weightshare
    from weightshare.formats.onnx.ort.opened import prepack_info

    models = []
    for name, make in (
        ("fp32 MatMul+Gemm+Conv", lambda d: mixed_onnx(d / "mixed.onnx", conv_layers=2, channels=32, mm_layers=3)),
        ("fp16 encoder", lambda d: mf.build("fp16", d / "model.onnx", mib=1)),
    ):
        d = tmp / name.split()[0]
        d.mkdir()
        src = make(d)
        report = weightshare.convert(src, d / "out", prepack=True)
        packed = Path(report.outputs[0])
        _unstamped(packed)
        info, blob = prepack_info(packed)  # type: ignore[misc]
        header_bytes = _packed_bytes(blob, str(info["packed_prefix"]))
        models.append((name, src, packed, header_bytes))
    return models


def _unstamped(packed: Path) -> None:
    """A copy of the prepacked model without the opset stamp (what a raw load computed before it), beside it."""
    import onnx

    from weightshare.formats.onnx.ort.probe import STAMP_DOMAIN

    m = onnx.load(str(packed), load_external_data=False)
    keep = [o for o in m.opset_import if o.domain != STAMP_DOMAIN]
    del m.opset_import[:]
    m.opset_import.extend(keep)
    onnx.save(m, str(packed.with_suffix(".unstamped.onnx")))


def _packed_bytes(blob: Path, prefix: str) -> int:
    from weightshare._safetensors import read_safetensors_metadata

    _start, header, _meta = read_safetensors_metadata(str(blob))
    return sum(
        e["data_offsets"][1] - e["data_offsets"][0]
        for n, e in header.items()
        if isinstance(n, str) and n.startswith(prefix) and isinstance(e, dict)
    )


def main() -> int:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", action="append", default=[], help="LABEL=VENV_DIR, repeatable (oldest first)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "ort_versions.txt")
    args = ap.parse_args()
    pythons = [(label, str(Path(d) / "bin" / "python")) for label, d in (v.split("=", 1) for v in args.venv)]
    pythons.append((ort.__version__, sys.executable))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "PYTHONWARNINGS": "ignore"}
    lines = [
        f"# scripts/ort_version_matrix.py: --prepack outputs made under onnxruntime {ort.__version__} "
        f"({'+'.join(sorted(_kind()))}), opened under each version on the same CPU.",
        "# raw: InferenceSession('out/model.onnx'), default options, vs the original in that runtime, batch 1 and 16",
        "# helper: weightshare.ort.session (which model it opened), same comparison; check: exit; verify: exit",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        models = build(Path(tmp))
        for name, src, packed, packed_bytes in models:
            lines.append(
                f"## {name}: each default-option session of the portable model pre-packs "
                f"{packed_bytes / 2**20:.2f} MiB for itself (what out/model.onnx holding the portable model would "
                "cost the no-options route per session)"
            )
            lines.append(
                f"{'onnxruntime':<12} | {'raw load':<9} | {'raw, without the stamp':<22} | {'helper':<16} | "
                f"{'check':<36} | verify"
            )
            refusal = ""
            for label, python in pythons:
                res = subprocess.run(
                    [python, "-c", _PROBE, str(src), str(packed), str(ROOT / "tests")],
                    capture_output=True,
                    text=True,
                    env=env,
                )
                try:
                    row = json.loads(res.stdout.strip().splitlines()[-1])
                except (IndexError, json.JSONDecodeError):
                    lines.append(f"{label:<12} | probe failed: {(res.stderr.strip().splitlines() or [''])[-1]}")
                    continue
                raw, unstamped = (
                    r if not r.startswith("refused") else "refused" for r in (row["raw"], row["unstamped"])
                )
                lines.append(
                    f"{row['version']:<12} | {raw:<9} | {unstamped:<22} | {row['helper']:<16} | {row['check']:<36} | "
                    f"{row['verify']}"
                )
                if row["raw"].startswith("refused") and not refusal:
                    refusal = f"(onnxruntime {row['version']}'s raw {row['raw']})"
            lines += [refusal, ""] if refusal else [""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


def _kind() -> list[str]:
    import platform

    from weightshare.formats.onnx.ort.probe import cpu_features, cpu_kind

    return [cpu_kind(cpu_features(), platform.machine())]


if __name__ == "__main__":
    sys.exit(main())
