"""The inspection functions: ``inspect`` (one model's payloads), ``check`` (the CI gate) and ``verify`` (both
models run in their runtime).

Re-exported by ``weightshare.api``, their public home (import them from there).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .options import INLINE_THRESHOLD

if TYPE_CHECKING:  # imported where used: `convert` needs none of them (start-up time)
    from ._findings import Finding
    from ._inventory import ModelInventory
    from ._verify import VerifyReport


@dataclass
class CheckReport:
    """The verdict of ``check``: ``ok`` when no finding fails the gate."""

    ok: bool
    models: list[ModelInventory] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    exit_code: int = 0  # what `weightshare check` exits with on the same models and options (0, 1, 2)


def inspect(model: str | os.PathLike[str], *, hash_payloads: bool = True) -> ModelInventory:
    """Every weight payload of a model: where it lives, its encoding and alignment, what each runtime copies.

    Args:
        model: an ONNX, TFLite or Core ML model.
        hash_payloads: hash every payload (duplicates, and checks against the digests a blob records).

    Returns:
        The ``ModelInventory``; ``check`` turns it into findings.

    Raises:
        InvalidModel: the model cannot be read.
        Unsupported: not a model of a known format.

    Example:
        >>> inv = weightshare.inspect("out/model.onnx")
        >>> inv.copied_per_session, inv.external_files
        (0, ['model.weights.1f2e3d4c5b6a.safetensors'])
    """
    from ._dispatch import inventory

    return inventory(model, hash_payloads=hash_payloads)


def check(
    models: Sequence[str | os.PathLike[str]],
    *,
    target: Sequence[str] = (),
    threshold: int = 1 << 20,
    measure: bool = True,
    inline_threshold: int = INLINE_THRESHOLD,
    strict: bool = False,
    dims: dict[str, int] | None = None,
    inputs: dict[str, str | os.PathLike[str]] | None = None,
    runtime: str = "",
    cache: bool = True,
) -> CheckReport:
    """The CI gate: whether every model is share-ready (``weightshare check``).

    Args:
        models: model files, folders (searched recursively) or globs.
        target: runtime setting ids the models will be loaded with (``--target``: ``ort-default``,
            ``ort-disable-prepacking``, ``litert-builtin``, ``litert-xnnpack``, ``litert-compiled-cache``,
            ``coreml``); a model whose format has none named is held to its runtime's default (``default_setting``:
            ort-default, litert-xnnpack, ...; docs/ci.md).
        threshold: bytes per session a copy may cost before it is an error (``--threshold``, default 1 MiB).
        measure: ONNX: ask onnxruntime, in child processes, what one more session costs (``--no-measure``: False).
        inline_threshold: embedded payloads below this many bytes are fine.
        strict: warnings fail the gate too (copies that only a runtime's default setting makes).
        dims: symbolic dim name (``"*"``: every other) -> value for the measuring runs (``--dim``), as ``verify``.
        inputs: input name -> a .npy (or ONNX TensorProto .pb) file with its real values (``--input``).
        runtime: the serving machine's runtime as ``VERSION[/CPU_KIND]`` (``--runtime``, e.g. ``1.32.0/avx512``):
            a ``--prepack`` output is judged for it instead of for the runtime installed here.
        cache: reuse a verdict measured earlier while the model's content, the runtime's version and CPU kind and
            these options are unchanged (``$XDG_CACHE_HOME/weightshare/measured``; ``--no-cache``: False).

    Returns:
        A ``CheckReport``: ``ok``, each model's inventory and every finding (``Finding.line()`` for one line).

    Raises:
        UsageError: no model found, a target that is not a setting id, a negative threshold, a dim or input no
            measured model has, an unreadable input file. A model that cannot
            be read is an ``unreadable-model`` finding (``exit_code`` 2), and the others are still checked, as
            with the CLI (one implementation: ``_gate.run_gate``).

    Example:
        >>> result = weightshare.check(["out/"])
        >>> result.ok, [f.line() for f in result.findings]
        (True, [])
    """
    from ._check import Gate
    from ._gate import run_gate
    from ._inventory import MeasureInputs

    feeds = MeasureInputs(
        tuple((dims or {}).items()), tuple((name, os.fspath(file)) for name, file in (inputs or {}).items())
    )
    gate = Gate(tuple(target), threshold, inline_threshold, measure=measure, feeds=feeds, runtime=runtime, cache=cache)
    result = run_gate(models, gate, strict)
    return CheckReport(result.ok, result.inventories, result.findings, result.exit_code)


def verify(
    original: str | os.PathLike[str],
    converted: str | os.PathLike[str],
    *,
    runs: int = 3,
    dims: dict[str, int] | None = None,
    shapes: dict[str, list[int]] | None = None,
    inputs: dict[str, Any] | None = None,
    seed: int = 0,
    decode_steps: int = 0,
) -> VerifyReport:
    """Run both models in the real runtime on the same inputs; pass only if every output is byte-identical.

    Also re-hashes every blob payload against its recorded digest. Core ML (no runtime on Linux): the weights
    must decode to the same bytes and the programs must match op for op.

    Args:
        original: the model before conversion.
        converted: the converted model.
        runs: runs with different seeded random inputs.
        dims: value of a symbolic input dimension by name; ``"*"`` sets every other dynamic dimension.
        shapes: TFLite: the full shape of an input with dynamic dims, by input name.
        inputs: real values (numpy arrays) for inputs, by name, used in every run.
        seed: seed of the random inputs of the first run.
        decode_steps: ONNX decoders: after the runs, a prefill step then this many steps feeding each
            ``present*`` output back as its ``past*`` input (next token: the argmax of the logits).

    Returns:
        A ``VerifyReport``; ``passed`` is the verdict, ``mismatches`` and ``checksum_mismatches`` say why not.

    Raises:
        OriginalFails: the original itself does not run with these inputs.
        UsageError: the two models are not of the same format, ``runs`` < 1.

    Example:
        >>> weightshare.verify("model.onnx", "out/model.onnx", runs=2).passed
        True
    """
    from ._dispatch import verify as run_verify

    return run_verify(original, converted, runs, dims, seed, inputs, shapes, decode_steps)
