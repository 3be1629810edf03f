"""ONNX: a protobuf wire-level scanner, Cast folding, and the rewrite to external data."""
