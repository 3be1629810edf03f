"""ONNX Runtime's own machinery: pre-packing (``--prepack``), the ``--unpack ort-cpu`` rewrite, and what they need.

The ONNX format's conversion (``formats/onnx/convert.py``) writes a model ONNX Runtime maps; the modules here run
ONNX Runtime itself on it, in bounded children: ``prepack`` (the packed blob and its record, ``prepack_record``),
``segments`` + ``child`` (the graph optimized in segments), ``cpu`` (the ort-cpu rewrite and its rounding check),
``reload`` (the written model reloaded), ``probe`` + ``verdict`` (what a loader checks before trusting a packed blob),
``limits`` (the children's bounds), ``fold_bound`` (constant folding refused beyond the model's size), ``types``.
Internal, as the whole format folder is.
"""
