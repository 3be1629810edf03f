"""Write ``weightshare/_option_keywords.py``: the public functions' keyword options as TypedDicts, generated from
``ConvertOptions``' field metadata (the one declaration of each option).

Run after adding or changing a ``ConvertOptions`` field: ``python scripts/gen_option_keywords.py``.
``tests/test_option_declarations.py`` fails while the file is not current.
"""

from __future__ import annotations

from pathlib import Path

from weightshare.options import render_keywords

TARGET = Path(__file__).resolve().parent.parent / "weightshare" / "_option_keywords.py"

if __name__ == "__main__":
    TARGET.write_text(render_keywords())
    print(f"wrote {TARGET}")
