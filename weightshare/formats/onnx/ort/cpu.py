"""``--unpack ort-cpu``: make once, in the file, the fp16 -> fp32 Casts ONNX Runtime's CPU provider inserts per session.

Models from ``onnxconverter_common.float16.convert_float_to_float16`` feed fp16 weights straight into MatMul/Conv/
Gemm. The CPU provider has no fp16 kernel for many ops, so at every session creation its InsertCastTransformer puts
``Cast(fp16 -> float)`` nodes (``InsertedPrecisionFreeCast_*``) in front of them and each session ends up with a
private fp32 copy of the weights. Which Casts ORT inserts changes with its kernel set, so we ask ORT itself:

1. probe: a small stand-in of the model (the skeleton; big payloads point at one sparse file of zeros, small ones
   carry their real bytes since kernels and shape inference may read them) is loaded by ORT at ORT_DISABLE_ALL in a
   child process with ``optimized_model_filepath``. The saved graph is exactly what the CPU provider runs: the
   model's nodes with the inserted Casts, no other rewrite. The child maps the zeros and never touches them, so the
   probe costs the same for a 64 MiB and a 1 GiB model, and an ORT crash on a hostile file cannot take us down.
2. adopt: the probe graph's nodes replace the skeleton's (matched by identity: each probe node is named after its
   index in the skeleton, so the skeleton's nodes keep their payload markers and names), then the ordinary fold
   (``fold_fp16_casts``) stores the Cast-fed initializers as fp32.

The result is CPU-specific: a GPU provider would have run the fp16 graph natively.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.message import DecodeError

from ...._atomic import locked_stage
from ...._tensors import read_all
from ....errors import InvalidModel, Unsupported, UsageError
from ....options import ConvertOptions
from .. import dtypes
from .._proto import load_model, pb
from ..disk_use import memory_scratch
from ..graph import collect_sites, subgraphs
from ..scan import REF_KEY, TensorRef
from .fold_bound import check_constant_folding
from .limits import ChildLimits, limits_for
from .names import CHECKED_ON, FUSED_BACK, INLINED_FUNCTION, INSERTED_CAST, KNOWN_COMPUTED, apply_saved_hook

PREFIX = INSERTED_CAST  # the names ORT gives what it makes, with the version they were checked on: ``names``
TAG = "weightshare.probe/"  # probe node names: "<TAG><index of the skeleton's node>"
# Payloads up to this size keep their real bytes in the probe (shape tensors, pads, scales that kernels or shape
# inference read); larger ones are stand-ins mapped from the zeros file, never read at ORT_DISABLE_ALL.
REAL_BYTES_MAX = 64 << 10
ZEROS = "zeros.bin"
SCRATCH_HOLD = 4  # a pair of saved windows: the original's with its fp16 weights folded to fp32, and the adopted one
TMP = "weightshare-ortcpu-"  # $TMPDIR prefix of inspect's and check's probes (no OUTDIR there)

# Runs in a fresh interpreter that imports nothing of ours: ORT loads the probe and saves what it would run.
_CHILD = r"""
import ctypes, json, resource, signal, sys
try:  # die with the converter (PR_SET_PDEATHSIG): a kill -9 of it must not leave this child running
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
except (OSError, AttributeError):
    pass
import onnxruntime as ort
so = ort.SessionOptions()
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
so.optimized_model_filepath = sys.argv[2]
so.add_session_config_entry("session.disable_prepacking", "1")
so.log_severity_level = 3
try:
    ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
except Exception as e:
    print(" ".join(str(e).split())[:300], file=sys.stderr)
    sys.exit(3)
