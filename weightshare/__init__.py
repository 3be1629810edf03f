"""weightshare: rewrite model files so their weights are memory-mapped once and shared.

The public API is what ``__all__`` lists here, plus the loaders in ``weightshare.ort`` and
``weightshare.litert`` and the ``Format`` extension point in ``weightshare.formats``; every other
module is internal and may change without notice.

Example:
    >>> import weightshare
    >>> report = weightshare.convert("model.onnx", "out/", prepack=True)
    >>> weightshare.verify("model.onnx", "out/model.onnx").passed
    True

Names are imported on first use (``__getattr__``): ``import weightshare`` and ``weightshare --version``
load neither numpy nor onnx.
"""

import importlib as _importlib
import sys as _sys
from importlib.util import find_spec as _find_spec
from types import ModuleType as _ModuleType
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from .errors import InvalidModel, OutputError, UnsafePath, Unsupported, UsageError, WeightshareError

if _TYPE_CHECKING:
    from ._folder import FolderReport
    from ._placement import AlignPolicy
    from .api import CheckReport, check, convert, convert_folder, convert_many, convert_zoo, inspect, merge, verify
    from .findings import Finding, Severity
    from .inventory import ModelInventory, PayloadInfo
    from .options import ConvertOptions, Unpack
    from .report import ConversionReport, ZooReport
    from .verify import OriginalFails, VerifyReport

__all__ = [
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
]
__version__ = "0.1.0"

# name -> the module that defines it
_LAZY = {
    "AlignPolicy": "_placement",
    "CheckReport": "api",
    "ConversionReport": "report",
    "ConvertOptions": "options",
    "Finding": "findings",
    "FolderReport": "_folder",
    "ModelInventory": "inventory",
    "OriginalFails": "verify",
    "PayloadInfo": "inventory",
    "Severity": "findings",
    "Unpack": "options",
    "VerifyReport": "verify",
    "ZooReport": "report",
    "check": "api",
    "convert": "api",
    "convert_folder": "api",
    "convert_many": "api",
    "convert_zoo": "api",
    "inspect": "api",
    "merge": "api",
    "verify": "api",
}


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        # `import weightshare; weightshare.ort.session(...)`: a submodule is loaded on first access as well
        if _find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return _importlib.import_module(f".{name}", __name__)
    value = getattr(_importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups do not come here again
    return value


def __dir__() -> list[str]:
    return sorted(__all__)  # the public names; the rest of the package namespace is internal


# Functions that share their name with an internal module (weightshare/check.py, weightshare/verify.py).
_NAMED_LIKE_A_MODULE = frozenset({"check", "verify"})


class _Package(_ModuleType):
    """Keeps ``weightshare.check`` and ``weightshare.verify`` the functions.

    After loading a submodule the import system sets it as an attribute of its package, which would replace the
    function ``weightshare.check`` by the module ``weightshare.check`` as soon as anything imported that module.
    The modules stay importable by their full names (``from weightshare.check import find_models``): they are
    in ``sys.modules``.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name in _NAMED_LIKE_A_MODULE and isinstance(value, _ModuleType):
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
