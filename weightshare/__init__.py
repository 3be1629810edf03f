"""weightshare: rewrite model files so their weights are memory-mapped once and shared."""

from .api import convert
from .blob import AlignPolicy
from .errors import InvalidModel, UnsafePath, Unsupported, WeightshareError
from .options import ConvertOptions
from .report import ConversionReport

__all__ = [
    "convert",
    "AlignPolicy",
    "ConvertOptions",
    "ConversionReport",
    "WeightshareError",
    "InvalidModel",
    "Unsupported",
    "UnsafePath",
]
__version__ = "0.1.0"
