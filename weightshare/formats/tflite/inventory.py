"""TFLite inventory: the scan and the plan of `convert`, reported instead of executed.

The classic Interpreter memory-maps the model file, so buffer data, inline or
appended (``Buffer.offset``), is read in place and shared between interpreters;
inline data is only 16-byte aligned, though. What each interpreter copies is
what its kernels materialise: DEQUANTIZE of a constant fp16 tensor (a private
fp32 copy, twice the fp16 bytes) and DENSIFY of a constant sparse tensor (the
dense tensor). ExternalBuffer groups are loaded, and mapped, by CompiledModel only.

With LiteRT's default XNNPACK delegate each interpreter also packs the constant
weights of FULLY_CONNECTED / CONV_2D / DEPTHWISE_CONV_2D / TRANSPOSE_CONV into a
private copy, inline or not (measured: an 8 MiB fp32 FC weight adds 8 MiB PSS per
interpreter with XNNPACK, 0 without delegate, tests/test_tools_runtime_copies.py);
CompiledModel with an XNNPACK weight cache file maps the packed copy instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..._findings import CODES, Code, Finding, problem_code
from ..._inventory import ModelInventory, PayloadInfo, alignment_of, payload_digest
from ..._paths import resolve_inside
from ..._recorded import recorded_payloads
from ..._tensors import FileRange
from ...errors import UnsafePath, WeightshareError
from ...options import ConvertOptions
from . import flatbuf
from .dequantize import dequantized_copies
from .findings import TfliteCode
from .graph import (
    DENSIFY,
    DEQUANTIZE,
    TYPE_NAMES,
    builtin_code,
    element_count,
    indices,
    plan_fp16_folds,
    tensor_name,
    validate,
)
from .xnnpack_cache import inventory_notes

if TYPE_CHECKING:
    from ai_edge_litert import schema_py_generated as schema

_ITEMSIZE = {
    "FLOAT32": 4,
    "FLOAT16": 2,
    "INT8": 1,
    "UINT8": 1,
    "INT16": 2,
    "INT32": 4,
    "INT64": 8,
    "BOOL": 1,
    "FLOAT64": 8,
    "UINT16": 2,
    "UINT32": 4,
    "UINT64": 8,
    "BFLOAT16": 2,
}


# stable setting ids (docs/ci.md): the classic Interpreter without delegate, with the default XNNPACK delegate,
# and CompiledModel with an XNNPACK weight cache file
NO_DELEGATE, XNNPACK, XNNPACK_CACHE = "litert-builtin", "litert-xnnpack", "litert-compiled-cache"


def _packing_inputs() -> dict[int, tuple[int, ...]]:
    from ai_edge_litert import schema_py_generated as schema

    op = schema.BuiltinOperator
    return {op.FULLY_CONNECTED: (1, 2), op.CONV_2D: (1, 2), op.DEPTHWISE_CONV_2D: (1, 2), op.TRANSPOSE_CONV: (1, 3)}


def _xnnpack_packs(graph: schema.ModelT, sizes: list[int]) -> dict[int, int]:
    """buffer -> bytes XNNPACK packs per interpreter (fp16 behind DEQUANTIZE is packed as fp32: twice).

    Once per subgraph that packs it: the default delegate packs each signature's subgraph on its own (a
    prefill + decode LM over one copy of the weights costs two packed copies per interpreter, measured)."""
    packing, codes = _packing_inputs(), [builtin_code(c) for c in graph.operatorCodes or []]
    packs: dict[int, int] = {}
    for sg in graph.subgraphs:
        seen: dict[int, int] = {}  # this subgraph's packed buffers
        tensors = sg.tensors or []
        producer = {o: op for op in sg.operators or [] for o in indices(op.outputs)}
        for op in sg.operators or []:
            ins = indices(op.inputs)
            for pos in packing.get(codes[op.opcodeIndex], ()):
                if pos >= len(ins) or ins[pos] < 0:
                    continue
                t, fp32 = ins[pos], None
                src = producer.get(t)
                if src is not None and codes[src.opcodeIndex] == DEQUANTIZE and indices(src.inputs):
                    t = indices(src.inputs)[0]  # packed as fp32: 4 bytes per element of the fp16/int8/int4 input
                    fp32 = 4 * (element_count(tensors[t]) or 0) if 0 <= t < len(tensors) else 0
                buffer = tensors[t].buffer if t < len(tensors) else 0
                if buffer and buffer < len(sizes) and sizes[buffer]:
                    seen[buffer] = sizes[buffer] if fp32 is None else fp32
        for buffer, nbytes in seen.items():
            packs[buffer] = packs.get(buffer, 0) + nbytes
    return packs


def _first_tensors(graph: schema.ModelT) -> dict[int, schema.TensorT]:
    first: dict[int, schema.TensorT] = {}
    for sg in graph.subgraphs:
        for t in sg.tensors or []:
            if t.buffer and t.buffer not in first:
                first[t.buffer] = t
    return first


# What only an opt-in unpack stores once: (words in the copy's description, the --unpack value that does it).
_OPT_IN = (("DENSIFY", "sparse"), ("DEQUANTIZE INT", "dequantize"), ("DEQUANTIZE UINT", "dequantize"))


def _opt_in(what: str) -> str:
    return next((option for words, option in _OPT_IN if what.startswith(words)), "")


def _per_interpreter_copies(graph: schema.ModelT, sizes: list[int], path: str) -> dict[int, tuple[str, int]]:
    """buffer -> (what LiteRT materialises per interpreter, bytes)."""
    copies: dict[int, tuple[str, int]] = dequantized_copies(graph, sizes)
    folds, _notes = plan_fp16_folds(graph, sizes, path)
    for fold in folds:
        copies[fold.fp16_buffer] = ("DEQUANTIZE fp16->fp32 per interpreter", 2 * sizes[fold.fp16_buffer])
    copies.update({b: ("DENSIFY per interpreter", d.unpacked) for b, d in _densified(graph, sizes).items()})
    return copies


@dataclass
class _Densified:
    unpacked: int = 0  # the dense tensor (and its fp32 DEQUANTIZE, for fp16 values), per subgraph that reads it
    packed: int = 0  # what the default XNNPACK delegate packs of it (fp32), beside its own dense copy


def _densified(graph: schema.ModelT, sizes: list[int]) -> dict[int, _Densified]:
    """sparse buffer -> what one interpreter keeps of it. Measured (LiteRT 2.3, fp32 1024x512 at 70% sparsity,
    2 MiB dense; tests/test_tflite_exporter_layouts.py): without delegate the DENSIFY kernel's output (2.6 MiB
    per extra interpreter); with the default XNNPACK delegate the delegate's own dense copy, which it keeps after
    packing, plus the packed weights (4.7); CompiledModel with the XNNPACK weight cache maps the packed weights
    but still keeps the delegate's dense copy (2.5-3.4). An fp16 sparse tensor densifies to fp16 and is then
    DEQUANTIZEd: both copies count."""
    packing, codes = _packing_inputs(), [builtin_code(c) for c in graph.operatorCodes or []]
    out: dict[int, _Densified] = {}
    for sg in graph.subgraphs:
        tensors = sg.tensors or []
        ops = sg.operators or []
        dense_of: dict[int, tuple[int, int]] = {}  # tensor holding the densified values -> (sparse buffer, fp32 elems)
        for op in ops:
            ins, outs = indices(op.inputs), indices(op.outputs)
            if len(ins) != 1 or len(outs) != 1 or min(ins + outs) < 0 or max(ins + outs) >= len(tensors):
                continue
            src, dst = tensors[ins[0]], tensors[outs[0]]
            if codes[op.opcodeIndex] == DENSIFY and src.buffer and src.buffer < len(sizes) and sizes[src.buffer]:
                entry = out.setdefault(src.buffer, _Densified())
                entry.unpacked += (element_count(dst) or 0) * _ITEMSIZE.get(TYPE_NAMES.get(dst.type, ""), 1)
                dense_of[outs[0]] = (src.buffer, element_count(dst) or 0)
            elif codes[op.opcodeIndex] == DEQUANTIZE and ins[0] in dense_of:
                buffer, count = dense_of[ins[0]]
                out[buffer].unpacked += 4 * count
                dense_of[outs[0]] = (buffer, count)
        packed: set[int] = set()
        for op in ops:
            ins = indices(op.inputs)
            for pos in packing.get(codes[op.opcodeIndex], ()):
                if pos < len(ins) and ins[pos] in dense_of and dense_of[ins[pos]][0] not in packed:
                    buffer, count = dense_of[ins[pos]]
                    packed.add(buffer)
                    out[buffer].packed += 4 * count
    return out


def _external_payloads(graph: schema.ModelT, path: Path, inv: ModelInventory, hash_payloads: bool) -> None:
    groups = graph.externalBufferGroups or []
    used = {t.externalBuffer: t for sg in graph.subgraphs for t in sg.tensors or [] if t.externalBuffer}
    checksums: dict[tuple[str, int, int], str] = {}
    for ext in graph.externalBuffers or []:
        if ext is None or ext.id not in used:
            continue
        t = used[ext.id]
        name = groups[ext.group].name if ext.group < len(groups) and groups[ext.group] is not None else None
        name = name.decode("utf-8", "replace") if isinstance(name, bytes) else (name or "")
        info = PayloadInfo(
            name=tensor_name(t),
            dtype=TYPE_NAMES.get(t.type, str(t.type)),
            shape=tuple(int(d) for d in (t.shape if t.shape is not None else ())),
            nbytes=ext.length,
            location="external",
            file=name,
            offset=ext.offset,
            alignment=alignment_of(ext.offset),
        )
        try:
            file = resolve_inside(path.resolve().parent, name, "external buffer group", path)
            if not file.is_file():
                raise WeightshareError(f"external buffer group file {name!r} is missing", path)
            source = FileRange(str(file), ext.offset, ext.length)
            source.check_within(file.stat().st_size)
        except WeightshareError as e:
            info.problem = e.message
            # never stat a name that failed the containment check
            exists = not isinstance(e, UnsafePath) and (path.resolve().parent / name).is_file()
            info.problem_code = problem_code(e, exists).value
        else:
            if name not in inv.external_files:
                inv.external_files.append(name)
                checksums.update({(name, *at): digest for at, digest in recorded_payloads(str(file)).items()})
            info.recorded_sha256 = checksums.get((name, ext.offset, ext.length), "")
            if hash_payloads:  # in the recorded digest's kind (BLAKE3 or SHA-256), so that the two compare
                info.sha256 = payload_digest(source, info.recorded_sha256)
        inv.payloads.append(info)
    inv.external_files.sort()


def _densify_copy(info: PayloadInfo, d: _Densified) -> None:
    """A sparse weight's per-interpreter copies (``_densified``), marked for check's gate: its threshold and the
    runtime's measured figure decide, and the fix is ``--unpack sparse``, not another plain conversion."""
    info.copies = {NO_DELEGATE: d.unpacked, XNNPACK: d.unpacked + d.packed, XNNPACK_CACHE: d.unpacked}
    info.copy_code = Code.UNPACKED_PER_SESSION.value
    info.copy_reason = "DENSIFY unpacks the sparse weights per interpreter (XNNPACK keeps its dense copy too)"
    info.copy_bytes = dict(info.copies)
    info.copy_fix = "weightshare convert MODEL -o OUT --unpack sparse (stores the dense form once)"


