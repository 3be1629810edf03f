"""The options that are a format's own (``Format.options``), seen from shared code: checked and described from
what the formats declare, without naming one."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .errors import UsageError

if TYPE_CHECKING:
    from .formats.base import Format


def unpack_values(formats: Iterable[Format]) -> dict[str, str]:
    """Every ``--unpack`` value the formats declare, with its help text, in registry order."""
    values: dict[str, str] = {}
    for fmt in formats:
        for value, text in fmt.options.unpack.items():
            values.setdefault(value, text)
    return values


def check_unpack(unpack: Iterable[str], keep_packed: bool, formats: Sequence[Format]) -> None:
    """Refuse an ``--unpack`` value no format declares (naming the formats that declare some), and one its
    formats declare contradicted by ``--keep-packed``."""
    unknown = sorted(v for v in unpack if not any(v in f.options.unpack for f in formats))
    if unknown:
        known = "; ".join(
            f"{f.name}: {', '.join(repr(v) for v in f.options.unpack)}" for f in formats if f.options.unpack
        )
        raise UsageError(f"unknown --unpack value {', '.join(unknown)}: no registered format declares it ({known})")
    if keep_packed:
        for value in sorted(unpack):
            if any(value in f.options.unpack_excludes_keep_packed for f in formats):
                raise UsageError(f"--unpack {value} and --keep-packed exclude each other")


def unpack_help(formats: Iterable[Format]) -> tuple[str, str]:
    """The CLI's ``--unpack`` metavar and help text: each declared value with what its format says it does."""
    values = unpack_values(formats)
    return "|".join(values), "Opt-in unpacking: " + " ".join(f"'{v}' ({text})." for v, text in values.items())
