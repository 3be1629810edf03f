"""``weightshare.litert.interpreter``: the classic ``Interpreter`` API over ``CompiledModel`` + the XNNPACK cache.

Why not the classic Interpreter itself: in LiteRT 2.3 its only XNNPACK is the default delegate, created by
``MaybeCreateXNNPACKDelegate`` (tflite/tflite_with_xnnpack_optional.cc) from
``TfLiteXNNPackDelegateOptionsDefault()``, whose ``weight_cache_file_path`` is null, so every interpreter packs
its own copy of the weights; the Python API has no option that reaches it, and ``load_delegate`` needs a
library exporting ``tflite_plugin_create_delegate``, which the wheel does not ship for XNNPACK (no shared
object in ai_edge_litert exports any XNNPACK symbol). Only ``CompiledModel`` passes a weight cache file to
XNNPACK (``CpuOptions.xnnpack_weight_cache_path``). So this object runs the model through
``weightshare.litert.compiled_model`` and answers the calls an ``Interpreter`` user makes: tensor details
come from a classic Interpreter opened once without delegate and without allocating (it holds no weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import UsageError

if TYPE_CHECKING:
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.interpreter import Interpreter

Details = dict[str, Any]


def _copy(d: Details) -> Details:
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in d.items()}


class _Signature:
    """One signature of the CompiledModel: its buffers, written on set, read once per run."""

    def __init__(self, cm: CompiledModel, key: str, inputs: dict[str, Details], outputs: dict[str, Details]):
        """``inputs``/``outputs``: the classic runner's details by the SIGNATURE's names (a model without
        SignatureDefs: by tensor name, which is what CompiledModel's placeholder signature uses). Converters name
        signature inputs otherwise than their tensors (``x`` vs ``serving_default_x:0``), so tensors are matched
        by signature name, never by a tensor's own name."""
        self.cm, self.key = cm, key
        self.index = max(cm.get_signature_index(key), 0)
        sig = cm.get_signature_by_index(self.index)
        self.input_names: list[str] = list(sig["inputs"])
        self.output_names: list[str] = list(sig["outputs"])
        for what, names, details in (("inputs", self.input_names, inputs), ("outputs", self.output_names, outputs)):
            if set(names) != set(details):
                raise UsageError(
                    f"signature {key!r}: LiteRT's CompiledModel names its {what} {sorted(names)}, its Interpreter "
                    f"{sorted(details)}"
                )
        self.inputs = [inputs[n] for n in self.input_names]
        self.outputs = [outputs[n] for n in self.output_names]
        # LiteRT's runner lists its details in its own order (the signature's names sorted: ``input_pos``,
        # ``kv_cache_k_0``, ..., ``tokens``), CompiledModel its buffers in the SignatureDef's: code that fills
        # inputs by position reads the listing, so the listing keeps LiteRT's order and the buffers CompiledModel's
        self.listed_inputs, self.listed_outputs = list(inputs), list(outputs)
        self._make_buffers()

    def _make_buffers(self) -> None:
        self.in_buffers = self.cm.create_input_buffers(self.index)
        self.out_buffers = self.cm.create_output_buffers(self.index)
        self.results: list[np.ndarray] | None = None
        self.given: dict[int, np.ndarray] = {}

    def position(self, tensor_index: int, outputs: bool = False) -> int:
        details = self.outputs if outputs else self.inputs
        for i, d in enumerate(details):
            if d["index"] == tensor_index:
                return i
        what = "output" if outputs else "input"
        raise ValueError(f"tensor {tensor_index} is not an {what} of signature {self.key!r}")

    def set(self, pos: int, value: np.ndarray) -> None:
        d = self.inputs[pos]
        value = np.asarray(value)
        if value.dtype != np.dtype(d["dtype"]):
            raise ValueError(
                f"Cannot set tensor: Got value of type {value.dtype.name.upper()} but expected type "
                f"{np.dtype(d['dtype']).name.upper()} for input {d['index']}, name: {d['name']}"
            )
        if list(value.shape) != [int(x) for x in d["shape"]]:
            raise ValueError(
                f"Cannot set tensor: Dimension mismatch. Got {list(value.shape)} but expected "
                f"{[int(x) for x in d['shape']]} for input {d['index']}."
            )
        self.in_buffers[pos].write(np.ascontiguousarray(value))
        self.given[pos] = value.copy()
        self.results = None

    def resize(self, pos: int, shape: list[int]) -> None:
        self.cm.resize_input_tensor(pos, shape, self.index)
        self.inputs[pos]["shape"] = np.array(shape, np.int32)
        details = self.cm.get_output_tensor_details(self.key)
        for name, d in zip(self.output_names, self.outputs):
            d["shape"] = np.array(details[name]["shape"], np.int32)
        self._make_buffers()

    def run(self) -> None:
        self.cm.run_by_index(self.index, self.in_buffers, self.out_buffers)
        self.results = None

    def get(self, pos: int) -> np.ndarray:
        if self.results is None:
            self.results = [
                buf.read(int(np.prod(d["shape"])), np.dtype(d["dtype"])).reshape([int(x) for x in d["shape"]])
                for buf, d in zip(self.out_buffers, self.outputs)
            ]
        return self.results[pos]


class SignatureRunner:
    """What ``Interpreter.get_signature_runner(key)`` returns: ``runner(**inputs) -> {output: array}``."""

    def __init__(self, sig: _Signature):
        self._sig = sig

    def get_input_details(self) -> dict[str, Details]:
        """By the signature's input names, in the order and with the fields of LiteRT's runner (each detail's
        ``name`` is the tensor's)."""
        sig = self._sig
        by_name = dict(zip(sig.input_names, sig.inputs))
        return {n: _copy(by_name[n]) for n in sig.listed_inputs}

    def get_output_details(self) -> dict[str, Details]:
        sig = self._sig
        by_name = dict(zip(sig.output_names, sig.outputs))
        return {n: _copy(by_name[n]) for n in sig.listed_outputs}

    def __call__(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        sig = self._sig
        missing = set(sig.input_names) - set(inputs)
        unknown = set(inputs) - set(sig.input_names)
        if missing or unknown:
            raise ValueError(f"signature {sig.key!r} takes inputs {sig.input_names}; got {sorted(inputs)}")
        for pos, name in enumerate(sig.input_names):
            value = np.asarray(inputs[name])
            if list(value.shape) != [int(x) for x in sig.inputs[pos]["shape"]]:
                sig.resize(pos, list(value.shape))
        for pos, name in enumerate(sig.input_names):
            sig.set(pos, inputs[name])
        sig.run()
        results = {name: sig.get(pos).copy() for pos, name in enumerate(sig.output_names)}
        return {name: results[name] for name in sig.listed_outputs}  # in LiteRT's runner's order


class SharedInterpreter:
    """The ``ai_edge_litert.interpreter.Interpreter`` calls, run by ``CompiledModel`` with the shared cache.

    ``weightshare_cache`` is the XNNPACK weight cache in use (None: each instance packs its own weights).
    Tensors other than the primary subgraph's inputs and outputs are not reachable (CompiledModel does not
    expose intermediates); ``get_tensor`` on one raises ValueError.
    """

    def __init__(self, cm: CompiledModel, classic: Interpreter):
        self._cm = cm
        self.weightshare_cache = cm.weightshare_cache
        self._signatures: dict[str, _Signature] = {}
        self._subgraph_of: dict[str, int] = {}
        self._signature_list = classic.get_signature_list()
        cm_keys = list(cm.get_signature_list())
        if self._signature_list:
            for key in self._signature_list:
                runner = classic.get_signature_runner(key)
                self._subgraph_of[key] = int(runner._subgraph_index)
                ins = {n: _copy(d) for n, d in runner.get_input_details().items()}
                outs = {n: _copy(d) for n, d in runner.get_output_details().items()}
                self._signatures[key] = _Signature(cm, key, ins, outs)
        else:  # no SignatureDefs: CompiledModel runs the primary subgraph under a placeholder key
            ins = {d["name"]: _copy(d) for d in classic.get_input_details()}
            outs = {d["name"]: _copy(d) for d in classic.get_output_details()}
            self._signatures[cm_keys[0]] = _Signature(cm, cm_keys[0], ins, outs)
            self._subgraph_of[cm_keys[0]] = 0
        self._primary = next((s for k, s in self._signatures.items() if self._subgraph_of[k] == 0), None)
        # the primary subgraph's inputs and outputs as LiteRT's Interpreter lists them (the subgraph's order)
        self._listed = (
            [int(d["index"]) for d in classic.get_input_details()],
            [int(d["index"]) for d in classic.get_output_details()],
        )

    def _main(self) -> _Signature:
        if self._primary is None:
            raise ValueError("no signature of this model runs its primary subgraph; use get_signature_runner()")
        return self._primary

    def allocate_tensors(self) -> None:
        """Buffers exist from the start (and are remade on resize): nothing to do, as after a first allocation."""

    def get_input_details(self) -> list[Details]:
        by_index = {int(d["index"]): d for d in self._main().inputs}
        return [_copy(by_index[i]) for i in self._listed[0] if i in by_index]

    def get_output_details(self) -> list[Details]:
        by_index = {int(d["index"]): d for d in self._main().outputs}
        return [_copy(by_index[i]) for i in self._listed[1] if i in by_index]

    def get_signature_list(self) -> dict[str, dict[str, list[str]]]:
        return dict(self._signature_list)

    def get_signature_runner(self, signature_key: str | None = None) -> SignatureRunner:
        if signature_key is None:
            if len(self._signatures) != 1:
                raise ValueError("SignatureDef signature_key is None and model has more than one signature")
            signature_key = next(iter(self._signatures))
        if signature_key not in self._signatures or not self._signature_list:
            raise ValueError(f"Invalid signature_key provided: {signature_key!r}")
        return SignatureRunner(self._signatures[signature_key])

    def set_tensor(self, tensor_index: int, value: np.ndarray) -> None:
        sig = self._main()
        sig.set(sig.position(tensor_index), value)

    def resize_tensor_input(self, input_index: int, tensor_size: Any, strict: bool = False) -> None:
        sig = self._main()
        sig.resize(sig.position(input_index), [int(x) for x in tensor_size])

    def invoke(self) -> None:
        self._main().run()

    def get_tensor(self, tensor_index: int, subgraph_index: int = 0) -> np.ndarray:
        sig = self._main()
        if subgraph_index == 0 and any(d["index"] == tensor_index for d in sig.outputs):
            return sig.get(sig.position(tensor_index, outputs=True)).copy()
        if subgraph_index == 0 and any(d["index"] == tensor_index for d in sig.inputs):
            pos = sig.position(tensor_index)
            if pos in sig.given:
                return sig.given[pos].copy()
        raise ValueError(
            f"tensor {tensor_index}: only the inputs (once set) and outputs of the primary subgraph are readable "
            "through CompiledModel"
        )

    def close(self) -> None:
        self._cm.close()
