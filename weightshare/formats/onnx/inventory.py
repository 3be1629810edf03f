"""ONNX inventory: the scan and the plan of `convert`, reported instead of executed.

ONNX Runtime copies every embedded initializer into its own heap tensor per
session, constant-folds Cast(fp16 -> float) of an initializer into a new fp32
heap tensor per session, and decodes typed fields; external data at an offset it
can map is shared.

What ONNX Runtime 1.32 copies per session beyond that depends on the session
settings; the rules below were measured (PSS of 1 vs 3 sessions, x86-64 AVX2,
tests/test_tools_runtime_copies.py keeps them honest):
- default options: MLAS pre-packs every constant fp32 MatMul/Gemm B (rank 2) into a
  private buffer per session; ``session.disable_prepacking=1`` avoids it, and so do
  ``prepacked_*`` external-data entries (ORT maps the packed copy from the file);
- at ORT_ENABLE_ALL (the default level) the NCHWc transformer reorders every 2-D Conv
  weight whose output channels are a multiple of the NCHWc block (8 on AVX2, 16 on
  AVX-512) into a new initializer per session, with or without disable_prepacking:
  each session grows by twice the weight's bytes; ORT_ENABLE_EXTENDED avoids it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..._findings import Code, Finding, problem_code
from ..._inventory import ModelInventory, PayloadInfo, alignment_of, payload_digest
from ..._paths import external_data_roots, model_dir
from ..._recorded import blob_metadata, recorded_names, recorded_payloads
from ..._tensors import FileRange
from ...errors import UnsafePath, WeightshareError
from ...options import ConvertOptions
from . import dtypes
from ._proto import pb
from .convert import load_skeleton, plan
from .findings import OnnxCode
from .fold import LOAD_READ_INPUTS, fold_fp16_casts, shape_tensor_names
from .graph import Site, collect_sites
from .ort.cpu import inventory_notes
from .ort.prepack_record import METADATA_KEY as PREPACK_KEY
from .ort.prepack_record import PACKED_PREFIX, parse_record
from .ort.probe import packed_buffers, packed_bytes
from .scan import Scanner, TensorRef
from .wire import WireFile

DTYPE_NAMES = {v: k for k, v in pb.TensorProto.DataType.items()}

# stable setting ids (docs/ci.md)
ORT_SHARE = "ort-disable-prepacking"  # session.disable_prepacking=1: the setting weightshare's sharing relies on
ORT_DEFAULT = "ort-default"  # default session options (a --prepack model maps its packed copies here)
NCHWC_BLOCK = 8  # the smallest NCHWc block (AVX2); AVX-512 machines use 16 and reorder fewer Convs


class _LenientScanner(Scanner):
    """Records a broken external reference as a finding instead of stopping the whole inspection."""

    def __init__(self, wf: WireFile, model_dir: Path, roots: tuple[Path, ...] | None = None) -> None:
        super().__init__(wf, model_dir, roots=roots)
        self.problems: dict[int, tuple[str, str, str]] = {}  # ref index -> (location, problem, code)
        self.prepacked: set[int] = set()  # refs whose external data carries ORT's pre-packed copy (--prepack)
        self.packed_entries: dict[int, list[str]] = {}  # ref index -> its prepacked_N entry values

    def _external_range(self, name: str, info: dict[str, str], expected: int) -> FileRange:
        if any(key.startswith("prepacked") for key in info):
            self.prepacked.add(len(self.refs))
            self.packed_entries[len(self.refs)] = [v for k, v in sorted(info.items()) if k.startswith("prepacked")]
        try:
            return super()._external_range(name, info, expected)
        except WeightshareError as e:
            location = info.get("location", "")
            # never stat a name that failed the containment check
            exists = not isinstance(e, UnsafePath) and bool(location) and (self.model_dir / location).is_file()
            self.problems[len(self.refs)] = (location, e.message, problem_code(e, exists).value)
            return FileRange(self.wf.path, 0, 0)


def _uses(scope: pb.GraphProto | pb.FunctionProto) -> dict[str, list[tuple[pb.NodeProto, int]]]:
    """value name -> [(node, input position)] in one scope."""
    uses: dict[str, list[tuple[pb.NodeProto, int]]] = {}
    for node in scope.node:
        for i, name in enumerate(node.input):
            uses.setdefault(name, []).append((node, i))
    return uses


def _attr(node: pb.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _nchwc_reordered(node: pb.NodeProto, dims: list[int]) -> bool:
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(dims) != 4 or dims[0] % NCHWC_BLOCK:
        return False
    group = _attr(node, "group", 1)
    return group == 1 or (group == dims[0] and dims[1] == 1)  # plain or depthwise: NCHWc has kernels for both


def _ort_copies(site: Site, uses: list[tuple[pb.NodeProto, int]], packed: bool) -> tuple[int, int, str, str]:
    """(bytes copied under every setting, extra bytes at default options only, why, finding code) of a constant."""
    t = site.tensor
    if t.data_type != dtypes.FLOAT:
        return 0, 0, "", ""
    dims = list(t.dims)
    nbytes = 4 * math.prod(dims)
    if any(_nchwc_reordered(node, dims) for node, i in uses if i == 1):
        # measured: each session grows by twice the weight (the reordered initializer, and the tensor made of it)
        return (
            2 * nbytes,
            0,
            "Conv weights reordered to NCHWc per session at ORT_ENABLE_ALL",
            OnnxCode.ORT_NCHWC_COPY.value,
        )
    # with --prepack's packed copy in the file (``packed``), ORT maps it instead of packing per session
    if (
        not packed
        and len(dims) == 2
        and any(node.op_type in ("MatMul", "Gemm") and node.domain in ("", "ai.onnx") and i == 1 for node, i in uses)
    ):
        return (
            0,
            nbytes,
            "MatMul/Gemm B pre-packed by MLAS per session at default options",
            OnnxCode.ORT_PREPACK_COPY.value,
        )
    return 0, 0, "", ""


# (op_type, input index) pairs whose initializer ONNX shape inference parses when onnxruntime loads the graph
# (checked one op at a time: an external tensor there is refused, "Cannot parse data from external tensors").
# A narrower table than ``fold.LOAD_READ_INPUTS``, which the converter keeps inline for safety: Range or CumSum
# with an external constant load (their inference reads the data only when every input is constant, or never).
REFUSED_EXTERNAL = {
    "Reshape": {1},
    "Expand": {1},
    "Tile": {1},
    "Unsqueeze": {1},
    "Squeeze": {1},
    "Pad": {1},
    "Resize": {2, 3},
    "Upsample": {1},
    "Split": {1},
    **{f"Reduce{r}": {1} for r in ("Sum", "Mean", "Max", "Min", "Prod", "L1", "L2", "LogSum", "LogSumExp")},
    "ReduceSumSquare": {1},
}
SLICE_BOUNDS = (1, 2)  # Slice's starts and ends: parsed (with axes and steps) when both are initializers


def load_read_findings(refs: Sequence[TensorRef], sites: Mapping[int, Site], path: Path) -> list[Finding]:
    """``runtime-refuses-model`` for each external initializer ONNX shape inference reads at load in its own graph
    (a graph input of that name is overridable: not read), one per tensor."""
    external: dict[int, set[str]] = {}
    scopes: dict[int, pb.GraphProto] = {}
    for ref in refs:
        site = sites.get(ref.index)
        if ref.field == 0 and site is not None and site.kind == "initializer" and isinstance(site.scope, pb.GraphProto):
            external.setdefault(id(site.scope), set()).add(site.name)
            scopes[id(site.scope)] = site.scope
    findings: list[Finding] = []
    for key, names in external.items():
        scope = scopes[key]
        names -= {i.name for i in scope.input}
        # ORT makes Constant nodes initializers before it infers shapes
        made = {o for n in scope.node if n.op_type == "Constant" for o in n.output}
        constant = names | made | {t.name for t in scope.initializer} - {i.name for i in scope.input}
        flagged: set[str] = set()
        for node in scope.node:
            if node.domain not in ("", "ai.onnx"):
                continue
            read = REFUSED_EXTERNAL.get(node.op_type, set())
            if node.op_type == "Slice" and all(k < len(node.input) and node.input[k] in constant for k in SLICE_BOUNDS):
                read = {1, 2, 3, 4}
            for k in sorted(read):
                name = node.input[k] if k < len(node.input) else ""
                if name in names and name not in flagged:
                    flagged.add(name)
                    findings.append(
                        Finding.of(
                            Code.RUNTIME_REFUSES_MODEL,
                            str(path),
                            f"{name!r} ({node.op_type} input {k}) is in external data, and onnxruntime's shape "
                            "inference reads it when it loads the model: it refuses the model (Cannot parse data "
                            "from external tensors); keep it inline (weightshare convert does)",
                            name,
                        )
                    )
    return findings


def inventory_file(path: Path, hash_payloads: bool = True) -> ModelInventory:
    inv = ModelInventory(model=str(path), format="onnx", file_bytes=path.stat().st_size)
    with WireFile(path) as wf:
        scanner = _LenientScanner(wf, model_dir(path), external_data_roots(path))
        skeleton = scanner.scan()
    refs: Sequence[TensorRef] = scanner.refs
    model = load_skeleton(skeleton, path)
    sites = collect_sites(model)
    names = {i: site.name for i, site in sites.items()}  # before folding renames them
    inv.findings += load_read_findings(refs, sites, path)
    pristine = pb.ModelProto()
    pristine.CopyFrom(model)  # the probe needs the graph before the fold below rewrites it
    folded, _ = fold_fp16_casts(model, sites)  # on this private copy: tells which Casts ORT would fold per session
    inv.notes += inventory_notes(pristine, refs, folded, path)
    shapes = shape_tensor_names(model)
    placements = plan(refs, sites, folded, shape_tensor_names(model, LOAD_READ_INPUTS), ConvertOptions())
    external_files = set()
    inv.settings = [ORT_SHARE, ORT_DEFAULT]
    uses_by_scope: dict[int, dict[str, list[tuple[pb.NodeProto, int]]]] = {}
    to_hash = []
    for p in placements:
        ref = p.ref
        info = PayloadInfo(
            name=names[ref.index],
            dtype=DTYPE_NAMES.get(ref.data_type, str(ref.data_type)),
            shape=ref.dims,
            nbytes=ref.nbytes_in,
            location="embedded",
        )
        if ref.field == 0:
            info.location = "external"
            location, problem, code = scanner.problems.get(ref.index, ("", "", ""))
            if problem:
                info.file, info.problem, info.nbytes = location, problem, ref.native_nbytes
                info.problem_code = code
            else:
                part = ref.parts[0]
                info.file = os.path.relpath(part.path, model_dir(path))
                info.offset = part.offset
                info.alignment = alignment_of(part.offset)
                external_files.add(info.file)
        else:
            info.offset = ref.parts[0].offset if ref.parts else None
            info.encoding = "raw_data" if ref.field == dtypes.RAW_DATA else dtypes.TYPED_FIELDS[ref.field]
            info.copied_per_session = ref.native_nbytes
        if p.fold:
            info.unpacked_at_load = f"Cast {info.dtype.lower()}->float folded per session"
            info.copied_per_session = ref.native_nbytes * 2  # the fp32 copy (plus the embedded one, if any)
            if ref.field != 0:
                info.copied_per_session += ref.native_nbytes
        site = sites.get(ref.index)
        if site is not None and site.kind in ("initializer", "constant"):
            key = id(site.scope)
            if key not in uses_by_scope:
                uses_by_scope[key] = _uses(site.scope)
            always, default_only, info.copy_reason, info.copy_code = _ort_copies(
                site, uses_by_scope[key].get(site.name, []), ref.index in scanner.prepacked
            )
            info.copied_per_session += always
            if info.copy_code:
                info.copy_bytes = {ORT_SHARE: always, ORT_DEFAULT: always + default_only}
            info.copies = {ORT_SHARE: info.copied_per_session, ORT_DEFAULT: info.copied_per_session + default_only}
        info.would_move = p.external and (ref.field != 0 or p.fold)
        info.stays_inline_because = p.reason
        info.used_as_shape = info.name in shapes
        if hash_payloads and not info.problem:
            to_hash.append((info, ref.parts[0] if len(ref.parts) == 1 else ref.native_source()))
        inv.payloads.append(info)
    inv.external_files = sorted(external_files)
    sums = {name: recorded_payloads(str(model_dir(path) / name)) for name in external_files}
    for info in inv.payloads:
        if info.location == "external" and info.file in sums and info.offset is not None:
            info.recorded_sha256 = sums[info.file].get((info.offset, info.nbytes), "")
    for info, source in to_hash:  # in the recorded digest's kind (BLAKE3 or SHA-256), so that the two compare
        info.sha256 = payload_digest(source, info.recorded_sha256)
    inv.fallback_of, bad_records = _fallback_of(path, inv.external_files)
    inv.findings += bad_records
    inv.default_setting, inv.default_how = default_setting(path, inv.fallback_of)
    inv.prepack_output = _is_prepack_output(path, inv.external_files)
    by_index = {ref.index: info for ref, info in zip((p.ref for p in placements), inv.payloads)}
    if inv.prepack_output and not inv.fallback_of:
        own = [(by_index[i].file, v) for i, values in scanner.packed_entries.items() if i in by_index for v in values]
        inv.packed_for, inv.runtime_here = _envelope(path, inv.external_files, packed_bytes(own))
    inv.findings += packed_entry_findings(inv, scanner.packed_entries, by_index, model_dir(path))
    return inv


GENAI_CONFIG_MAX = 1 << 20  # bytes of genai_config.json read (the model builder writes a few KiB)


def _genai_config_entries(path: Path) -> dict[str, str] | None:
    """The session config entries ``genai_config.json`` beside ``path`` gives the component that opens it (the one
    whose ``filename`` is the model's, else the decoder's); None outside a genai folder or when it is unreadable."""
    import json

    try:
        with open(path.parent / "genai_config.json", "rb") as f:
            config = json.loads(f.read(GENAI_CONFIG_MAX + 1)[:GENAI_CONFIG_MAX])
    except (OSError, ValueError):
        return None
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        return None
    parts = [v for v in model.values() if isinstance(v, dict)]
    part = next((v for v in parts if v.get("filename") == path.name), model.get("decoder"))
    options = part.get("session_options") if isinstance(part, dict) else None
    entries = options.get("config_entries") if isinstance(options, dict) else None
    return {str(k): str(v) for k, v in entries.items()} if isinstance(entries, dict) else {}


def default_setting(path: Path, fallback_of: str) -> tuple[str, str]:
    """(the setting a model is opened with when the user does nothing, how): a plain ``InferenceSession(path)``
    has default options, pre-packing on (a ``--prepack`` output included: it maps its packed copies there); a
    genai folder's model is opened by ``og.Model`` with the session options its genai_config.json gives; a
    ``--prepack`` output's portable twin is what ``weightshare.ort.session`` opens outside the packed model's
    envelope, at the caller's options (pre-packing on: the original's outputs)."""
    if fallback_of:
        return (
            ORT_DEFAULT,
            "as weightshare.ort.session opens this portable model (the caller's options, pre-packing on)",
        )
    entries = _genai_config_entries(path)
    if entries is None:
        return ORT_DEFAULT, ""
    if entries.get("session.disable_prepacking") == "1":
        return ORT_SHARE, "as og.Model opens it (genai_config.json sets session.disable_prepacking=1)"
    return ORT_DEFAULT, "as og.Model opens it (the session options genai_config.json gives)"


def _is_prepack_output(path: Path, files: list[str]) -> bool:
    """Whether a blob of ``path`` records it as the pre-packed model of a ``convert --prepack`` output."""
    for name in files:
        raw = blob_metadata(str(path.resolve().parent / name)).get(PREPACK_KEY)
        if raw is None:
            continue
        try:
            record = parse_record(raw, name)
        except WeightshareError:
            continue  # _fallback_of reports it
        if path.name == record["prepacked_model"] or path.name in record["portable_models"]:
            return True
    return False


def _envelope(path: Path, files: list[str], packed: int) -> tuple[dict[str, str], dict[str, str]]:
    """The onnxruntime version and CPU kind the packed model was made for (its blob's record), with ``packed``,
    the bytes of the packed copies its own ``prepacked_N`` entries map (``probe.packed_bytes``; not the blob's
    ``ort.prepacked/`` names: a zoo's blob holds every model's, named after the model that packed them first);
    and this machine's (the onnxruntime installed, read from its metadata: no import)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from .ort.probe import cpu_features, cpu_kind

    for name in files:
        raw = blob_metadata(str(model_dir(path) / name)).get(PREPACK_KEY)
        if raw is None:
            continue
        try:
            record = parse_record(raw, name)
        except WeightshareError:
            continue
        made = {
            "runtime": "onnxruntime",
            "version": str(record["onnxruntime"]),
            "cpu_kind": str(record.get("cpu_kind") or cpu_kind(record["cpu_features"], record["machine"])),
            "packed_bytes": str(packed),
        }
        try:
            here = {
                "runtime": "onnxruntime",
                "version": version("onnxruntime"),
                "cpu_kind": cpu_kind(cpu_features(), platform.machine()),
            }
        except PackageNotFoundError:
            here = {}
        return made, here
    return {}, {}


def _fallback_of(path: Path, files: list[str]) -> tuple[str, list[Finding]]:
    """The prepacked model whose blob names ``path`` as its portable model (``convert --prepack``), or "";
    and a finding for each blob whose record ``weightshare.ort.session`` would refuse (the same validation,
    ``prepack_record.parse_record``)."""
    fallback, findings = "", []
    for name in files:
        raw = blob_metadata(str(model_dir(path) / name)).get(PREPACK_KEY)
        if raw is None:
            continue
        try:
            record = parse_record(raw, name)
        except WeightshareError as e:
            findings.append(Finding.of(OnnxCode.BAD_PREPACK_RECORD, str(path), f"{name}: {e.message}"))
            continue
        if path.name in (record["portable_model"], *record["portable_models"].values()):
            twins = {v: k for k, v in record["portable_models"].items()}
            fallback = str(twins.get(path.name, record["prepacked_model"]))
    return fallback, findings


def packed_entry_findings(
    inv: ModelInventory, entries: dict[int, list[str]], by_index: dict[int, PayloadInfo], base: Path
) -> list[Finding]:
    """``prepacked_N`` entries that do not point at the packed copy ``convert --prepack`` recorded for their tensor.

    ``--prepack`` stores each packed buffer under ``ort.prepacked/<tensor>/<kernel key>/<i>`` with its digest, a
    zoo's (``--shared-blob``) under ``<model stem>/ort.prepacked/...``, the stem of the model that packed it first,
    the others' names as its aliases. An entry pointing elsewhere (another tensor's copy, a plain payload, a range
    of another length, past the end) maps bytes ORT refuses at load ("ValidatePrePackedWeights ... do not match")
    or, worse, bytes of another weight. Every entry into a blob weightshare wrote must be vouched for by its
    records, whatever its names are; files weightshare did not write carry no records: their entries are ORT's
    own, left to ORT.

    A packed copy is named after the payload it was packed from, with the prefix of the model that named it:
    ``A + "ort.prepacked/" + B`` is the copy of the payload named ``A + B``. Tied weights (two tensors with the
    same bytes, such as an embedding and its LM head, or two equal initializers) are stored once, and so is their
    packed copy, recorded under the first tensor's name: an entry of the second pointing at it is right (the bytes
    ORT validates are the same)."""
    bad: list[str] = []
    records: dict[str, dict[tuple[int, int], list[str]]] = {}
    # payloads whose plain bytes are one (the same place in the blob, or the same digest): tied weights
    same_bytes: dict[tuple[str, int | None, int] | tuple[str, int], list[PayloadInfo]] = {}
    for p in by_index.values():
        if p.file and not p.problem:
            same_bytes.setdefault((p.file, p.offset, p.nbytes), []).append(p)
        if p.sha256:
            same_bytes.setdefault((p.sha256, p.nbytes), []).append(p)

    def plain_names(info: PayloadInfo, recs: dict[tuple[int, int], list[str]]) -> set[str]:
        """Every name the blob or the model gives the plain bytes ``info``'s tensor reads."""
        tied = same_bytes.get((info.file, info.offset, info.nbytes), []) + (
            same_bytes.get((info.sha256, info.nbytes), []) if info.sha256 else []
        )
        names = {info.name}
        for t in [info, *tied]:
            names.add(t.name)
            if t.file == info.file and t.offset is not None:
                names.update(recs.get((t.offset, t.nbytes), []))
        return names

    def packed_from(name: str, key: str, i: int, plain: set[str]) -> bool:
        """Whether ``name`` is the blob's name of buffer ``i`` of ``key``'s packing of a payload named in ``plain``."""
        suffix = f"/{key}/{i}"
        if not name.endswith(suffix):
            return False
        at = name.find(PACKED_PREFIX)
        while at >= 0:
            if name[:at] + name[at + len(PACKED_PREFIX) : -len(suffix)] in plain:
                return True
            at = name.find(PACKED_PREFIX, at + 1)
        return False

    for index, values in sorted(entries.items()):
        info = by_index.get(index)
        if info is None or info.problem or not info.file:
            continue
        if info.file not in records:
            records[info.file] = recorded_names(str(base / info.file))
        recs = records[info.file]
        if not recs:
            continue
        plain = plain_names(info, recs)
        for value in values:
            key = value.split("|")[0]
            buffers = packed_buffers(value)
            if (
                not key
                or buffers is None
                or not all(
                    any(packed_from(n, key, i, plain) for n in recs.get(where, [])) for i, where in enumerate(buffers)
                )
            ):
                bad.append(f"{info.name!r} ({value[:80]})")
    if not bad:
        return []
    more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
    return [
        Finding.of(
            OnnxCode.BAD_PREPACKED_ENTRY,
            inv.model,
            f"pre-packed entry of tensor {bad[0]}{more} does not point at the packed copy recorded for it in the "
            "blob: onnxruntime refuses it at load or maps another weight's bytes",
            bad[0].split("'")[1] if "'" in bad[0] else "",
        )
    ]
