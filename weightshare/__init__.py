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

from . import errors as _errors
from ._version import __version__ as __version__
from .errors import InvalidModel as InvalidModel
from .errors import OutputError as OutputError
from .errors import UnsafePath as UnsafePath
from .errors import Unsupported as Unsupported
from .errors import UsageError as UsageError
from .errors import WeightshareError as WeightshareError

if _TYPE_CHECKING:  # what type checkers see of the lazy names below (``as``: an explicit re-export)
    from ._findings import Finding as Finding
    from ._findings import Severity as Severity
    from ._folder import FolderReport as FolderReport
    from ._inventory import ModelInventory as ModelInventory
    from ._inventory import PayloadInfo as PayloadInfo
    from ._placement import AlignPolicy as AlignPolicy
    from ._verify import OriginalFails as OriginalFails
    from ._verify import VerifyReport as VerifyReport
    from .api import CheckReport as CheckReport
    from .api import check as check
    from .api import convert as convert
    from .api import convert_folder as convert_folder
    from .api import convert_many as convert_many
    from .api import convert_zoo as convert_zoo
    from .api import inspect as inspect
    from .api import merge as merge
    from .api import verify as verify
    from .options import ConvertOptions as ConvertOptions
    from .options import Unpack as Unpack
    from .report import ConversionReport as ConversionReport
    from .report import ZooReport as ZooReport

# The public names imported on first use: name -> the module that defines it. With the errors and the version
# above, these are the public API (``__all__``); tests/test_public_api.py holds the block above equal to them.
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

__all__ = sorted(["__version__", *_errors.__all__, *_LAZY])


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
