"""TFLite models as the real converters write them, through every weightshare surface, in one table.

Builds (in an exporter venv: tensorflow-cpu, tf-keras, litert-torch 0.10, ai-edge-quantizer; see
../shared/EXPORTERS.md), from random weights:

  keras-fp32 / keras-fp16 / keras-dynint8   tf_keras Sequential(Input name "x", Dense(relu), Dense) through
                                            tf.lite.TFLiteConverter.from_keras_model (fp32; supported_types
                                            float16; optimizations DEFAULT = dynamic-range int8)
  torch-lm                                  a toy LM through litert_torch.signature("prefill", ...)
                                            .signature("decode", ...): two signatures over one copy of the weights,
                                            KV cache in and out, int32 tokens into an embedding table
  torch-lm-wi8                              the same through ai-edge-quantizer's weight_only_wi8_afp32 recipe

then prints each model's signatures (signature names against tensor names) and op list (what
tests/tflite_fixtures.py copies), converts each with weightshare (plain and --prepack), runs `verify` on both
(`--decode-steps 4` for the LM), `bench --sessions 1,4` (PSS of 1 and 4 instances per surface, each extra
instance's cost and one instance's own buffers) and `check` (its measured per-interpreter figure against bench's),
and prints one table.

Usage (from the project venv; the exporter venv only builds):
    python scripts/build_tflite_exporters.py --exporter-python /work/exvenv/tf/bin/python [--workdir DIR]
        [--width 512] [--vocab 8192] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_BUILD = r"""
import json, sys
from pathlib import Path
import numpy as np

out, width, vocab = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
built = {}

def keras_models():
    import tensorflow as tf
    import tf_keras as keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,), name="x"), keras.layers.Dense(width * 4, activation="relu"),
                              keras.layers.Dense(width * 4, activation="relu"), keras.layers.Dense(10)])
    for name, setup in (
        ("keras-fp32", lambda c: None),
        ("keras-fp16", lambda c: (setattr(c, "optimizations", [tf.lite.Optimize.DEFAULT]),
                                  setattr(c.target_spec, "supported_types", [tf.float16]))),
        ("keras-dynint8", lambda c: setattr(c, "optimizations", [tf.lite.Optimize.DEFAULT])),
    ):
        conv = tf.lite.TFLiteConverter.from_keras_model(model)
        setup(conv)
        (out / f"{name}.tflite").write_bytes(conv.convert())
        built[name] = str(out / f"{name}.tflite")

def torch_lm():
    import torch
    import litert_torch
    torch.manual_seed(0)
    cache, prompt = 64, 16

    class ToyLM(torch.nn.Module):
        def __init__(s):
            super().__init__()
            s.emb = torch.nn.Embedding(vocab, width)
            s.q = torch.nn.Linear(width, width, bias=False)
            s.k = torch.nn.Linear(width, width, bias=False)
            s.v = torch.nn.Linear(width, width, bias=False)
            s.mlp = torch.nn.Linear(width, 4 * width, bias=False)
            s.out = torch.nn.Linear(4 * width, width, bias=False)
            s.head = torch.nn.Linear(width, vocab, bias=False)
            s.pos = torch.nn.Parameter(torch.randn(cache, width) * 0.1)

        def forward(s, tokens, input_pos, kv_cache_k_0, kv_cache_v_0):
            h = s.emb(tokens) + s.pos[input_pos]
            q, k, v = s.q(h), s.k(h), s.v(h)
            kk = kv_cache_k_0.index_copy(1, input_pos, k)
            vv = kv_cache_v_0.index_copy(1, input_pos, v)
            h = h + torch.softmax(q @ kk.transpose(1, 2) / width**0.5, -1) @ vv
            h = h + s.out(torch.relu(s.mlp(h)))
            return {"logits": s.head(h), "kv_cache_k_0": kk, "kv_cache_v_0": vv}

    m = ToyLM().eval()
    kv = torch.zeros(1, cache, width)
    i32 = torch.int32
    pre = dict(tokens=torch.zeros(1, prompt, dtype=i32), input_pos=torch.arange(prompt, dtype=i32),
               kv_cache_k_0=kv, kv_cache_v_0=kv)
    dec = dict(tokens=torch.zeros(1, 1, dtype=i32), input_pos=torch.tensor([prompt], dtype=i32),
               kv_cache_k_0=kv, kv_cache_v_0=kv)
    edge = litert_torch.signature("prefill", m, sample_kwargs=pre).signature("decode", m, sample_kwargs=dec).convert()
    edge.export(str(out / "torch-lm.tflite"))
    built["torch-lm"] = str(out / "torch-lm.tflite")
    try:
        from ai_edge_quantizer import quantizer, recipe
        qt = quantizer.Quantizer(str(out / "torch-lm.tflite"))
        qt.load_quantization_recipe(recipe.weight_only_wi8_afp32())
        qt.quantize().export_model(str(out / "torch-lm-wi8.tflite"))
        built["torch-lm-wi8"] = str(out / "torch-lm-wi8.tflite")
    except Exception as e:  # noqa: BLE001 -- report it, keep the rest
        print(f"ai-edge-quantizer: {type(e).__name__}: {e}", file=sys.stderr)

