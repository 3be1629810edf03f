"""Help texts built from what the code knows, not written beside it: the formats from the registry (a format added
by its registry line is named in every command's help), the runtime settings from the formats' ``settings``.

Built when the commands are defined (``weightshare.cli`` imports them on first use), from the formats registered
then: the built-in ones, and any a program registered before it loaded the CLI.
"""

from __future__ import annotations

from ..formats import registered


def _either(items: list[str], conjunction: str) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {conjunction} {items[-1]}"


def format_titles(conjunction: str = "and") -> str:
    """Every registered format by its title: "TFLite, ExecuTorch, Core ML and ONNX"."""
    return _either([fmt.title for fmt in registered()], conjunction)


def model_kinds() -> str:
    """Every registered format with the suffixes its models have: "TFLite (.tflite), ... or ONNX (.onnx)"."""
    return _either([f"{fmt.title} ({', '.join(fmt.suffixes)})" for fmt in registered()], "or")


def setting_ids() -> str:
    """Every runtime setting id `check --target` accepts (each format's ``settings``), comma separated."""
    return ", ".join(s for fmt in registered() for s in fmt.settings)


def tagline() -> str:
    """What weightshare does, naming the formats (the group's help)."""
    return (
        f"Rewrite {format_titles()} models so that their weights are memory-mapped once and shared by every "
        "session, interpreter, function and process."
    )
