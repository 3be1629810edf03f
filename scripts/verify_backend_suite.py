"""Convert and verify every onnx backend node test that carries weights, with its own test inputs.

Run by hand (minutes; not a test):  python scripts/verify_backend_suite.py [--limit N] [--show K]

The models ship in older onnx wheels (onnx/backend/test/data/node/*/model.onnx); onnx 1.23's wheel no longer
ships them, so they are then generated from the wheel's own case definitions (onnx.backend.test.case.node, the
same code `backend-test-tools generate-data` ran). A model is taken when it has an initializer, a Constant node, a
subgraph or a model-local function. Its inputs come from test_data_set_0/input_*.pb (TensorProto, SequenceProto,
OptionalProto or MapProto, chosen by the graph input's type) or the generated data set 0, passed to
``weightshare._dispatch.verify(..., inputs=...)`` -- what `verify --input NAME=FILE` does for tensors. Every outcome is
counted: verified, differs (verify exit 1), original fails in onnxruntime (exit 2), convert refused (a
WeightshareError, exit 2), and internal errors (anything else: a bug in weightshare). Exits 1 if any internal error.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
import traceback
from pathlib import Path

import onnx
from onnx import numpy_helper


def carries_weights(model: onnx.ModelProto) -> bool:
    if model.graph.initializer or model.graph.sparse_initializer or model.functions:
        return True
    return any(
        n.op_type == "Constant" or any(a.HasField("g") or len(a.graphs) for a in n.attribute) for n in model.graph.node
    )


def _value(proto_type, path: Path):
    data = path.read_bytes()
    if proto_type.HasField("sequence_type"):
        p = onnx.SequenceProto()
        p.ParseFromString(data)
        return numpy_helper.to_list(p)
    if proto_type.HasField("optional_type"):
        p = onnx.OptionalProto()
        p.ParseFromString(data)
        return numpy_helper.to_optional(p)
    if proto_type.HasField("map_type"):
        p = onnx.MapProto()
        p.ParseFromString(data)
        return numpy_helper.to_dict(p)
    p = onnx.TensorProto()
    p.ParseFromString(data)
    return numpy_helper.to_array(p)


def test_inputs(model_dir: Path, model: onnx.ModelProto) -> dict:
    inits = {t.name for t in model.graph.initializer}
    graph_inputs = [i for i in model.graph.input if i.name not in inits]
    files = sorted((model_dir / "test_data_set_0").glob("input_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
    return {i.name: _value(i.type, f) for i, f in zip(graph_inputs, files)}


def shipped_cases(root: Path):
    """(name, model path, inputs) from the wheel's data directory."""
    for d in sorted(d for d in root.iterdir() if (d / "model.onnx").is_file()):
        model = onnx.load(str(d / "model.onnx"), load_external_data=False)
        yield d.name, d / "model.onnx", model, (lambda d=d, model=model: test_inputs(d, model))


def generated_cases(work: Path, op_type: str | None = None):
    """(name, model path, inputs) generated from onnx's node case definitions (of one op type if given)."""
    from onnx.backend.test.case import node

    for case in node.collect_testcases(op_type):
        if not case.model or not case.data_sets:
            continue
        path = work / "src" / case.name / "model.onnx"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(case.model.SerializeToString())
        values = case.data_sets[0][0]

        def inputs(case=case, values=values):
            import numpy as np

            return {
                i.name: numpy_helper.to_array(v)
                if isinstance(v, onnx.TensorProto)
                else np.asarray(v)
                if isinstance(v, np.generic)
                else v  # what input_N.pb would hold
                for i, v in zip(case.model.graph.input, values)
            }

        yield case.name, path, case.model, inputs


def run_one(name: str, src: Path, model: onnx.ModelProto, inputs, work: Path) -> tuple[str, str]:
    from weightshare import api
    from weightshare._dispatch import verify
    from weightshare._verify import OriginalFails
    from weightshare.errors import WeightshareError

    if not carries_weights(model):
        return "skipped (no weights)", ""
    out = work / "out" / name
    try:
        report = api.convert(src, out)
    except WeightshareError as e:
        return "convert refused", e.line()
    try:
        result = verify(src, report.outputs[0], runs=1, inputs=inputs())
    except OriginalFails as e:
        return "original fails in onnxruntime", e.message
    except WeightshareError as e:
        return "verify refused (usage)", e.line()
    return (
        ("verified", "")
        if result.passed
        else ("differs", "; ".join(result.mismatches + result.checksum_mismatches)[:300])
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=0, help="only the first N test directories")
    ap.add_argument("--show", type=int, default=5, help="examples shown per outcome")
    args = ap.parse_args()
    root = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
    counts: collections.Counter = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cases = shipped_cases(root) if root.is_dir() else generated_cases(Path(tmp))
        total = 0
        for name, src, model, inputs in cases:
            if args.limit and total >= args.limit:
                break
            total += 1
            try:
                outcome, why = run_one(name, src, model, inputs, Path(tmp))
            except Exception as e:  # noqa: BLE001 -- counted: a bug in weightshare
                outcome, why = "INTERNAL ERROR", f"{type(e).__name__}: {e}"
                traceback.print_exc(limit=3, file=sys.stderr)
            counts[outcome] += 1
            if why and len(examples[outcome]) < args.show:
                examples[outcome].append(f"{name}: {why}")
    dirs = range(total)
    print(f"onnx {onnx.__version__}: {len(dirs)} backend node tests in {time.perf_counter() - start:.0f} s")
    for outcome, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {outcome}")
        for line in examples.get(outcome, []):
            print(f"         {line}")
    taken = sum(n for k, n in counts.items() if not k.startswith("skipped"))
    print(f"models with weights: {taken}; internal errors: {counts['INTERNAL ERROR']}")
    return 1 if counts["INTERNAL ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())
