"""What weightshare assumes of the names ONNX Runtime gives what it makes: one place, each with the version it was
checked on, and how a rule keyed on it fails closed when an ORT release names things otherwise.

ORT's transformers name the nodes and initializers they add; those names are ORT's private business and may change
in any release. Where a rule can decide by the graph's structure it does (op types, domains, wiring: the pair check's
node-for-node fingerprints in ``segments``, the fusion deltas of ``cpu.rounding_change``); where it reads a name, the
name is here and the rule refuses what it does not recognise rather than decide otherwise.

Each name: what ORT emits it for; which rule reads it; the ORT release it was checked on; what happens when an
ORT names it otherwise.

- ``INSERTED_CAST`` (``InsertedPrecisionFreeCast_``): the ``Cast`` nodes InsertCastTransformer puts around
  fp16/bf16 ops without a CPU kernel. Read by ``cpu`` (which Casts ORT inserts per session: ``--unpack ort-cpu``,
  inspect's note), ``segments`` (a cut through an fp32 run) and ``prepack`` (a report line). Checked on 1.32.0.
  Otherwise: a named Cast ORT added under another name refuses ``--unpack ort-cpu`` and the probe
  (``cpu.unrecognised_casts``: exit 2, one line); in ``segments`` the splice is not made, the pair check fails and
  the graph is optimized in one piece (ORT's graph of the whole model, in more memory; never another graph).
- (no name): the nodes of a function body ORT expands for want of a kernel are unnamed. Read by
  ``cpu.adopt_inserted_casts`` (copied in as ORT's nodes). Checked on 1.32.0. Otherwise: a named Cast among them is
  an unrecognised Cast (above); other ops are adopted as they are.
- ``FUSED_BACK`` (``FusedBack_``): FuseInitializersTransformer's fp32 initializers: ``FusedBack_X`` is
  ``Cast(X)`` folded, X a constant of the graph ORT was given (or of a function body it inlined:
  ``INLINED_FUNCTION``, ``_inlfunc_``), or a fusion's product computed in fp16 and cast back
  (``FusedBack_ConvBnFusion_BN_B_b0``). ``KNOWN_COMPUTED``: the other prefixes of floating-point tensors ORT
  computes in the fp16 forms tested (NCHWc's ``reorder``, ``_inlfunc_``). Read by ``cpu.fp16_folded``. Checked on
  1.32.0. Which initializers ORT computed is structural (a name the given graph does not have); what from, only
  the name says, so a floating-point tensor ORT computed under a name matching none of these refuses
  ``--unpack ort-cpu`` (exit 2, one line): a renamed ``FusedBack_`` cannot pass as a harmless one.
- ``.../MatMulScaleFusion/...`` in a node's name: the node a fusion made. Read by ``cpu.rounding_change`` for the
  message. Checked on 1.32.0. Which repair ``unfuse`` tries is structural (``cpu._scale_fusion``: a
  ``com.microsoft.FusedMatMul`` where the original has a ``MatMul`` and a ``Mul``/``Div``, nothing else changed);
  another name changes the message only, and any other fusion is refused.
- ``PREPACKED_ENTRY`` (``prepacked_``): the external-data keys of the packed copies
  ``session.save_external_prepacked_constant_initializers`` writes. Read by ``child`` (node by node, and the
  segments' ``Sharer``) and ``prepack`` (``Relocator.add_tensor``). Checked on 1.32.0. Otherwise: an external-data
  key that is neither ONNX's nor this one (``unknown_entries``) refuses ``--prepack`` (exit 2, one line), where the
  child reads a packed node's model and where the parent relocates the optimized model.

``saved_hook``: applied to every model ORT saved before these rules read it (``cpu``: the probe, the rounding
check's optimized graphs; ``segments``: each segment and window, when the segmenter runs in this process). Tests set
it to rename what ORT emits and show the rules refuse (tests/test_ort_names.py); it is None otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._proto import pb

__all__ = [
    "CHECKED_ON",
    "FUSED_BACK",
    "INLINED_FUNCTION",
    "INSERTED_CAST",
    "KNOWN_COMPUTED",
    "LOAD",
    "PACKED_FILE_KEY",
    "PREPACKED_ENTRY",
    "LoadRefused",
    "saved_hook",
]

CHECKED_ON = "1.32.0"  # the onnxruntime release every name below was read from (its saved graphs)
INSERTED_CAST = "InsertedPrecisionFreeCast_"
FUSED_BACK = "FusedBack_"
INLINED_FUNCTION = "_inlfunc_"
KNOWN_COMPUTED = ("reorder", INLINED_FUNCTION)
PREPACKED_ENTRY = "prepacked_"
# weightshare's own external-data key, not ORT's: the child's file its moved prepacked_N entries point into (here,
# not in ``prepack``, so that the child reads it without importing the converter)
PACKED_FILE_KEY = "weightshare.packed_location"

EXTERNAL_DATA_KEYS = frozenset({"location", "offset", "length", "checksum"})  # ONNX's own

saved_hook: Callable[[pb.ModelProto], None] | None = None


def apply_saved_hook(model: pb.ModelProto) -> None:
    if saved_hook is not None:
        saved_hook(model)


def unknown_keys(keys: Iterable[str], also: frozenset[str] = frozenset()) -> list[str]:
    """External-data keys that are neither ONNX's, nor ORT's ``PREPACKED_ENTRY``, nor in ``also``: a packed copy an
    ORT release records under another key, which the relocation would otherwise drop."""
    return sorted({k for k in keys if k not in EXTERNAL_DATA_KEYS | also and not k.startswith(PREPACKED_ENTRY)})


def unknown_entries(model: pb.ModelProto) -> list[str]:
    return unknown_keys(e.key for t in model.graph.initializer for e in t.external_data)


def unknown_entry_message(key: str) -> str:
    return (
        f"onnxruntime wrote an external-data entry weightshare does not know ({key!r}; onnxruntime {CHECKED_ON} "
        f"writes {PREPACKED_ENTRY}N, ort/names.py): refused rather than drop what it packed"
    )


LOAD = "--load"  # a child request's first argument: load models (``child.load``), not optimize one


class LoadRefused(Exception):
    """In the child: the installed onnxruntime refuses a model the converter would write."""
