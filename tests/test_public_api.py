"""The public API: what ``weightshare`` and its public modules export, pinned so it changes only on purpose.

Before: the package, imported fresh in child processes where start-up matters.
Under test: ``__all__`` of every public module, the docstrings of the public functions, ``weightshare.convert``'s
keyword options (the CLI's), ``py.typed``, and which heavy modules a command imports.
After: a change to the surface fails here until this file says it is intended.
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

import weightshare
from weightshare import ConvertOptions, UsageError
from weightshare._samples import mlp_onnx

ROOT = Path(__file__).resolve().parent.parent

# Every public module and its __all__. A name added or removed here is a change of the public API.
PUBLIC = {
    "weightshare": [
        "AlignPolicy",
        "CheckReport",
        "ConversionReport",
        "ConvertOptions",
        "Finding",
        "FolderReport",
        "InvalidModel",
        "ModelInventory",
        "OriginalFails",
        "OutputError",
        "PayloadInfo",
        "Severity",
        "UnsafePath",
        "Unpack",
        "Unsupported",
        "UsageError",
        "VerifyReport",
        "WeightshareError",
        "ZooReport",
        "__version__",
        "check",
        "convert",
        "convert_folder",
        "convert_many",
        "convert_zoo",
        "inspect",
        "merge",
        "verify",
    ],
    "weightshare.api": [
        "CheckReport",
        "check",
        "convert",
        "convert_folder",
        "convert_many",
        "convert_zoo",
        "inspect",
        "merge",
        "verify",
    ],
    "weightshare.errors": [
        "InvalidModel",
        "OutputError",
        "UnsafePath",
        "Unsupported",
        "UsageError",
        "WeightshareError",
    ],
    "weightshare.options": ["BLOB_GRACE_S", "INLINE_THRESHOLD", "ConvertOptions", "Unpack"],
    "weightshare.report": ["ConversionReport", "JsonDict", "ZooReport"],
    "weightshare.formats": [
        "BenchRuntime",
        "BlobContainer",
        "BlobFile",
        "Format",
        "FormatOptions",  # a format's own options (Format.options)
        "converter",
        "detect",
        "detect_format",
        "get",
        "model_suffixes",
        "register",
        "registered",
        "safetensors_container",
        "unregister",
    ],
    "weightshare.formats.base": [
        "BenchRuntime",
        "BlobContainer",
        "BlobFile",
        "Decodes",
        "Format",
        "FormatDefaults",
        "FormatOptions",
        "KeepsAsIs",
        "MeasuresCopies",
        "MeasuresSettings",
        "MeasurementKey",
        "QuietExit",
        "ReadsInputs",
        "SharesPrepared",
    ],
}

# The loaders: runtime-specific by name, public like the package's own functions; pinned and documented like them.
LOADERS = {
    "weightshare.ort": [
        "KEEPS_PACKED",
        "METADATA_KEY",
        "check_packed_payloads",
        "envelope_problem",
        "malloc_trim",
        "mismatch",
        "prepack_info",
        "session",
        "this_machine",
    ],
    "weightshare.litert": ["SharedInterpreter", "compiled_model", "find_cache", "interpreter"],
    "weightshare.genai": ["decoder_file", "model"],
    "weightshare.executorch": ["SharedProgram", "program"],
}

# The functions users call directly document all four sections (safetensors' style).
TOP_LEVEL_SECTIONS = ("Args:", "Returns:", "Raises:", "Example:")


@pytest.mark.parametrize("module", sorted({**PUBLIC, **LOADERS}))
def test_public_module_all_is_pinned(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted({**PUBLIC, **LOADERS}[module])
    for name in mod.__all__:
        assert getattr(mod, name) is not None, f"{module}.{name} does not resolve"


def test_what_type_checkers_see_of_the_lazy_names_is_the_lazy_table():
    """``weightshare`` imports its public names on first use (``_LAZY``); type checkers read the
    ``if TYPE_CHECKING:`` block instead: the two must name the same things from the same modules."""
    import ast

    tree = ast.parse(Path(weightshare.__file__).read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "_TYPE_CHECKING"]
    seen = {
        a.asname or a.name: (n.module or "").split(".")[-1]
        for n in block.body
        if isinstance(n, ast.ImportFrom)
        for a in n.names
    }
    assert seen == weightshare._LAZY
    assert all(a.asname == a.name for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names)


def _public_functions():
    for module, names in {**PUBLIC, **LOADERS}.items():
        mod = importlib.import_module(module)
        for name in names:
            obj = getattr(mod, name)
            if inspect.isfunction(obj):
                yield f"{module}.{name}", obj


@pytest.mark.parametrize("qualname,func", list(_public_functions()), ids=lambda x: x if isinstance(x, str) else "")
def test_public_functions_document_their_arguments(qualname, func):
    doc = inspect.getdoc(func) or ""
    params = [p for p in inspect.signature(func).parameters.values() if p.name not in ("self", "cls")]
    if params:
        assert "Args:" in doc, f"{qualname}: no Args section"
        missing = [p.name for p in params if f"{p.name}:" not in doc]
        assert not missing, f"{qualname}: arguments not documented: {missing}"
    if inspect.signature(func).return_annotation not in ("None", None):
        assert "Returns:" in doc, f"{qualname}: no Returns section"
    if qualname.startswith("weightshare.") and qualname.count(".") == 1:
        for section in TOP_LEVEL_SECTIONS:
            assert section in doc, f"{qualname}: no {section} section"


def test_public_classes_have_docstrings():
    for module, names in PUBLIC.items():
        mod = importlib.import_module(module)
        for name in names:
            obj = getattr(mod, name)
            if inspect.isclass(obj):
                assert (obj.__doc__ or "").strip(), f"{module}.{name} has no docstring"


def test_the_package_namespace_shows_only_the_public_names():
    assert dir(weightshare) == sorted(PUBLIC["weightshare"])
    leaked = [n for n in vars(weightshare) if not n.startswith("_") and n not in PUBLIC["weightshare"]]
    submodules = {n for n in leaked if isinstance(getattr(weightshare, n), types.ModuleType)}  # loaded submodules
    assert set(leaked) == submodules, f"not public, not private by name: {set(leaked) - submodules}"


def test_check_and_verify_stay_functions_when_their_modules_are_imported():
    # the modules behind them are private by name (weightshare._check, weightshare._verify): importing them sets
    # weightshare._check, never the function weightshare.check
    importlib.import_module("weightshare._check")
    importlib.import_module("weightshare._verify")
    assert inspect.isfunction(weightshare.check) and inspect.isfunction(weightshare.verify)
    assert weightshare.check.__module__ == "weightshare.api"


def test_convert_takes_keyword_options(tmp_path):
    src = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=64)
    by_keyword = weightshare.convert(src, tmp_path / "a", keep_packed=True, inline_threshold=64)
    by_object = weightshare.convert(src, tmp_path / "b", ConvertOptions(keep_packed=True, inline_threshold=64))
    for a, b in zip(by_keyword.outputs, by_object.outputs):
        assert Path(a).name == Path(b).name and Path(a).read_bytes() == Path(b).read_bytes()
    assert by_keyword.unpacked == 0
    with pytest.raises(UsageError, match="not both"):
        weightshare.convert(src, tmp_path / "c", ConvertOptions(), keep_packed=True)


def test_one_unpack_value_is_a_value_not_its_characters(tmp_path):
    """`unpack="ort-cpu"` from Python was split into {"o", "r", "t", ...} and refused as unknown values."""
    assert ConvertOptions(unpack="ort-cpu").unpack == frozenset({"ort-cpu"})  # type: ignore[arg-type]
    assert ConvertOptions(unpack=[weightshare.options.Unpack.ORT_CPU]).unpack == frozenset({"ort-cpu"})  # type: ignore[arg-type]
    src = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=64)
    with pytest.raises(UsageError, match="unknown --unpack value nonesuch"):
        weightshare.convert(src, tmp_path / "a", unpack="nonesuch")
    by_string = weightshare.convert(src, tmp_path / "b", unpack="ort-cpu")
    by_list = weightshare.convert(src, tmp_path / "c", unpack=["ort-cpu"])
    assert [Path(o).read_bytes() for o in by_string.outputs] == [Path(o).read_bytes() for o in by_list.outputs]


@pytest.mark.slow
def test_convert_prepack_keyword(tmp_path):
    src = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=64, weights="float32")
    report = weightshare.convert(src, tmp_path / "out", prepack=True)
    assert any(o.endswith(".portable.onnx") for o in report.outputs)


def test_py_typed_ships():
    assert (ROOT / "weightshare" / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["weightshare"]


def _imported_by(code: str) -> list[str]:
    heavy = ("onnx", "ml_dtypes", "numpy", "typer", "rich", "onnxruntime")
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {heavy!r} if m in sys.modules]))"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_import_and_convert_load_only_what_they_need(tmp_path):
    """Start-up time: `import onnx` alone costs ~0.6 CPU s (ml_dtypes, through onnx.helper)."""
    assert _imported_by("import weightshare") == []
    # submodules load on first attribute access, as when the package imported them eagerly
    assert _imported_by("import weightshare\nassert callable(weightshare.api.convert_zoo)") == []
    src = mlp_onnx(tmp_path / "m.onnx", layers=1, dim=64, weights="float32")
    api = _imported_by(f"import weightshare; weightshare.convert({str(src)!r}, {str(tmp_path / 'o')!r})")
    assert api == []  # an fp32 model needs neither onnx's helpers nor numpy
    cli = _imported_by(
        "import sys\nfrom weightshare.cli import main\n"
        f"sys.argv = ['weightshare', 'convert', {str(src)!r}, '-o', {str(tmp_path / 'c')!r}, '-q']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code"
    )
    assert "onnx" not in cli and "ml_dtypes" not in cli and "numpy" not in cli
    for command in ("inspect", "check"):  # the static figures: no onnx (ml_dtypes alone is ~1 CPU s with 0.7)
        gate = _imported_by(
            "import sys\nfrom weightshare.cli import main\n"
            f"sys.argv = ['weightshare', {command!r}, {str(src)!r}, '--no-measure']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code"
        )
        assert "onnx" not in gate and "ml_dtypes" not in gate, (command, gate)
    # the measuring child's own reading of the model
    child = _imported_by(
        f"from weightshare.formats.onnx.indices import model_index_bounds\nmodel_index_bounds({str(src)!r})"
    )
    assert "onnx" not in child and "ml_dtypes" not in child


def test_protobuf_classes_are_onnx_own(tmp_path):
    """The classes loaded without `import onnx` are the very classes of a later `import onnx`."""
    code = (
        "from weightshare.formats.onnx._proto import pb\nimport onnx\n"
        "assert pb.ModelProto is onnx.ModelProto and pb.TensorProto is onnx.TensorProto\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
