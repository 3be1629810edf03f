"""``weightshare merge``: several ML Program packages into one multifunction .mlpackage, streaming.

The output is what coremltools' ``save_multifunction`` builds (``Program.functions``,
``ModelDescription.functions``, ``defaultFunctionName``, specification version at
least iOS 18), but made from the specs directly: coremltools loads every source's
weights into a pymil program (one full copy per function in RAM, then a hash pass
to deduplicate them); here each payload is copied chunk by chunk into the new
weight.bin and identical payloads are stored once by SHA-256, so peak memory is
the specs plus one chunk, whatever the number of functions.

Function naming: every source contributes its functions in order (a single-function
package its ``main``, a multifunction package each of its functions); ``function_names``
renames them in that order. Without names, a multifunction source keeps its own
names and a single-function one is named after its package.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..._atomic import OutputTransaction
from ...errors import InvalidModel, Unsupported, UsageError
from ...options import ConvertOptions
from ...report import ConversionReport
from .convert import BlobRelocator, open_weight_file
from .milblob import WeightFileWriter
from .package import (
    AUTHOR,
    MANIFEST,
    MODEL_NAME,
    WEIGHT_FILE,
    WEIGHTS_NAME,
    Package,
    dump_manifest,
    read_package,
    spec_protos,
    stable_id,
    write_file,
)

if TYPE_CHECKING:
    from coremltools.proto import MIL_pb2

SPEC_VERSION_IOS18 = 9  # multifunction models need Core ML 8 (iOS 18 / macOS 15)
# Specification version -> MIL opset name (coremltools converters/mil/backend/mil/load.py ``_OPSET``).
OPSETS = {6: "CoreML5", 7: "CoreML6", 8: "CoreML7", 9: "CoreML8", 10: "CoreML9"}
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
MODEL_ITEM = "com.apple.CoreML/" + MODEL_NAME
WEIGHTS_ITEM = "com.apple.CoreML/" + WEIGHTS_NAME


@dataclass
class SourceFunction:
    pkg: Package
    name: str  # in the source program
    description: object  # Model_pb2.FunctionDescription, name cleared


def source_functions(pkg: Package) -> list[SourceFunction]:
    """The functions a package contributes, in order, with their descriptions (as save_multifunction builds them)."""
    Model_pb2, _ = spec_protos()
    desc = pkg.spec.description
    program = pkg.spec.mlProgram
    if not desc.functions:
        if "main" not in program.functions:
            raise InvalidModel("single-function model has no 'main' function in its program", pkg.model_path)
        fd = Model_pb2.FunctionDescription(
            input=desc.input,
            output=desc.output,
            state=desc.state,
            predictedFeatureName=desc.predictedFeatureName,
            predictedProbabilitiesName=desc.predictedProbabilitiesName,
        )
        return [SourceFunction(pkg, "main", fd)]
    found = []
    for fdesc in desc.functions:
        if fdesc.name not in program.functions:
            raise InvalidModel(f"function {fdesc.name!r} is described but not in the program", pkg.model_path)
        fd = Model_pb2.FunctionDescription()
        fd.CopyFrom(fdesc)
        fd.name = ""
        found.append(SourceFunction(pkg, fdesc.name, fd))
    return found


def assign_names(functions: list[SourceFunction], names: list[str]) -> list[str]:
    if names and len(names) != len(functions):
        listing = ", ".join(f"{f.pkg.root.name}:{f.name}" for f in functions)
        raise UsageError(f"{len(names)} function name(s) given for {len(functions)} function(s) ({listing})")
    if not names:
        names = [f.name if f.pkg.spec.description.functions else f.pkg.root.stem for f in functions]
    seen: dict[str, SourceFunction] = {}
    for name, f in zip(names, functions):
        if not _IDENTIFIER.match(name):
            raise UsageError(
                f"function name {name!r} is not an identifier (letters, digits, '_'); pass --function-name", f.pkg.root
            )
        if name in seen:
            raise UsageError(f"duplicate function name {name!r} (also used for {seen[name].pkg.root})", f.pkg.root)
        seen[name] = f
    return names


def merge_packages(
    sources: list[Path],
    function_names: list[str],
    default_function: str | None,
    out: Path,
    options: ConvertOptions,
    tx: OutputTransaction,
) -> ConversionReport:
    """Write one multifunction .mlpackage at ``out`` from ``sources``; see the module docstring."""
    Model_pb2, _ = spec_protos()
    if not sources:
        raise UsageError("merge needs at least one source .mlpackage")
    out = Path(out)
    if out.suffix != ".mlpackage":
        raise UsageError("merge output must end in .mlpackage", out)
    resolved = {Path(s).resolve() for s in sources}
    if out.resolve() in resolved:
        raise UsageError("output would overwrite an input", out)
    pkgs = [read_package(Path(s)) for s in sources]
    functions = [f for pkg in pkgs for f in source_functions(pkg)]
    names = assign_names(functions, list(function_names))
    default = default_function if default_function is not None else names[0]
    if default not in names:
        raise UsageError(f"default function {default!r} is not one of the functions ({', '.join(names)})")

    report = ConversionReport(model=", ".join(str(s) for s in sources), format="coreml", outputs=[str(out)])
    spec = Model_pb2.Model()
    spec.specificationVersion = max([SPEC_VERSION_IOS18] + [p.spec.specificationVersion for p in pkgs])
    first = pkgs[0].spec
    spec.description.metadata.CopyFrom(first.description.metadata)
    spec.description.defaultFunctionName = default
    program = spec.mlProgram
    program.version = first.mlProgram.version
    for key in sorted(first.mlProgram.attributes):
        program.attributes[key].CopyFrom(first.mlProgram.attributes[key])

    opset = OPSETS.get(spec.specificationVersion)
    if opset is None:
        raise Unsupported(
            f"specification version {spec.specificationVersion} is newer than weightshare knows", pkgs[0].model_path
        )

    tmp = tx.new_dir(out)
    model_dir = tmp / "Data" / "com.apple.CoreML"
    (model_dir / WEIGHTS_NAME).mkdir(parents=True)
    fd = open_weight_file(model_dir / WEIGHTS_NAME / WEIGHT_FILE)
    try:
        relocator = BlobRelocator(WeightFileWriter(fd, options.align))
        for name, f in zip(names, functions):
            fdesc = spec.description.functions.add()
            fdesc.CopyFrom(f.description)
            fdesc.name = name
            func = program.functions[name]
            func.CopyFrom(f.pkg.spec.mlProgram.functions[f.name])
            relabel_opset(func, opset, f.pkg)
        # Collect after every function is in place: no map insertion after a reference is held.
        for name, f in zip(names, functions):
            relocator.collect(f.pkg, program.functions[name])
        relocator.write(report, options.progress)
        report.blob_bytes = relocator.writer.finish()
    finally:
        os.close(fd)

    model_id, weights_id = _item_ids(pkgs[0])
    manifest = {
        "fileFormatVersion": "1.0.0",  # what coremltools' ModelPackage writes
        "itemInfoEntries": {
            model_id: {
                "author": AUTHOR,
                "description": "CoreML Model Specification",
                "name": MODEL_NAME,
                "path": MODEL_ITEM,
            },
            weights_id: {
                "author": AUTHOR,
                "description": "CoreML Model Weights",
                "name": WEIGHTS_NAME,
                "path": WEIGHTS_ITEM,
            },
        },
        "rootModelIdentifier": model_id,
    }
    write_file(tmp / MANIFEST, dump_manifest(manifest))
    write_file(model_dir / MODEL_NAME, spec.SerializeToString(deterministic=True))
    extra = sum(len(p.items) - 1 - (p.weights_id is not None) for p in pkgs)
    if extra:
        report.notes.append(f"{extra} package item(s) other than the model spec and weights were not carried over")
    return report


# iOS16 ops whose inputs iOS18 redefined (attributes lut/indices/shape -> typed inputs): under the CoreML8 opset
# coremltools' loader rejects them ("Unknown input 'shape'"), so save_multifunction cannot merge them either.
REDEFINED_IN_IOS18 = {"constexpr_lut_to_dense", "constexpr_sparse_to_dense"}


def _op_types(block: MIL_pb2.Block, depth: int = 0) -> Iterator[str]:
    if depth > 64:
        return
    for op in block.operations:
        yield op.type
        for inner in op.blocks:
            yield from _op_types(inner, depth + 1)


IOS18_OPSET = 8  # "CoreML8"


def opset_number(name: str, pkg: Package) -> int:
    """``"CoreML10"`` -> 10. Opset names must be compared by number: as strings "CoreML10" < "CoreML8"."""
    match = re.fullmatch(r"CoreML(\d{1,4})", name)
    if match is None:
        raise Unsupported(f"unknown MIL opset {name!r}", pkg.model_path)
    return int(match.group(1))


def relabel_opset(func: MIL_pb2.Function, opset: str, pkg: Package) -> None:
    """Declare the function in the output's opset, as save_multifunction does.

    coremltools exports every function of a multifunction program with the opset of the
    output's specification version; ops keep their own form, which the newer opsets
    accept except for the iOS16 constexpr ops that iOS18 redefined.
    """
    if func.opset == opset:
        return
    if opset_number(func.opset, pkg) < IOS18_OPSET <= opset_number(opset, pkg):
        for block in func.block_specializations.values():
            old = sorted(REDEFINED_IN_IOS18.intersection(_op_types(block)))
            if old:
                raise Unsupported(
                    f"{', '.join(old)} in its {func.opset} form cannot be merged into an iOS18 "
                    "multifunction model (coremltools cannot either); re-export the model with "
                    "minimum_deployment_target=iOS18",
                    pkg.model_path,
                )
    if len(func.block_specializations) != 1 or func.opset not in func.block_specializations:
        raise Unsupported(
            f"function with {len(func.block_specializations)} block specializations "
            f"(opset {func.opset!r}) cannot be merged",
            pkg.model_path,
        )
    block = func.block_specializations[func.opset]
    func.block_specializations[opset].CopyFrom(block)
    del func.block_specializations[func.opset]
    func.opset = opset


def _item_ids(pkg: Package) -> tuple[str, str]:
    """Reuse the first source's identifiers, so merging one package keeps its manifest identity."""
    model_id = pkg.root_id
    weights_id = pkg.weights_id or stable_id(model_id, WEIGHTS_NAME)
    return model_id, weights_id
