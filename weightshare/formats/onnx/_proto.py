"""ONNX's protobuf classes without ``import onnx``.

``import onnx`` costs about 0.6 CPU s, nearly all of it ``ml_dtypes`` pulled in through ``onnx.helper``; the
conversion only needs the generated message classes in ``onnx/onnx_ml_pb2.py`` (0.02 s). That file is executed
here under a private module name. protobuf keeps one message class per descriptor in its default pool, so a later
``import onnx`` (by the user, or by the ``--prepack`` path) executes the same file again and gets the very same
classes: ``onnx.ModelProto is pb.ModelProto``, and models pass freely between the two.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

__all__ = ["load_model", "pb", "read_tensor_proto"]

_PRIVATE_NAME = "weightshare.formats.onnx._onnx_ml_pb2"


def _load() -> ModuleType:
    loaded = sys.modules.get("onnx.onnx_ml_pb2") or sys.modules.get(_PRIVATE_NAME)
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("onnx")  # locates the package without executing its __init__
    if package is None or not package.submodule_search_locations:
        raise ImportError("the onnx package is not installed")
    path = Path(next(iter(package.submodule_search_locations))) / "onnx_ml_pb2.py"
    spec = importlib.util.spec_from_file_location(_PRIVATE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_PRIVATE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_PRIVATE_NAME]
        raise
    return module


if TYPE_CHECKING:
    from onnx import onnx_ml_pb2 as pb
else:
    pb = _load()


def load_model(path: str | Path) -> pb.ModelProto:
    """The model file at ``path`` parsed, its external data left where it is (``onnx.load(path,
    load_external_data=False)`` without ``import onnx``)."""
    model = pb.ModelProto()
    model.ParseFromString(Path(path).read_bytes())
    return model


def read_tensor_proto(path: Path) -> Any:
    """A serialized ONNX TensorProto (``verify --input NAME=FILE.pb``) as a numpy array."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.TensorProto()
    proto.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(proto)
