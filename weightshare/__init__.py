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
from importlib.util import find_spec as _find_spec
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from ._version import __version__
from .errors import InvalidModel, OutputError, UnsafePath, Unsupported, UsageError, WeightshareError

if _TYPE_CHECKING:
    from ._findings import Finding, Severity
    from ._folder import FolderReport
    from ._inventory import ModelInventory, PayloadInfo
    from ._placement import AlignPolicy
    from ._verify import OriginalFails, VerifyReport
    from .api import CheckReport, check, convert, convert_folder, convert_many, convert_zoo, inspect, merge, verify
    from .options import ConvertOptions, Unpack
    from .report import ConversionReport, ZooReport

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

# name -> the module that defines it
_LAZY = {
    "AlignPolicy": "_placement",
    "CheckReport": "api",
    "ConversionReport": "report",
    "ConvertOptions": "options",
    "Finding": "_findings",
    "FolderReport": "_folder",
    "ModelInventory": "_inventory",
    "OriginalFails": "_verify",
    "PayloadInfo": "_inventory",
    "Severity": "_findings",
    "Unpack": "options",
    "VerifyReport": "_verify",
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