keras_models()
torch_lm()
print(json.dumps(built))
"""


def structure(path: str) -> list[str]:
    """Signatures (signature name -> tensor name) and each signature subgraph's ops with their tensors."""
    import numpy as np
    from ai_edge_litert import schema_py_generated as s
    from ai_edge_litert.interpreter import Interpreter

    lines = []
    it = Interpreter(model_path=path)
    for key in it.get_signature_list():
        r = it.get_signature_runner(key)
        ins = {
            n: (d["name"], [int(x) for x in d["shape"]], np.dtype(d["dtype"]).name)
            for n, d in r.get_input_details().items()
        }
        outs = {n: (d["name"], [int(x) for x in d["shape"]]) for n, d in r.get_output_details().items()}
        lines.append(f"  signature {key!r}: inputs {ins}; outputs {outs}")
    model = s.ModelT.InitFromObj(s.Model.GetRootAs(Path(path).read_bytes(), 0))
    names = {v: k for k, v in vars(s.BuiltinOperator).items() if not k.startswith("_")}
    for si, sg in enumerate(model.subgraphs):
        ops = []
        for op in sg.operators or []:
            c = model.operatorCodes[op.opcodeIndex]
            ops.append(names.get(max(c.builtinCode, c.deprecatedBuiltinCode), "?"))
        const = {
            int(sg.tensors[i].buffer) for op in sg.operators or [] for i in op.inputs if i >= 0 and sg.tensors[i].buffer
        }
        lines.append(f"  subgraph {si} {sg.name!r}: {len(sg.tensors or [])} tensors, buffers read {sorted(const)}")
        lines.append(f"    ops: {' '.join(ops)}")
    return lines


def ws(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "weightshare", *args], capture_output=True, text=True, check=check)


def last_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip() and not ln.startswith(("INFO", "WARN"))]
    return lines[-1] if lines else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exporter-python", required=True, help="python of the venv with tensorflow and litert-torch")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tflite-exporters-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    res = subprocess.run(
        [args.exporter_python, "-c", _BUILD, str(work), str(args.width), str(args.vocab)],
        capture_output=True,
        text=True,
        env=env,
    )
    if res.returncode:
        sys.exit(f"building failed:\n{res.stderr[-3000:]}")
    built: dict[str, str] = json.loads(res.stdout.strip().splitlines()[-1])
    for line in res.stderr.splitlines():
        if line.startswith("ai-edge-quantizer"):
            print(line)
    rows = []
    for name, path in built.items():
        print(f"\n{name}: {path} ({Path(path).stat().st_size / 2**20:.1f} MiB)")
        for line in structure(path):
            print(line)
        lm = name.startswith("torch-lm")
        plain, pre = work / "plain", work / "prepack"
        convert_args = ["--unpack", "dequantize"] if name.endswith("wi8") else []
        ws("convert", path, "-o", str(plain), "-q", *convert_args)
        ws("convert", path, "-o", str(pre), "--prepack", "-q", *convert_args)
        steps = ["--decode-steps", "4"] if lm else []
        verdicts = {}
        for variant, folder in (("plain", plain), ("prepack", pre)):
            v = ws("verify", path, str(folder / Path(path).name), "--runs", "2", *steps)
            verdicts[variant] = (v.returncode, last_line(v))
        bench = ws("bench", path, "--sessions", "1,4", "--json")
        check = ws("check", path, "--json", "--target", "litert-xnnpack")
        figure = None
        try:
            doc = json.loads(check.stdout)
            summary = doc["reports"][0]
            figure = (summary["copies_source"], summary["copied_per_session_by_setting"].get("litert-xnnpack"))
        except (ValueError, KeyError, IndexError):
            figure = ("error", last_line(check))
        brows = json.loads(bench.stdout)["reports"][0]["rows"] if bench.returncode == 0 else []
        if convert_args:  # bench converts without them: measure this script's own --prepack output too
            from weightshare.formats.onnx.measure import MALLOC_ENV
            from weightshare.formats.tflite.measure import measure_shared

            mode = f"weightshare.litert.interpreter ({' '.join(convert_args)})"
            for r in measure_shared(str(pre / Path(path).name), [1, 4], env=MALLOC_ENV):
                brows.append({"variant": "converted --prepack", "mode": mode, **r})
        per: dict[tuple[str, str], dict[str, float]] = {}
        for r in brows:
            per.setdefault((r["variant"], r["mode"]), {})[str(r["sessions"])] = r["pss_mib"]
            per[(r["variant"], r["mode"])]["buffers"] = r.get("buffers_mib", 0.0)
        row = {
            "model": name,
            "verify": verdicts,
            "check_xnnpack": figure,
            "bench": {f"{k[0]} / {k[1]}": v for k, v in per.items()},
        }
        if bench.returncode:
            row["bench_error"] = last_line(bench)
        rows.append(row)
    print("\nmodel           surface                                      PSS 1    PSS 4   4/1  per extra  buffers")
    for row in rows:
        for surface, v in row["bench"].items():
            one, four = v.get("1", 0.0), v.get("4", 0.0)
            print(
                f"{row['model']:<15} {surface:<43} {one:7.1f}  {four:7.1f}  {four / one if one else 0:4.2f}"
                f"  {(four - one) / 3:8.2f}  {v['buffers']:7.2f}"
            )
        if "bench_error" in row:
            print(f"{row['model']:<15} bench failed: {row['bench_error']}")
        src, n = row["check_xnnpack"] or ("", None)
        xnn = row["bench"].get("original / XNNPACK", {})
        measured = (xnn.get("4", 0.0) - xnn.get("1", 0.0)) / 3
        ratio = f"{(n / 2**20) / measured:.2f}x of bench" if isinstance(n, int) and measured > 0 else ""
        shown = f"{n / 2**20:.2f} MiB" if isinstance(n, int) else n
        print(f"{row['model']:<15} check litert-xnnpack per interpreter: {src} {shown} {ratio}")
        for variant, (rc, line) in row["verify"].items():
            print(f"{row['model']:<15} verify {variant}: exit {rc}: {line[:160]}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