print(json.dumps({"version": ort.__version__,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


# The rounding check: ORT optimizes the original's and the adopted graph's probes at its default level, in one
# child; the parent compares what it fused. Pre-packing stays off (no weight is read for it). The optimized graph is
# saved without an external initializers file: ORT 1.32 then saves an external initializer it did not change as its
# reference (location/offset/length, its bytes never read) and writes inline only what it computed itself (fused or
# folded tensors). With that file it read every mapped stand-in to copy it there, and each page of the zeros file it
# read stayed resident in the child: the child grew with the model (250 MiB for 64 MiB of fp16 weights, 650 MiB for
# 256 MiB). The parent reads the saved graph's skeleton only (``_saved_graph``). With STEP_ENV set, the child prints
# each saved graph's path and waits for a line on stdin before the next (``_run_stepped``): the parent reads and
# removes each pair of windows first, so a memory-backed scratch holds one window's folded tensors, not the model's.
STEP_ENV = "WEIGHTSHARE_CHECK_STEP"
_CHECK_CHILD = r"""
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
    ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: a window's freed tensors go back to the system
except (OSError, AttributeError):
    pass
import onnxruntime as ort
for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):
    so = ort.SessionOptions()
    so.optimized_model_filepath = dst
    so.add_session_config_entry("session.disable_prepacking", "1")
    so.log_severity_level = 3
    try:
        ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    except Exception as e:  # which graph failed (the directory: original / adopted), then ORT's words
        role = src.replace("\\", "/").split("/")[-2] if "/" in src.replace("\\", "/") else ""
        print(role + ": " + " ".join(str(e).split())[:300], file=sys.stderr)
        sys.exit(3)
    if os.environ.get("WEIGHTSHARE_CHECK_STEP") == "1":
        print(dst, flush=True)
        if not sys.stdin.readline():
            sys.exit(0)
print("{}")
"""


@dataclass
class Probe:
    """What ORT's CPU provider would run, as saved by ORT itself."""

    graph: pb.GraphProto
    opsets: dict[str, int]  # domain -> version, as ORT saved them (function bodies may bring new domains)
    version: str  # onnxruntime version that answered
    child_peak_rss_mib: float

    def cast_initializers(self) -> list[str]:
        """Names of initializers ORT casts fp16 -> float per session (a private fp32 copy each)."""
        inits = {t.name for t in self.graph.initializer}
        return [n.input[0] for n in self.graph.node if _is_inserted(n) and n.input[0] in inits and _to_float(n)]


def onnxruntime_version() -> str | None:
    from importlib import metadata  # here, like subprocess and tempfile below: inspect of an fp32 model needs none

    try:
        return metadata.version("onnxruntime")
    except metadata.PackageNotFoundError:
        return None


def _is_inserted(node: pb.NodeProto) -> bool:
    return node.op_type == "Cast" and node.name.startswith(PREFIX) and len(node.input) == 1


def _to_float(node: pb.NodeProto) -> bool:
    return any(a.name == "to" and a.i == dtypes.FLOAT for a in node.attribute)


def _stand_in(tensor: pb.TensorProto, ref: TensorRef, real: bool) -> int:
    """Give one cut-out payload a body ORT accepts; returns the bytes it maps from the zeros file."""
    del tensor.external_data[:]
    tensor.ClearField("data_location")
    if ref.data_type == dtypes.STRING:
        raise InvalidModel("--unpack ort-cpu: string tensors are not supported", ref.path)
    nbytes = ref.native_nbytes
    if real or nbytes <= REAL_BYTES_MAX:
        tensor.raw_data = read_all(ref.native_source())
        return 0
    tensor.data_location = pb.TensorProto.EXTERNAL
    for key, value in (("location", ZEROS), ("offset", "0"), ("length", str(nbytes))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return nbytes


def _tag(index: int) -> str:
    """The probe's name for the skeleton's node ``index``: ORT keeps node names, so its saved graph says which
    of its nodes is which of ours. No tensor or node name of the user's is involved in the match."""
    return f"{TAG}{index}"


def _tag_index(name: str, count: int) -> int | None:
    digits = name[len(TAG) :] if name.startswith(TAG) else ""
    index = int(digits) if digits.isdigit() and digits == str(int(digits)) else -1
    return index if 0 <= index < count else None


def write_probe_model(skeleton: pb.ModelProto, refs: Sequence[TensorRef], directory: Path) -> Path:
    probe = pb.ModelProto()
    probe.CopyFrom(skeleton)
    for i, node in enumerate(probe.graph.node):
        node.name = _tag(i)
    by_index = {r.index: r for r in refs}
    zeros = 0
    for index, site in collect_sites(probe).items():
        # ORT densifies sparse initializers at load: zero indices could be refused, so they keep their bytes.
        zeros = max(zeros, _stand_in(site.tensor, by_index[index], real=site.kind.startswith("sparse")))
    with open(directory / ZEROS, "wb") as f:
        f.truncate(zeros)  # a hole: no disk, and ORT maps it without reading
    path = directory / "probe.onnx"
    path.write_bytes(probe.SerializeToString())
    return path


def run_probe(
    skeleton: pb.ModelProto,
    refs: Sequence[TensorRef],
    src: Path,
    stage_in: Path | None = None,
    options: ConvertOptions | None = None,
) -> Probe:
    """ORT's answer for ``skeleton``, from a bounded child (``limits``) working in a locked staging directory
    inside ``stage_in`` (OUTDIR: never $TMPDIR, so a killed run leaves nothing there that the next run's
    cleanup would not remove), or in a temporary directory when there is no OUTDIR (inspect, check)."""
    import tempfile

    if onnxruntime_version() is None:
        raise UsageError("--unpack ort-cpu needs onnxruntime installed (pip install onnxruntime)", src)
    opts = options or ConvertOptions()
    input_bytes = src.stat().st_size + sum(r.native_nbytes for r in refs)
    check_constant_folding(skeleton, input_bytes, src, opts.ort_max_growth)
    limits = limits_for(input_bytes, src, opts.ort_child_timeout_s, opts.ort_child_memory_mib, opts.ort_max_growth)
    where = locked_stage(stage_in, "ortcpu") if stage_in is not None else tempfile.TemporaryDirectory(prefix=TMP)
    with where as tmp_name:
        tmp = Path(tmp_name).absolute()  # the child runs in it: a relative OUTDIR must not be resolved twice
        probe_path = write_probe_model(skeleton, refs, tmp)
        out = tmp / "optimized.onnx"
        if opts.stage is not None:
            opts.stage("onnxruntime reads the graph it would run (child process)")
        stdout = _run_child(_CHILD, [str(probe_path), str(out)], [out], limits, tmp, src, "load")
        answer = json.loads(stdout.strip().splitlines()[-1])
        optimized = _read_saved(out, src)
    unknown = unrecognised_casts(optimized.graph)
    if unknown:
        raise Unsupported(
            f"onnxruntime {answer['version']} adds Cast nodes under a name weightshare does not know ({unknown[0]!r}; "
            f"onnxruntime {CHECKED_ON} names them {PREFIX}*): refused rather than guess which Casts it inserts per "
            "session (ort/names.py)",
            src,
        )
    opsets = {o.domain: o.version for o in optimized.opset_import}
    return Probe(optimized.graph, opsets, answer["version"], answer["peak_rss_mib"])


def unrecognised_casts(graph: pb.GraphProto) -> list[str]:
    """Names of the Casts ORT added to the probe (none of its nodes is one of ours, ``_tag``) under a name that is
    neither InsertCastTransformer's (``names.INSERTED_CAST``) nor empty (a function body ORT expanded): an ORT that
    names its inserted Casts otherwise. The probe renamed every node of the model, so no name of the user's is
    involved."""
    return [
        n.name
        for n in graph.node
        if n.op_type == "Cast" and n.name and not n.name.startswith(TAG) and not n.name.startswith(PREFIX)
    ]


def _run_child(
    script: str, args: list[str], outs: list[Path], limits: ChildLimits, tmp: Path, src: Path, verb: str
) -> str:
    """Run an onnxruntime child (``python -c script *args``) in ``tmp`` under ``limits``; its stdout, or
    InvalidModel naming the limit it hit or the last line ORT printed."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("ORT_")}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script, *args],
            capture_output=True,
            check=False,
            text=True,
            timeout=limits.wall_s,
            env=env,
            cwd=tmp,
            preexec_fn=limits.preexec(),
        )
    except subprocess.TimeoutExpired:
        raise InvalidModel(limits.timeout_message(), src) from None
    if proc.returncode != 0:
        hit = limits.failure(proc.returncode, proc.stderr, outs)
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise InvalidModel(hit or f"onnxruntime (CPU) cannot {verb} the model: {why}", src)
    return proc.stdout


def _create(path: Path) -> Path:
    path.touch(exist_ok=False)
    return path


def _run_stepped(
    args: list[str],
    outs: list[Path],
    limits: ChildLimits,
    tmp: Path,
    src: Path,
    on_saved: Callable[[int], str | None],
) -> str | None:
    """``_run_child`` of ``_CHECK_CHILD`` one saved graph at a time: ``on_saved(k)`` once ``outs[k]`` is written,
    before the child goes on; the first answer that is not None ends the child and is returned."""
    import subprocess
    import threading

    env = {k: v for k, v in os.environ.items() if not k.startswith("ORT_")} | {STEP_ENV: "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHECK_CHILD, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp,
        preexec_fn=limits.preexec(),
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        proc.kill()

    timer = threading.Timer(limits.wall_s, expire)
    timer.start()
    try:
        for k in range(len(outs)):
            if not proc.stdout.readline():
                break  # it failed (or was killed): its exit status says why
            found = on_saved(k)
            if found is not None:
                return found
            try:
                proc.stdin.write("\n")
                proc.stdin.flush()
            except BrokenPipeError:
                break
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
        proc.stdout.read()
        stderr = proc.stderr.read()
        proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                stream.close()
            except BrokenPipeError:
                pass
    if expired.is_set():
        raise InvalidModel(limits.timeout_message(), src)
    if proc.returncode != 0:
        hit = limits.failure(proc.returncode, stderr, outs)
        why = (stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise InvalidModel(hit or f"onnxruntime (CPU) cannot optimize the model: {why}", src)
    return None


def _read_saved(out: Path, src: Path) -> pb.ModelProto:
    """The model ORT saved at ``out``; ORT wrote it, so a failure here is ours to report plainly."""
    model = pb.ModelProto()
    try:
        model.ParseFromString(out.read_bytes())
    except (DecodeError, OSError) as e:
        raise InvalidModel(f"could not read the graph onnxruntime saved ({e})", src) from None
    apply_saved_hook(model)
    return model


def _saved_graph(out: Path, src: Path) -> pb.GraphProto:
    """The graph of the model ORT saved at ``out``, its payloads left in the file (a tensor ORT fused or folded
    is written inline and can be as large as a weight): what the rounding checks compare is nodes."""
    from ..scan import scan_model

    model = pb.ModelProto()
    try:
        skeleton, _refs = scan_model(out)
        model.ParseFromString(skeleton)
    except (DecodeError, OSError, InvalidModel) as e:
        why = e.message if isinstance(e, InvalidModel) else str(e)
        raise InvalidModel(f"could not read the graph onnxruntime saved ({why})", src) from None
    apply_saved_hook(model)
    return model.graph


def _prefold(probe_path: Path, zeros: Path, inserted: set[str]) -> dict[str, str]:
    """In a probe of the adopted graph, do the fold the conversion will do (an fp16 stand-in read only by an
    inserted Cast to float becomes an fp32 stand-in under the Cast's output name), so that ORT's constant folding
    has no large Cast to compute: the check costs the same for a 64 MiB and a 1 GiB model. ``inserted``: the
    probe's names (``_tag``) of the Casts ORT inserted (the probe renamed every node). Returns the folded
    stand-ins' new names -> their names in the original."""
    model = load_model(probe_path)
    g = model.graph
    uses: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            uses[i] = uses.get(i, 0) + 1
    overridable = {v.name for v in g.input}  # Casts that run every time (``keep_casts_at_run``): not folded
    stand_ins = {
        t.name: t for t in g.initializer if t.data_location == pb.TensorProto.EXTERNAL and t.name not in overridable
    }
    outputs = {o.name for o in g.output}
    keep: list[pb.NodeProto] = []
    renamed: dict[str, str] = {}  # a folded stand-in's new name -> its name in the original
    longest = zeros.stat().st_size
    for n in g.node:
        cast = n.name in inserted and n.op_type == "Cast" and len(n.input) == 1 and _to_float(n)
        t = stand_ins.get(n.input[0]) if cast else None
        if t is None or t.data_type != dtypes.FLOAT16 or uses.get(t.name) != 1 or t.name in outputs:
            keep.append(n)
            continue
        renamed[n.output[0]] = t.name
        t.name, t.data_type = n.output[0], dtypes.FLOAT
        for e in t.external_data:
            if e.key == "length":
                e.value = str(2 * int(e.value))
                longest = max(longest, int(e.value))
    del g.node[:]
    g.node.extend(keep)
    with open(zeros, "r+b") as f:
        f.truncate(longest)
    probe_path.write_bytes(model.SerializeToString())
    return renamed


def _fused(graph: pb.GraphProto) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for n in graph.node:
        if n.op_type != "Cast":
            key = (n.domain or "ai.onnx", n.op_type)
            counts[key] = counts.get(key, 0) + 1
    return counts


_TYPE_NAMES = {dtypes.FLOAT: "float", dtypes.FLOAT16: "float16", dtypes.BFLOAT16: "bfloat16"}

# Ops whose CPU kernel ORT picks by the type of their weights (fp16 or fp32), which round apart.
TYPED_KERNELS = frozenset(
    {"LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
     "SkipSimplifiedLayerNormalization", "Gemm"}
)  # fmt: skip


def _kernel_types(graph: pb.GraphProto) -> dict[tuple[str, tuple[tuple[str, int], ...]], int]:
    """``TYPED_KERNELS`` and ``CONSTANT_SENSITIVE`` nodes by the weights they read: each as a constant or as a Cast
    of an initializer that runs every time, and by its type
    (ORT picks the fp16 or the fp32 kernel by them, and pre-packs only a constant). Activations' types are left out:
    ORT does not save them alike in both graphs."""
    # a check gives some weights as graph inputs, in both graphs alike (a window) or in one only (the reload probe's
    # large weights): an input counts as a constant; what tells the graphs apart is a Cast of an initializer that
    # runs every time, against a constant
    inputs = {v.name for v in graph.input}
    weights = {v.name: ("constant", v.type.tensor_type.elem_type) for v in graph.input}
    weights.update((t.name, ("constant", t.data_type)) for t in graph.initializer)
    for n in graph.node:  # a weight ORT casts at every run reaches its reader as the Cast's type
        if n.op_type == "Cast" and n.input and n.input[0] in weights:
            kind = "constant" if n.input[0] in inputs else "cast"
            weights[n.output[0]] = (kind, next((a.i for a in n.attribute if a.name == "to"), 0))
    counts: dict[tuple[str, tuple[tuple[str, int], ...]], int] = {}
    for n in graph.node:
        if n.op_type in TYPED_KERNELS or n.op_type in CONSTANT_SENSITIVE:
            # not the input; constant or cast only where ORT pre-packs (B of a MatMul/Gemm, a Conv's W): a bias or
            # a norm's scale is the same numbers either way
            packs = n.op_type in CONSTANT_SENSITIVE
            read = [
                (w[0] if packs and k == 1 else "", w[1]) for k, i in enumerate(n.input) if k and (w := weights.get(i))
            ]
            key = (n.op_type, tuple(read))
            counts[key] = counts.get(key, 0) + 1
    return counts


def _reads_change(original: pb.GraphProto, adopted: pb.GraphProto) -> str | None:
    """With the same ops in both graphs: a MatMul/Gemm/Conv or norm that reads its weights otherwise (a constant
    against a Cast that runs every time, fp32 against fp16), which takes another kernel."""
    at_run, folded = _casts_of_initializers(original), _casts_of_initializers(adopted)
    if folded < at_run:
        return (
            f"ConstantFolding folds {at_run - folded} Cast(s) of a weight that the original casts at every run, "
            "so its MatMul/Gemm/Conv takes a constant instead (pre-packed: other kernels)"
        )
    if folded > at_run:  # a weight the original's readers took as a constant (after CSE merged them) runs cast
        return (
            f"{folded - at_run} weight(s) reach a MatMul/Gemm/Conv through a Cast at every run where the original "
            "gave it a constant (pre-packed: other kernels)"
        )
    kernels = _kernel_types(original), _kernel_types(adopted)
    if kernels[0] != kernels[1]:
        op, read = next(k for k in {**kernels[0], **kernels[1]} if kernels[1].get(k, 0) != kernels[0].get(k, 0))
        what = ", ".join(f"{kind} {_TYPE_NAMES.get(t, t)}".strip() for kind, t in read) or "no weight"
        return (
            f"{op} reads its weights otherwise than in the original ({what} in one graph, not the other: another "
            "kernel, or a constant pre-packed)"
        )
    return None


def rounding_change(
    original: pb.GraphProto, adopted: pb.GraphProto, ours: dict[tuple[str, str], int] | None = None
) -> str | None:
    """What ORT fuses in the adopted graph and not in the original (once the Casts are in the file its fp32
    fusions apply where the fp16 graph had none), when that fusion can round differently; None when ORT runs
    the same ops. ``ours``: nodes the adopted graph holds that the original does not
    (written by us, not fused by ORT)."""
    before, after = _fused(original), _fused(adopted)
    for key, count in (ours or {}).items():
        before[key] = before.get(key, 0) + count
    more = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    if not more:
        return _reads_change(original, adopted)
    # No fusion counts as exact: FusedMatMul even with a power-of-two alpha (the same products in theory) took
    # another GEMM path at batch 1 than MatMul and Mul did (1.9e-6 apart, a generated fp16 model).
    fewer = {k: v - after.get(k, 0) for k, v in before.items() if v > after.get(k, 0)}
    bad = next(n for n in adopted.node if ((n.domain or "ai.onnx"), n.op_type) in more)
    if _scale_fusion(more, fewer):  # by structure: ``unpack_for_cpu`` repairs this one (``unfuse``)
        fusion = SCALE_FUSION
    else:  # ORT's name for it, for the message only (``names``): the change is refused whatever it is called
        fusion = next((p for p in bad.name.split("/") if p.endswith(("Fusion", "Transformer"))), "a fusion")
    made = ", ".join(f"{v} {d}.{o}" if d != "ai.onnx" else f"{v} {o}" for (d, o), v in sorted(more.items()))
    gone = ", ".join(f"{v} {o}" for (_d, o), v in sorted(fewer.items())) or "other nodes"
    return f"{fusion} makes {made} of {gone}"


SCALE_FUSION = "MatMulScaleFusion"  # ORT's transformer of that name: what ``unfuse`` undoes


def _scale_fusion(more: dict[tuple[str, str], int], fewer: dict[tuple[str, str], int]) -> bool:
    """ORT's MatMulScaleFusion, told by what it made of what (not by the name ORT gives the node): FusedMatMul
    nodes where the original had MatMuls and Mul/Div (by a scalar) nodes, and nothing else changed."""
    made = set(more) == {("com.microsoft", "FusedMatMul")}
    gone = set(fewer) <= {("ai.onnx", "MatMul"), ("ai.onnx", "Mul"), ("ai.onnx", "Div")}
    return made and gone and bool(set(fewer) & {("ai.onnx", "Mul"), ("ai.onnx", "Div")})


# The rounding check optimizes the graph once per window, not once, when the original's stand-ins exceed two
# windows' worth of this many bytes: at ORT's default level the original's session casts every fp16 weight to
# an fp32 constant (its stand-in's pages read, and the cast: 3x its bytes resident), so one pass over the whole
# graph made the child grow with the model (250 MiB for 64 MiB of fp16 weights, 650 MiB for 256 MiB). A window
# is the whole graph in which the stand-ins of two adjacent chunks (weights in the order their first readers
# come, CHECK_SEGMENT_BYTES a chunk) stay constants and every other stand-in is a graph input of its type and
# shape. Cutting the graph instead loses what ORT's decisions read from the whole (how many nodes read a shared
# fp16 scalar decides MatMulScaleFusion: fused in every window of a transformer cut in pieces, in neither graph
# whole). A weight that is an input can only make ORT fuse less; every fusion that reads weights of at most two
# adjacent chunks sees them constant in one window, and both graphs' windows are compared op for op.
CHECK_SEGMENT_BYTES = 16 << 20


def _standin_bytes(t: pb.TensorProto) -> int:
    return next((int(e.value) for e in t.external_data if e.key == "length"), 0)


def _windows(probe: pb.ModelProto) -> list[set[str]] | None:
    """The stand-ins each window keeps constant (names in ``probe``, the original's probe), or None to optimize
    the graph once with all of them."""
    g = probe.graph
    sizes = {t.name: _standin_bytes(t) for t in g.initializer if t.data_location == pb.TensorProto.EXTERNAL}
    if sum(sizes.values()) <= 2 * CHECK_SEGMENT_BYTES:
        return None
    order = list(dict.fromkeys(i for n in g.node for i in n.input if i in sizes))
    order += [name for name in sizes if name not in set(order)]
    chunks: list[list[str]] = [[]]
    size = 0
    for name in order:
        if chunks[-1] and size + sizes[name] > CHECK_SEGMENT_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(name)
        size += sizes[name]
    if len(chunks) <= 2:
        return None
    return [set(chunks[k]) | set(chunks[k + 1]) for k in range(len(chunks) - 1)]


def _window_model(probe: pb.ModelProto, constant: set[str], renamed: dict[str, str]) -> pb.ModelProto:
    """``probe`` with every stand-in not in ``constant`` as a graph input (``renamed``: the adopted probe's
    folded stand-ins, by the original's name)."""
    w = pb.ModelProto()
    w.CopyFrom(probe)
    g = w.graph
    inputs = {v.name for v in g.input}
    keep: list[pb.TensorProto] = []
    for t in g.initializer:
        if t.data_location != pb.TensorProto.EXTERNAL or renamed.get(t.name, t.name) in constant:
            keep.append(t)
            continue
        if t.name not in inputs:
            add_input_like(g, t)
    del g.initializer[:]
    g.initializer.extend(keep)
    return w


def add_input_like(graph: pb.GraphProto, t: pb.TensorProto) -> None:
    """A graph input of ``t``'s name, type and shape: the weight given to ORT as a value it cannot fold (a
    non-constant weight can only make ORT fuse less, never more)."""
    v = graph.input.add()
    v.name = t.name
    v.type.tensor_type.elem_type = t.data_type
    for d in t.dims:
        v.type.tensor_type.shape.dim.add().dim_value = d


def _reader_count(graph: pb.GraphProto, name: str) -> int:
    """Input slots of the graph's nodes that read ``name``, plus one when it is a graph output (ORT's output edges)."""
    return sum(i == name for n in graph.node for i in n.input) + any(o.name == name for o in graph.output)


def _runs_every_time(graph: pb.GraphProto, cast: pb.NodeProto) -> bool:
    """Whether ORT computes this Cast of a constant at every run rather than folding it into its reader:
    FuseInitializersTransformer (level ALL) turns ``Cast(fp16 initializer)`` into an fp32 initializer only where the
    Cast has exactly one reader and is no graph output; a weight or scalar read by several nodes stays fp16 behind
    a Cast that runs each time, so its readers (MatMul, Gemm) take a computed tensor, not a constant (no
    pre-packing, other kernels and roundings)."""
    return _reader_count(graph, cast.output[0]) != 1 or any(o.name == cast.output[0] for o in graph.output)


def keep_casts_at_run(graph: pb.GraphProto, casts: Sequence[pb.NodeProto] | None = None) -> int:
    """Make the initializers that ``casts`` (default: every Cast of an initializer) read overridable graph inputs,
    so that ORT's constant folding leaves those Casts to run at every run, as the original ran them (a constant
    fed by a Cast in the file would be folded when a session loads it). An overridable initializer is still an
    initializer: mapped from the blob, shared, and not listed among the session's inputs. Returns how many."""
    inits = {t.name: t for t in graph.initializer}
    inputs = {v.name for v in graph.input}
    chosen = casts if casts is not None else [n for n in graph.node if n.op_type == "Cast" and n.input]
    made = 0
    for n in chosen:
        t = inits.get(n.input[0])
        if t is not None and t.name not in inputs:
            add_input_like(graph, t)
            inputs.add(t.name)
            made += 1
    return made


# Kernels whose weight input, when it is a constant, ORT pre-packs or reads once at session creation (other
# code paths, other roundings); an elementwise op computes the same bits from a constant and from a computed input.
CONSTANT_SENSITIVE = frozenset(
    {"MatMul", "Gemm", "Conv", "ConvTranspose", "FusedMatMul", "FusedGemm", "FusedConv", "LSTM", "GRU", "RNN",
     "Attention", "MultiHeadAttention", "DynamicQuantizeMatMul", "MatMulInteger", "MatMulNBits", "QLinearConv",
     "QLinearMatMul", "MatMulIntegerToFloat", "QAttention", "DynamicQuantizeLSTM", "NhwcFusedConv", "Einsum"}
)  # fmt: skip


def _sensitive_inputs(graph: pb.GraphProto) -> set[str]:
    """What the graph's ``CONSTANT_SENSITIVE`` nodes read."""
    return {i for n in graph.node if n.op_type in CONSTANT_SENSITIVE for i in n.input}


def _casts_of_initializers(graph: pb.GraphProto) -> int:
    """Casts of an initializer that feed a kernel for which a constant input differs (``CONSTANT_SENSITIVE``):
    ORT runs them at every run, and the kernel takes a computed tensor."""
    inits = {t.name for t in graph.initializer}
    sensitive = _sensitive_inputs(graph)
    return sum(
        1 for n in graph.node if n.op_type == "Cast" and n.input and n.input[0] in inits and n.output[0] in sensitive
    )


def check_rounding(
    original: pb.ModelProto,
    adopted: pb.ModelProto,
    refs: Sequence[TensorRef],
    src: Path,
    stage_in: Path | None,
    options: ConvertOptions,
    ours: dict[tuple[str, str], int] | None = None,
) -> str | None:
    """Optimize both probes at ORT's default level in one bounded child; ``rounding_change`` of the results
    (window by window, ``_windows``, on large models)."""
    import tempfile

    input_bytes = src.stat().st_size + sum(r.native_nbytes for r in refs)
    limits = limits_for(
        input_bytes, src, options.ort_child_timeout_s, options.ort_child_memory_mib, options.ort_max_growth
    )
    where = locked_stage(stage_in, "ortcpu-check") if stage_in is not None else tempfile.TemporaryDirectory(prefix=TMP)
    with where as tmp_name:
        tmp = Path(tmp_name).absolute()
        probes: list[pb.ModelProto] = []
        inserted = {_tag(k) for k, n in enumerate(adopted.graph.node) if _is_inserted(n)}
        renamed: dict[str, str] = {}
        for name, model in (("original", original), ("adopted", adopted)):
            d = tmp / name
            d.mkdir()
            probe = write_probe_model(model, refs, d)
            if name == "adopted":
                renamed = _prefold(probe, d / ZEROS, inserted)
            probes.append(load_model(probe))
        windows = _windows(probes[0])
        pairs = [(probes[0], probes[1])]
        if windows is not None:
            pairs = [(_window_model(probes[0], w, {}), _window_model(probes[1], w, renamed)) for w in windows]
        given = [_defined(pair[0].graph) for pair in pairs]  # what ORT computes itself is named otherwise
        args = []
        for k, pair in enumerate(pairs):
            for name, model in zip(("original", "adopted"), pair, strict=True):
                path = tmp / name / f"window{k}.onnx"
                path.write_bytes(model.SerializeToString())
                args += [str(path), str(path.with_suffix(".optimized.onnx"))]
        count = len(pairs)
        del probes, pairs
        if options.stage is not None:
            what = f"{count} windows of " if count > 1 else ""
            options.stage(f"onnxruntime optimizes {what}the original and the adopted graph (child process)")
        # the saved graphs hold what ORT folded (the original's fp16 weights cast, inline): read and removed a pair
        # at a time from a memory-backed scratch, they are never written to disk
        with memory_scratch(tmp, SCRATCH_HOLD * input_bytes // count) as scratch:
            if scratch:  # each role's directory again in the scratch, its zeros file (a hole) beside the graphs
                for role in ("original", "adopted"):
                    (tmp / scratch / role).mkdir()
                    os.truncate(_create(tmp / scratch / role / ZEROS), (tmp / role / ZEROS).stat().st_size)
                args[1::2] = [str(tmp / scratch / Path(a).relative_to(tmp)) for a in args[1::2]]
            outs = [Path(a) for a in args[1::2]]

            def compare(k: int) -> str | None:
                if k % 2 == 0:
                    return None
                before = _saved_graph(outs[k - 1], src)
                after = _saved_graph(outs[k], src)
                outs[k - 1].unlink()
                outs[k].unlink()
                return fp16_folded(before, given[k // 2]) or rounding_change(before, after, ours)

            try:
                return _run_stepped(args, outs, limits, tmp, src, compare)
            except InvalidModel as e:
                if "adopted: " not in e.message:
                    raise
                why = e.message.split("adopted: ", 1)[1]
                return f"onnxruntime cannot optimize the graph with the Casts in the file: {why}"


def fp16_folded(original: pb.GraphProto, given: set[str]) -> str | None:
    """A fusion that computed new constants from the original's fp16 ones (Conv+BatchNormalization: the folded
    weight and bias, in fp16, then cast). With the Casts in the file the same fusion computes them in fp32, and the
    op counts are equal while the numbers are not (0.002 on a Conv+BN model), so such a graph is refused too.

    Which initializers of the optimized graph ORT computed is structural: those under a name the graph ORT was
    given (``given``: its inputs, initializers and node outputs) does not have. What ORT computed them from is
    only in their names (``names``): ``FusedBack_X`` is the Cast of X folded, harmless where X is a tensor of the
    given graph (or of a function body ORT inlined), a fusion's fp16 product otherwise (``FusedBack_ConvBnFusion_...``);
    NCHWc reorders and inlined functions' constants keep their own prefixes. A floating-point tensor ORT computed
    under any other name is refused: an ORT that names them otherwise cannot be told apart from a fusion."""
    floating = (dtypes.FLOAT, dtypes.FLOAT16, dtypes.BFLOAT16, dtypes.DOUBLE)
    for t in original.initializer:
        if t.name in given or t.data_type not in floating or t.name.startswith(KNOWN_COMPUTED):
            continue
        rest = t.name.removeprefix(FUSED_BACK) if t.name.startswith(FUSED_BACK) else None
        if rest is not None and (rest in given or rest.startswith(INLINED_FUNCTION)):
            continue  # a Cast of a constant the graph had, folded
        if rest is not None and "Fusion" in rest:
            fusion = next((p for p in rest.split("_") if p.endswith("Fusion")), "a fusion")
            return (
                f"{fusion} folds its constants in fp32 where it folded them in fp16 in the original, e.g. {rest[:60]}"
            )
        return (
            f"onnxruntime computed a constant of the original under a name weightshare does not know ({t.name[:60]!r};"
            f" names checked on onnxruntime {CHECKED_ON}, ort/names.py), so whether a fusion folded it in fp16 cannot "
            "be told"
        )
    return None


def _rename_fresh(fresh: list[pb.NodeProto], taken: set[str]) -> None:
    """Give the nodes ORT made names no other node has (ORT named them unique among the probe's tags, not
    among the user's names), without the probe's tag."""
    for node in fresh:
        if not node.name:
            continue
        base = node.name.replace(TAG, "node")
        name, k = base, 0
        while name in taken:
            k += 1
            name = f"{base}_{k}"
        node.name = name
        taken.add(name)


class NotAdoptable(Exception):
    """The probe graph cannot be mapped onto the skeleton; the model is left as it is."""


def _strip(name: str) -> str:
    return name.removeprefix(PREFIX)


def _defined(graph: pb.GraphProto) -> set[str]:
    names = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    names |= {sp.values.name for sp in graph.sparse_initializer}
    names |= {o for n in graph.node for o in n.output}
    return names | {""}


def _has_payload(node: pb.NodeProto) -> bool:
    tensors = [t for a in node.attribute for t in ([a.t] if a.HasField("t") else []) + list(a.tensors)]
    return any(e.key == REF_KEY for t in tensors for e in t.external_data) or any(
        a.HasField("sparse_tensor") or a.sparse_tensors for a in node.attribute
    )


def _copy(node: pb.NodeProto) -> pb.NodeProto:
    new = pb.NodeProto()
    new.CopyFrom(node)
    return new


def adopt_inserted_casts(model: pb.ModelProto, probe: pb.GraphProto, opsets: dict[str, int] | None = None) -> int:
    """Rewrite ``model``'s main graph into the probe's (inserted Casts, fp32 outputs). Returns Casts added.

    Nodes are matched by identity: the probe named each of the skeleton's nodes by its index (``_tag``), and ORT
    keeps node names; never by a tensor name, which a user's tensor can take (``InsertedPrecisionFreeCast_X``
    beside ``X``). Probe nodes without a match (inserted Casts, bodies of function ops ORT expanded) are copied
    in under names no other node has. Raises
    NotAdoptable (``model`` untouched) when the result would not be a sound graph.
    """
    g = model.graph
    if not any(_is_inserted(p) for p in probe.node):
        return 0  # nothing to do: leave the graph exactly as it was
    if model.functions or any(True for n in g.node for _ in subgraphs(n)):
        raise NotAdoptable("the model has local functions or subgraphs (ORT inlines or rewrites them)")
    if [v.name for v in g.input] != [v.name for v in probe.input] or [v.name for v in g.output] != [
        v.name for v in probe.output
    ]:
        raise NotAdoptable("onnxruntime changed the graph inputs or outputs")
    ours = list(g.node)
    probe_inits = {t.name for t in probe.initializer}
    new_nodes: list[pb.NodeProto] = []
    fresh: list[pb.NodeProto] = []  # nodes ORT made: their names must not clash with the user's
    matched: set[int] = set()
    added = 0
    for p in probe.node:
        index = _tag_index(p.name, len(ours))
        if index is None or index in matched or (ours[index].op_type, ours[index].domain) != (p.op_type, p.domain):
            # A Cast ORT inserted, or a node of a function body ORT expanded for want of an fp16 kernel.
            fresh.append(_copy(p))
            new_nodes.append(fresh[-1])
            added += _is_inserted(p)
            continue
        node = _copy(ours[index])  # keeps its name, attributes and payload markers; takes ORT's wiring
        node.input[:] = p.input
        node.output[:] = p.output
        new_nodes.append(node)
        matched.add(index)
    matched_ids = {id(ours[i]) for i in matched}
    # ORT turns Constant nodes into initializers; keep ours (they carry the payload markers), in front.
    constants = [
        n
        for n in g.node
        if id(n) not in matched_ids and n.op_type == "Constant" and all(o in probe_inits for o in n.output)
    ]
    dropped = [n for n in g.node if id(n) not in matched_ids and not any(n is c for c in constants)]
    if any(_has_payload(n) for n in dropped):
        raise NotAdoptable("onnxruntime replaced a node that holds a payload")
    new_nodes = [_copy(c) for c in constants] + new_nodes
    _rename_fresh(fresh, {n.name for n in new_nodes if n.name and not any(n is f for f in fresh)})
    # Constants of expanded function bodies, which ORT made initializers: small, with their bytes inline.
    known = {t.name for t in g.initializer} | {o for c in constants for o in c.output}
    new_inits = [t for t in probe.initializer if t.name not in known]
    if any(t.data_location == pb.TensorProto.EXTERNAL for t in new_inits):
        raise NotAdoptable("onnxruntime added an initializer backed by the probe's stand-in data")
    check = pb.GraphProto()
    check.CopyFrom(g)
    del check.node[:]
    check.node.extend(new_nodes)
    check.initializer.extend(new_inits)
    defined = _defined(check)
    missing = next((i for n in new_nodes for i in n.input if i not in defined), None)
    if missing is not None:
        raise NotAdoptable(f"value {missing!r} is used but not defined after adoption")
    have = {o.domain for o in model.opset_import}
    for domain, version in (opsets or {}).items():
        if domain not in have:
            model.opset_import.add(domain=domain, version=version)
    del g.node[:]
    g.node.extend(new_nodes)
    g.initializer.extend(new_inits)
    produced = {o for n in new_nodes for o in n.output}
    del g.value_info[:]
    g.value_info.extend(v for v in probe.value_info if v.name in produced)
    return added


def ort_cpu_cast_bytes(model_path: Path) -> tuple[int, int]:
    """(initializers, fp32 bytes) that ORT's CPU provider casts fp16 -> float into a private copy per session.

    Runs the probe (onnxruntime in a child process); raises UsageError without onnxruntime, InvalidModel when
    ORT cannot load the model.
    """
    from ..convert import load_skeleton
    from ..scan import scan_model

    skeleton, refs = scan_model(model_path)
    model = load_skeleton(skeleton, model_path)
    return _cast_bytes(model, refs, run_probe(model, refs, model_path))


def _cast_bytes(model: pb.ModelProto, refs: Sequence[TensorRef], probe: Probe) -> tuple[int, int]:
    by_index = {r.index: r for r in refs}
    dims = {site.name: by_index[i].dims for i, site in collect_sites(model).items() if site.kind == "initializer"}
    names = probe.cast_initializers()
    return len(names), sum(dtypes.element_count(dims[n]) * 4 for n in names if n in dims)


def unpack_for_cpu(
    model: pb.ModelProto,
    refs: Sequence[TensorRef],
    src: Path,
    notes: list[str],
    out_dir: Path | None = None,
    options: ConvertOptions | None = None,
) -> dict[str, str]:
    """The ``prepare`` hook: adopt ORT CPU's Casts into ``model``. Returns metadata for the blob header.
    The probe stages inside ``out_dir`` (locked) and runs under ``options``' child limits."""
    opts = options or ConvertOptions()
    probe = run_probe(model, refs, src, out_dir, opts)
    original = pb.ModelProto()
    original.CopyFrom(model)
    try:
        added = adopt_inserted_casts(model, probe.graph, probe.opsets)
    except NotAdoptable as e:
        notes.append(f"--unpack ort-cpu: left as it is: {e}")
        return {}
    if not added:
        notes.append(f"--unpack ort-cpu: onnxruntime {probe.version} CPU inserts no Cast in this model")
        return {}
    g = model.graph
    # a weight read by several MatMul/Gemm/Conv stays behind its Cast (a constant there is pre-packed: other
    # kernels); a scalar's Cast folds as before (ORT fused its readers in the fp16 graph: SimplifiedLayerNorm's eps)
    sensitive = _sensitive_inputs(g)
    at_run = keep_casts_at_run(
        g, [n for n in g.node if _is_inserted(n) and _runs_every_time(g, n) and n.output[0] in sensitive]
    )
    change = check_rounding(original, model, refs, src, out_dir, opts)
    unfused = 0
    if change is not None and change.startswith(SCALE_FUSION):
        from .unfuse import unfuse_scales

        # The scale ORT multiplied separately in the fp16 graph, kept separate (``unfuse``, ``reload``); checked again.
        unfused = unfuse_scales(model)
        ours = {("ai.onnx", "Shape"): unfused, ("ai.onnx", "Expand"): unfused}
        change = check_rounding(original, model, refs, src, out_dir, opts, ours) if unfused else change
    if change is not None:
        raise Unsupported(
            f"--unpack ort-cpu: refused: with the Casts in the file onnxruntime {probe.version} CPU would not compute "
            f"what it computes on the fp16 graph ({change}); convert without --unpack ort-cpu (--prepack alone is "
            "exact)",
            src,
        )
    del original
    on_weights = len(probe.cast_initializers())
    notes.append(
        f"--unpack ort-cpu: adopted {added} Cast(s) onnxruntime {probe.version} CPU inserts per session "
        f"({on_weights} on initializers, stored as fp32 where a Cast is their only consumer"
        + (
            f"; {at_run} read by several nodes stay fp16 behind a Cast that runs every time, as onnxruntime runs "
            "them in the original"
            if at_run
            else ""
        )
        + (
            f"; {unfused} Mul/Div by a scalar beside a MatMul fed Expand(scalar, Shape(x)), the same products, "
            "so that onnxruntime does not fuse them as it did not in the fp16 graph"
            if unfused
            else ""
        )
        + "); "
        "CPU-specific: a GPU provider would have run the fp16 graph natively "
        f"(probe child peak RSS {probe.child_peak_rss_mib:.0f} MiB)"
    )
    return {"weightshare.unpack": "ort-cpu", "weightshare.onnxruntime": probe.version}


def _probe_key(model: pb.ModelProto, refs: Sequence[TensorRef], version: str) -> str | None:
    """``casts_cache``'s key of the probe ``run_probe`` would give ORT, or None when it cannot be written (the probe
    then says why)."""
    import tempfile

    from . import casts_cache

    try:
        with tempfile.TemporaryDirectory(prefix=TMP) as tmp:
            probe = write_probe_model(model, refs, Path(tmp))
            return casts_cache.key_of(probe.read_bytes(), (Path(tmp) / ZEROS).stat().st_size, version)
    except (InvalidModel, OSError):
        return None


def inventory_notes(model: pb.ModelProto, refs: Sequence[TensorRef], folded: set[int], src: Path) -> list[str]:
    """For ``inspect``/``check``: what ORT's CPU provider casts per session, and the flag that makes it once.

    Runs the probe only for models with fp16/bf16 payloads that no explicit Cast fold covers, and only when
    onnxruntime is installed; ``model`` must be the skeleton before any fold.
    """
    from . import casts_cache

    half = [r for r in refs if r.data_type in (dtypes.FLOAT16, dtypes.BFLOAT16) and r.index not in folded]
    version = onnxruntime_version()
    if not half or version is None:
        return []
    key = _probe_key(model, refs, version)  # ORT's answer for this very probe, kept from an earlier run
    kept = casts_cache.recall(key) if key else None
    if kept is not None:
        return kept
    try:
        probe = run_probe(model, refs, src)
    except (InvalidModel, Unsupported) as e:
        return [f"could not ask onnxruntime which Casts its CPU provider inserts: {e.message}"]
    n, nbytes = _cast_bytes(model, refs, probe)
    notes = [
        f"onnxruntime {probe.version} (CPU provider) casts {n} fp16 initializers to a private fp32 copy "
        f"per session ({nbytes / (1 << 20):.1f} MiB); `weightshare convert --unpack ort-cpu` makes that copy "
        "once, in the blob (CPU-specific)"
    ][: 1 if n else 0]
    if key and probe.version == version:
        casts_cache.remember(key, notes)
    return notes