def _opt_in_findings(inv: ModelInventory, path: Path, opt_in: dict[str, list[tuple[PayloadInfo, str]]]) -> None:
    """One unpacked-per-session finding per --unpack value that would store these copies once."""
    for option, items in opt_in.items():
        payloads = [p for p, _ in items]
        copied = sum(p.copied_per_session for p in payloads)
        names = ", ".join(p.name for p in payloads[:3]) + (
            f" and {len(payloads) - 3} more" if len(payloads) > 3 else ""
        )
        message = (
            f"{len(payloads)} payloads are unpacked by LiteRT in every interpreter / CompiledModel "
            f"({items[0][1]}, {copied / (1 << 20):,.1f} MiB per instance): {names}"
        )
        info = CODES[Code.UNPACKED_PER_SESSION]
        fix = f"weightshare convert MODEL -o OUT --unpack {option} (stores the unpacked form once)"
        inv.findings.append(
            Finding(Code.UNPACKED_PER_SESSION, info.severity, str(path), payloads[0].name, message, fix)
        )
        inv.notes.append(f"{message}; convert with --unpack {option} to store them once")


def default_setting(path: Path) -> tuple[str, str]:
    """(the setting a model is opened with when the user does nothing, how): LiteRT's default Interpreter applies
    XNNPACK; a ``--prepack`` output (an XNNPACK weight cache beside it) is opened by ``weightshare.litert``, a
    CompiledModel with that cache."""
    from .xnnpack_cache import candidate_caches

    if candidate_caches(path):
        return XNNPACK_CACHE, "as weightshare.litert opens it (CompiledModel with its XNNPACK weight cache)"
    return XNNPACK, ""


