"""What the per-session remainder of an ONNX Runtime session is made of: its weights' bytes or ORT's own state.

A model whose every weight is mapped from the file (a ``--prepack`` output at default options, any conversion with
``session.disable_prepacking=1``) still grows per session: measured 2.4-6.2 MiB on graphs of 600-1200 nodes, with
nothing of it in the weight files' mappings. ``measure.probe`` asks ``_runtimes/remainder.py`` what the pages the
added sessions made resident hold, matched against this model's own tensors (``sources``): every payload the
inventory lists (embedded ones at their place in the model file) and every tensor of a weightshare blob's header
(the packed copies of a ``--prepack`` output by their ``ort.prepacked/...`` names). Pointer-dense pages are ORT's
graph, kernels, value maps and plans (they grow with the node count, whatever the weights' size): not weights, so
``measure_copies`` does not count them as a weight copy and reports them as ``ort-session-state``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...report import JsonDict

if TYPE_CHECKING:
    from ..._inventory import ModelInventory

EXPLAIN_MIN = 256 << 10  # a per-session growth below this is not worth a breakdown (the one-node floor is ~0.3 MiB)
# ... and above this it is not broken down either: ORT's own state measured at most ~8.3 MiB per session on exporter
# output (a BART merged decoder); a growth of 4x that is counted whole as weights (the conservative figure) instead
# of classifying every page it made (a 457 MiB copy per session took the breakdown ~10 CPU s)
EXPLAIN_MAX = 32 << 20


# The last model's sources (and ``_runtimes.remainder``'s index of them), kept by the measuring child between its
# calls: one model is measured under each setting in turn, and listing its tensors parses the model (0.2 CPU s a
# T5 decoder). Keyed by the model file's identity and its weight files' (a file replaced is listed again).
_LAST: list[tuple[list[tuple[object, ...]], list[tuple[str, list[tuple[str, int, int]]]]]] = []


def _identity(path: str) -> tuple[object, ...]:
    from .ort.probe import path_identity

    return (path, *path_identity(path))


def sources(path: Path) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """(file, [(tensor name, absolute offset, length)]) of every file holding the model's weights: the model file
    itself (its embedded payloads) and each external file (its payloads, and a weightshare blob's whole header).
    Kept for the next call on the same model while neither it nor its weight files changed."""
    found = known(path)
    if found is None:
        from .inventory import inventory_file

        found = remember(path, inventory_file(path, hash_payloads=False))
    return found


def known(path: Path) -> list[tuple[str, list[tuple[str, int, int]]]] | None:
    """The sources listed last, when they are this model's and none of its files changed since; else None."""
    for files, found in _LAST:
        try:
            if files == _identities(path, found):
                return found
        except OSError:
            break
    return None


def remember(path: Path, inv: ModelInventory) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """``sources`` from the model's inventory (``check`` has it before it measures: the measuring child is given
    the list instead of parsing the model again, 0.2 CPU s a T5 decoder), kept as the last listed."""
    found = _table(path, inv)
    _LAST[:] = [(_identities(path, found), found)]
    return found


def handed(path: Path) -> JsonDict | None:
    """``known`` with the files' identities it was listed for, as JSON for the measuring child (``adopt``)."""
    found = known(path)
    return {"files": [list(i) for i in _LAST[0][0]], "table": found} if found is not None else None


def adopt(path: Path, listed: JsonDict) -> None:
    """In the measuring child: the parent's ``sources`` of the model (``handed``), kept as the last listed when
    the files they were listed from are the ones here, unchanged."""
    table = [(str(f), [(str(n), int(b), int(k)) for n, b, k in tensors]) for f, tensors in listed["table"]]
    files = _identities(path, table)
    if _LAST and _LAST[0] == (files, table):
        return  # the same list, kept as it is: the breakdown's index of it is reused under the next setting
    if [list(i) for i in files] == listed["files"]:
        _LAST[:] = [(files, table)]


def _identities(path: Path, found: list[tuple[str, list[tuple[str, int, int]]]]) -> list[tuple[object, ...]]:
    return [_identity(str(path))] + [_identity(f) for f, _t in found if f != str(path)]


def _table(path: Path, inv: ModelInventory) -> list[tuple[str, list[tuple[str, int, int]]]]:
    from ..._safetensors import read_safetensors_metadata
    from ...errors import WeightshareError

    tables: dict[str, list[tuple[str, int, int]]] = {str(path): []}
    for p in inv.payloads:
        if p.offset is not None:
            f = str(path) if p.location == "embedded" else str(path.parent / p.file)
            tables.setdefault(f, []).append((p.name, p.offset, p.nbytes))
    for name in inv.external_files:
        f = str(path.parent / name)
        try:
            start, header, _meta = read_safetensors_metadata(f)
        except (WeightshareError, OSError, ValueError):
            continue  # not a weightshare blob: its payloads are listed above
        for key, t in header.items():
            offsets = t.get("data_offsets") if isinstance(t, dict) else None
            if not key.startswith("__pad__") and isinstance(offsets, list) and len(offsets) == 2:
                tables.setdefault(f, []).append((key, start + int(offsets[0]), int(offsets[1]) - int(offsets[0])))
    return list(tables.items())


def readers(path: Path, names: list[str]) -> dict[str, list[str]]:
    """name -> the op types that read it (subgraphs included); a packed copy's name ``ort.prepacked/T/Kernel+h/i``
    (in a --shared-blob zoo ``<model stem>/ort.prepacked/...``) names its kernel."""
    from ._proto import load_model, pb
    from .ort.prepack_record import PACKED_PREFIX, name_from_prefix

    out: dict[str, list[str]] = {}
    for n in names:
        packed = (name_from_prefix(n, (PACKED_PREFIX,)) or "").split("/")
        if len(packed) >= 3:
            out[n] = [packed[2].split("+")[0]]
    wanted = {n for n in names if n not in out}
    if not wanted:
        return out

    def walk(g: pb.GraphProto, depth: int) -> None:
        for node in g.node:
            for i in node.input:
                if i in wanted and node.op_type not in out.setdefault(i, []):
                    out[i].append(node.op_type)
            for a in node.attribute:
                for sub in [a.g] if a.HasField("g") else list(a.graphs):
                    if depth < 16:
                        walk(sub, depth + 1)

    walk(load_model(path).graph, 0)
    return out


def explain(path: Path, first: JsonDict, last: JsonDict, added: int) -> JsonDict:
    """In the measuring child, once the weights' figures are read (before the arena's sessions run and reuse what
    they freed): the breakdown of what the ``added`` sessions opened between the snapshots ``first`` and ``last``
    kept, per session (``_runtimes.remainder.breakdown``), with the op types that read each weight it found
    copied."""
    from ..._runtimes.remainder import breakdown

    out = breakdown(first, last, added, sources(path))
    names = [n for n, _b in out["tensors"]]
    found = readers(path, names) if names else {}
    out["tensors"] = [[n, b, found.get(n, [])] for n, b in out["tensors"]]
    return out
