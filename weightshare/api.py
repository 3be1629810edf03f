"""The Python API; the CLI is a thin layer over these functions (re-exported by ``weightshare``).

Example:
    import weightshare
    report = weightshare.convert("model.onnx", "out/")
    print(report.bytes_written, report.ops_removed)
"""

from __future__ import annotations

from ._convert_api import convert, convert_folder, convert_many, convert_zoo, merge
from ._inspect_api import CheckReport, check, inspect, verify

__all__ = [
    "CheckReport",
    "check",
    "convert",
    "convert_folder",
    "convert_many",
    "convert_zoo",
    "inspect",
    "merge",
    "verify",
]

# Defined in private modules by job (_convert_api, _zoo_api, _inspect_api); their public home is this module.
for _public in (CheckReport, check, convert, convert_folder, convert_many, convert_zoo, inspect, merge, verify):
    _public.__module__ = __name__
del _public
