"""TFLite / LiteRT: weights appended page-aligned after the flatbuffer (or in an external blob), fp16 DEQUANTIZE folded.

Modules: ``flatbuf`` (bounds-checked scan over mmap), ``graph`` (validation, fp16 folds),
``convert`` (plan, write, emit).
"""