def inventory_file(path: Path, hash_payloads: bool = True, window: tuple[int, int] | None = None) -> ModelInventory:
    """``window`` (offset, size): the model is that byte range of ``path`` (a member of a stored zip, read in
    place); payload offsets are then absolute in ``path``, and what lies beside a model file (ExternalBuffer
    groups, an XNNPACK cache) is not looked for."""
    path = Path(path)
    base = window[0] if window is not None else 0
    inv = ModelInventory(model=str(path), format="tflite", file_bytes=window[1] if window else path.stat().st_size)
    with flatbuf.open_model(str(path), window) as (reader, mapping):
        flatbuf.check_header(reader)
        refs = flatbuf.read_buffer_refs(reader)
        graph = flatbuf.read_graph(reader, mapping)
    validate(graph, len(refs), str(path))
    copies = _per_interpreter_copies(graph, [r.nbytes for r in refs], str(path))
    packs = _xnnpack_packs(graph, [r.nbytes for r in refs])
    densified = _densified(graph, [r.nbytes for r in refs])
    inv.settings = [NO_DELEGATE, XNNPACK, XNNPACK_CACHE]
    first = _first_tensors(graph)
    metadata = {m.buffer for m in graph.metadata or [] if m is not None}
    threshold = ConvertOptions().inline_threshold
    opt_in: dict[str, list[tuple[PayloadInfo, str]]] = {}
    for ref in refs:
        if not ref.nbytes:
            continue
        t = first.get(ref.index)
        info = PayloadInfo(
            name=tensor_name(t) if t is not None else f"buffer{ref.index}",
            dtype=TYPE_NAMES.get(t.type, str(t.type)) if t is not None else "UINT8",
            shape=tuple(int(d) for d in (t.shape if t is not None and t.shape is not None else ())),
            nbytes=ref.nbytes,
            location="embedded",
            offset=base + ref.file_offset,
            alignment=alignment_of(base + ref.file_offset),
            encoding="inline",
        )
        if ref.out_of_line:  # after the flatbuffer, addressed by Buffer.offset: mapped like an external blob
            info.location, info.file, info.encoding = "external", path.name, "appended"
        if t is not None and t.sparsity is not None:
            info.encoding = "sparse"
        if ref.index in copies:
            what, info.copied_per_session = copies[ref.index]
            option = _opt_in(what)
            if ref.index in densified:  # judged by check against its gate like any copy (and by the measurement)
                _densify_copy(info, densified[ref.index])
            elif option:  # check's generic finding would advise a plain convert, which does not fix these
                opt_in.setdefault(option, []).append((info, what))
            else:
                info.unpacked_at_load = what
            info.would_move = True
        elif ref.index in metadata:
            info.stays_inline_because = "metadata buffer"
        elif ref.nbytes < threshold:
            info.stays_inline_because = f"below the inline threshold ({threshold} B)"
        else:
            info.would_move = not ref.out_of_line
        packed = packs.get(ref.index, 0)
        dequantized = _opt_in(copies.get(ref.index, ("", 0))[0]) == "dequantize"
        if ref.index in densified:
            pass  # _densify_copy set its figures
        else:
            info.copies = {  # XNNPACK keeps its own fp32 unpacking of an int8 DEQUANTIZE next to the packed weights
                NO_DELEGATE: info.copied_per_session,
                XNNPACK: info.copied_per_session + packed if dequantized else max(info.copied_per_session, packed),
                XNNPACK_CACHE: info.copied_per_session if dequantized or not packed else 0,
            }
        if packed:
            info.copy_reason = "weights packed by XNNPACK per interpreter"
            info.copy_code = TfliteCode.XNNPACK_PACK_COPY.value
            info.copy_bytes = {NO_DELEGATE: 0, XNNPACK: packed, XNNPACK_CACHE: 0}
        if hash_payloads:
            info.sha256 = payload_digest(FileRange(str(path), base + ref.file_offset, ref.nbytes))
        inv.payloads.append(info)
    _opt_in_findings(inv, path, opt_in)
    if window is not None:
        return inv
    _external_payloads(graph, path, inv, hash_payloads)
    if any(p.location == "external" and p.file == path.name for p in inv.payloads):
        inv.external_files.append(path.name)
    inv.default_setting, inv.default_how = default_setting(path)
    inv.prepack_output = inv.default_setting == XNNPACK_CACHE
    notes, findings = inventory_notes(path)  # per-setting cost and XNNPACK cache status
    inv.notes += notes
    inv.findings += findings
    if any(p.encoding == "inline" and p.would_move for p in inv.payloads):
        inv.notes.append(
            "inline buffers are mapped with the file (shared), but only 16-byte aligned; "
            "`weightshare convert` moves them to page-aligned offsets"
        )
    return inv
