"""What every command does with a model through its format, found by the registry: the inventory (``inspect``,
``check``, ``verify``), ``verify`` of an original and its conversion, and ``verify``'s input files.

The report models (``_inventory.ModelInventory``, ``_verify.VerifyReport``) sit below the format protocol, which
names them; the steps that ask the registry for a model's format sit here, above it, so that neither a report
model nor a format's own code imports the registry.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._findings import Code, Finding
from ._inventory import MeasureInputs, ModelInventory, mark_duplicates
from ._platform import require_posix
from ._recorded import blob_name_problem, record_problem, recorded_records
from ._verify import VerifyReport, read_input
from .errors import InvalidModel, UsageError
from .formats import detect, detect_format, get, model_suffixes, registered
from .formats.base import Decodes, MeasurementKey, MeasuresCopies, ReadsInputs


def inventory(
    path: str | os.PathLike[str], hash_payloads: bool = True, measure: bool = False, feeds: MeasureInputs | None = None
) -> ModelInventory:
    """Inventory of the model at ``path`` (format detected from the file). ``measure``: also measure what one more
    session costs per setting in the runtime itself, for formats that can (``measure_copies``), its runs' inputs
    as ``feeds`` say."""

    require_posix("reading a model")
    path = Path(path)
    fmt = detect(path)
    inv = fmt.inventory(path, hash_payloads)
    if hash_payloads:
        mark_duplicates(inv.payloads)
        _check_other_records(inv, path.resolve() if path.is_dir() else path.resolve().parent)
    if measure:
        measure_model(inv, path, feeds)
    return inv


def measure_model(
    inv: ModelInventory, path: str | os.PathLike[str], feeds: MeasureInputs | None = None
) -> list[Finding]:
    """What one more session of the model costs, measured in its runtime (formats that can: ``measure_copies``),
    into ``inv``; the findings measuring made of the model itself (also added to ``inv.findings``)."""
    path = Path(path)
    fmt = get(inv.format)
    if not isinstance(fmt, MeasuresCopies) or any(p.problem for p in inv.payloads):  # broken: not run
        return []
    # what the user said of the inputs, to a format that takes it (a format of its own may not: its inputs)
    measured = (
        fmt.measure_copies(path, feeds) if feeds and (feeds.dims or feeds.input_files) else fmt.measure_copies(path)
    )
    inv.measured, inv.measured_one_session, inv.measure_notes = measured[:3]
    if len(measured) > 3:  # a format that tells activation memory apart from weight copies
        inv.measured_activation = measured[3]
    found: list[Finding] = list(measured[4]) if len(measured) > 4 else []
    inv.findings += found  # what measuring found of the model itself (the runtime refuses to load it)
    if len(measured) > 5:  # a format whose loader has a cost of its own: what the user pays, both ways
        inv.paid = measured[5]
    return found


def measure_or_reuse(
    inv: ModelInventory,
    path: str | os.PathLike[str],
    feeds: MeasureInputs,
    reuse: dict[str, object] | None,
    settle: Callable[[], None],
) -> None:
    """``check``'s measurement of a model: ``measure_model`` then ``settle`` (its repeats near a decision line), or
    the verdict measured earlier for the same key (``_measure_cache``: the model's content, the runtime's version
    and CPU kind, the children's bound, ``feeds`` and the options in ``reuse``; None: measure, store nothing)."""
    from . import _measure_cache as cache
    from ._runtimes.bound import child_memory_bytes

    path = Path(path)
    fmt = detect(path)
    context = fmt.measurement_key(path) if reuse is not None and isinstance(fmt, MeasurementKey) else None
    key = cache.key_for(inv, path, context, feeds, {**(reuse or {}), "bound": child_memory_bytes(0)})
    if key and cache.reuse(inv, key, path):
        return
    found = measure_model(inv, path, feeds)
    settle()
    if key:
        cache.remember(key, inv, found)


def _check_other_records(inv: ModelInventory, base: Path) -> None:
    """Re-hash every blob record with a recorded digest that no payload of ``inv`` sits at, so that a flipped
    byte in a packed copy fails ``check`` and ``verify`` like one in a weight."""

    seen = {(p.file, p.offset, p.nbytes) for p in inv.payloads}
    bad: list[str] = []
    for name in inv.external_files:
        blob = base / name
        renamed = blob_name_problem(str(blob))
        if renamed:
            inv.record_problems.append(f"blob {name}: {renamed}")
            inv.findings.append(Finding.of(Code.BLOB_DIGEST_MISMATCH, inv.model, f"blob {name}: {renamed}"))
        for key, begin, length, digest in sorted(recorded_records(str(blob)), key=lambda r: r[1]):
            if (name, begin, length) in seen:
                continue
            seen.add((name, begin, length))
            inv.records_hashed += 1
            why = record_problem(str(blob), begin, length, digest, blob.stat().st_size)
            if why:
                inv.record_problems.append(f"blob record {key!r} in {name} at offset {begin}: {why}")
                bad.append(key)
    if inv.record_problems:
        more = f" and {len(inv.record_problems) - 1} more" if len(inv.record_problems) > 1 else ""
        inv.findings.append(
            Finding.of(Code.CHECKSUM_MISMATCH, inv.model, inv.record_problems[0] + more, bad[0] if bad else "")
        )


def _check_blob(report: VerifyReport, converted: Path) -> bool:
    """Re-hash every payload against its recorded checksum; True when an external reference is broken."""
    inv = inventory(converted, hash_payloads=True)
    broken = False
    for p in inv.payloads:
        if p.problem:
            broken = True
            report.checksum_mismatches.append(f"tensor {p.name!r}: {p.problem}")
        elif p.recorded_sha256:
            report.payloads_hashed += 1
            if p.sha256 != p.recorded_sha256:
                report.checksum_mismatches.append(
                    f"tensor {p.name!r} in {p.file} at offset {p.offset}: its "
                    "checksum differs from the one recorded in the blob"
                )
    report.payloads_hashed += inv.records_hashed  # blob records no tensor references (ORT packed copies)
    report.checksum_mismatches += inv.record_problems
    return broken


def verify(
    original: str | os.PathLike[str],
    converted: str | os.PathLike[str],
    runs: int = 3,
    dims: dict[str, int] | None = None,
    seed: int = 0,
    inputs: dict[str, Any] | None = None,
    shapes: dict[str, list[int]] | None = None,
    decode_steps: int = 0,
) -> VerifyReport:
    """Run ``original`` and ``converted`` on the same inputs and compare; re-hash the blob.

    ``inputs``: name -> value used in every run instead of random values; ``dims``:
    symbolic dim name (or ``"*"`` for every other dynamic dim) -> value; ``shapes``
    (TFLite): input name -> full shape for inputs with dynamic dims; ``decode_steps`` (ONNX decoders): after the
    runs, a prefill step and this many steps feeding each present output back as its past input.
    """
    original, converted = Path(original), Path(converted)
    fmt = detect_format(original)
    if detect_format(converted) != fmt:
        raise UsageError(f"{original} and {converted} are not the same format")
    if runs < 1:
        raise UsageError("--runs must be at least 1")
    if not 0 <= seed < 1 << 63:  # numpy's generators take a non-negative seed
        raise UsageError(f"--seed takes a non-negative integer below 2**63, got {seed}")
    spec = get(fmt)
    if decode_steps < 0 or (decode_steps and not (isinstance(spec, Decodes) and spec.decodes)):
        raise UsageError(f"--decode-steps takes a non-negative number of steps, for decoders ({fmt} has none)")
    report = VerifyReport(str(original), str(converted), fmt)
    opts: dict[str, Any] = {
        "runs": runs,
        "dims": dims or {},
        "seed": seed,
        "inputs": inputs or {},
        "shapes": shapes or {},
        "decode_steps": decode_steps,
    }
    try:
        broken = _check_blob(report, converted)
    except InvalidModel as e:
        report.checksum_mismatches.append(f"the converted model cannot be read: {e.message}")
        return report
    spec.verify(report, original, converted, opts, broken)
    return report


def load_input(name: str, file: str | os.PathLike[str]) -> Any:
    """A value for ``--input NAME=FILE``: a .npy array, or a file a format reads (``Format.input_readers``, by
    suffix: ONNX's serialized TensorProto ``.pb``)."""
    readers: dict[str, Callable[[Path], Any]] = {}
    for fmt in reversed(registered()):  # the first registered format that reads a suffix wins
        if isinstance(fmt, ReadsInputs):
            readers.update(fmt.input_readers)
    return read_input(name, file, readers)


def find_models(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files as given; directories searched recursively (sorted), an ``.mlpackage`` being a model, not a folder;
    unexpanded globs expanded."""
    import glob

    suffixes = model_suffixes()
    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir() and path.suffix not in suffixes:
            for root, dirs, files in os.walk(path):
                packages = sorted(d for d in dirs if Path(d).suffix in suffixes)  # a model package, not a folder
                dirs[:] = sorted(d for d in dirs if Path(d).suffix not in suffixes)  # walk the rest, in order
                here = Path(root)
                found += sorted([here / f for f in files if Path(f).suffix in suffixes] + [here / d for d in packages])
        elif not path.exists() and glob.has_magic(str(item)):
            found += sorted(Path(p) for p in glob.glob(str(item)))
        else:
            found.append(path)
    return found
