"""The CLI parameters of the conversion options, derived from ``ConvertOptions``' field metadata (``Opt``): each
option's flag, help, panel, default and range are declared there once; nothing here names an option."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import typer

from .._format_options import unpack_help
from ..formats import registered
from ..options import Keyword, check_number, keywords_of

_F = TypeVar("_F", bound=Callable[..., Any])


def _bounds_callback(k: Keyword) -> Callable[[Any], Any] | None:
    """A number out of its declared range is a usage error (one line, exit 2) before anything is read."""
    bounds = k.opt.bounds
    if bounds is None:
        return None

    def check(value: Any) -> Any:
        from ..errors import UsageError

        flag = k.opt.flag or k.name
        try:
            check_number(flag, value, bounds)
        except UsageError as e:  # click names the option already: "Invalid value for '--flag': ..."
            raise typer.BadParameter(e.message.removeprefix(f"{flag} ")) from None
        return value

    return check


def _hints(command: str) -> dict[str, Any]:
    from .. import _option_keywords

    name = {"convert": "ConvertKeywords", "zoo": "ZooKeywords", "merge": "MergeKeywords"}[command]
    return typing.get_type_hints(getattr(_option_keywords, name))


def option(k: Keyword, annotation: Any, **overrides: Any) -> inspect.Parameter:
    """The typer parameter of one keyword (``overrides``: another help text or default, for a command that shares
    the option with other wording, e.g. ``check --inline-threshold``)."""
    is_list = typing.get_origin(k.opt.cli_type) is list
    help_text = k.opt.help.replace("``", "`")
    if k.field == "unpack":  # its values are what the registered formats declare (Format.options.unpack)
        help_text = unpack_help(registered())[1]
    settings: dict[str, Any] = {
        "help": help_text,
        "rich_help_panel": k.opt.panel,
        "metavar": k.opt.metavar,
        "callback": _bounds_callback(k),
    }
    settings.update(overrides)
    default = settings.pop("default", [] if is_list else k.default)
    assert k.opt.flag is not None
    info = typer.Option(default, k.opt.flag, **settings)
    return inspect.Parameter(k.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def shared_option(name: str, **overrides: Any) -> Any:
    """The typer default of the conversion option ``name`` for another command (``check --inline-threshold``)."""
    k = next(k for k in keywords_of() if k.name == name)
    return option(k, None, **overrides).default


def with_options(command: Literal["convert", "merge"]) -> Callable[[_F], _F]:
    """Give a command's ``**keywords`` one typer parameter per conversion option that has a flag, in the panels
    ``Opt`` names; the command receives them as the keywords of ``weightshare.convert`` / ``merge``."""

    def wrap(func: _F) -> _F:
        sig = inspect.signature(func, eval_str=True)
        fixed = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in sig.parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        hints = _hints(command)
        derived = [option(k, k.opt.cli_type or hints[k.name]) for k in keywords_of(command) if k.opt.flag is not None]
        func.__signature__ = sig.replace(parameters=fixed[:2] + derived + fixed[2:])  # type: ignore[attr-defined]
        return func

    return wrap
