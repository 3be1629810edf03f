"""The Typer app, its global options, and how errors become one line and an exit code.

Exit codes: 0 ok, 1 a check or verify found a problem, 2 bad input or usage.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, NoReturn

import typer
from typer import Abort
from typer.core import TyperCommand, TyperGroup

from ..errors import WeightshareError
from ._help import tagline
from ._render import VERBOSITY, err


def _click_exceptions() -> Any:
    """The click that typer parses with: its own copy in recent typer, the click package before."""
    try:
        return importlib.import_module("typer._click.exceptions")
    except ImportError:  # pragma: no cover -- older typer on click
        return importlib.import_module("click.exceptions")


_CLICK = _click_exceptions()


def _flags_without_placeholder(command: TyperCommand | TyperGroup, ctx: Any) -> None:
    """typer prints a ``<bool>`` type beside every flag, which takes no value: show none (an empty metavar)."""
    for param in command.get_params(ctx):
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""


class _Command(TyperCommand):
    def format_help(self, ctx: Any, formatter: Any) -> None:  # typer._click types: not public
        _flags_without_placeholder(self, ctx)
        super().format_help(ctx, formatter)


class _Group(TyperGroup):
    def format_help(self, ctx: Any, formatter: Any) -> None:  # typer._click types: not public
        _flags_without_placeholder(self, ctx)
        super().format_help(ctx, formatter)


# markdown: docstring paragraphs are reflowed to the terminal width (rich mode kept their hard line breaks, which
# then wrapped again into ragged one-word lines). Help text with <angle brackets> puts them in `code spans`:
# markdown takes a bare <digest12> for an HTML tag and drops it.
app = typer.Typer(
    cls=_Group,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
    help=tagline() + " The options -q, -v, --json and --format go before or after the command.",
)


def examples(*commands: str) -> str:
    """A command's epilog: its typical invocations, one per line (markdown: a fenced block keeps the lines)."""
    return "Examples:\n\n```\n" + "\n".join(commands) + "\n```"


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"weightshare {__version__}")
        raise typer.Exit(0)


@app.callback()
def _global(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    quiet_all: bool = typer.Option(
        False, "-q", "--quiet", help="Print nothing but errors, findings and requested JSON."
    ),
    verbose: bool = typer.Option(False, "-v", "--verbose", help="Print more detail (per-model tables, notes)."),
) -> None:
    """The group's own options (its help is the app's: the formats named from the registry)."""
    VERBOSITY["level"] = -1 if quiet_all else 1 if verbose else 0


# Set by main() from the command line's --json / --format: a failure is then one JSON document (or one `::error`
# annotation) on stdout too, the one line staying on stderr, so a script reading stdout never gets nothing.
JSON_ERRORS: dict[str, str | None] = {"command": None, "format": None}

FORMAT_HELP = "Output: text, json (same as --json) or github (workflow annotations: ::error, ::warning, ::notice)."


def output_format(as_json: bool, given: str, allowed: tuple[str, ...] = ("text", "json", "github")) -> str:
    """The command's output format: ``--json`` is ``--format json``; any other value is one usage line."""
    if given not in allowed:
        fail(f"--format takes {', '.join(allowed[:-1])} or {allowed[-1]}, got {given!r}")
    return "json" if as_json else given


def json_error(message: str, code: int) -> None:
    command, form = JSON_ERRORS["command"], JSON_ERRORS["format"]
    if command is not None and form == "json":
        from .._contract import error_document

        sys.stdout.write(json.dumps(error_document(command, message, code), ensure_ascii=True) + "\n")
        sys.stdout.flush()
    elif command is not None and form == "github":
        from .._contract import annotation

        sys.stdout.write(annotation("error", message, title=f"weightshare {command}".rstrip()) + "\n")
        sys.stdout.flush()


def asked_format(options: list[str]) -> str | None:
    """The output format the command line asks for: ``--json``, ``--format X`` or ``--format=X`` (None: text)."""
    form = None
    for i, a in enumerate(options):
        if a == "--json":
            return "json"
        if a.startswith("--format="):
            form = a.partition("=")[2]
        elif a == "--format" and i + 1 < len(options):
            form = options[i + 1]
    return "json" if form == "sarif" else form if form in ("json", "github") else None


def fail(message: str, code: int = 2) -> NoReturn:
    json_error(message, code)
    err.print(f"weightshare: error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


class Terminated(KeyboardInterrupt):
    """SIGTERM (timeout, docker stop, kill): unwound like Ctrl-C so that temporaries are removed."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def error_line(e: WeightshareError) -> str:
    """The one line of an input error; a path with nothing there reads ``no such file: PATH`` (the path last, as
    the shell says it), not the path's problem."""
    if e.message == "no such file" and e.path:
        return f"no such file: {e.path}"
    return e.line()


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn input problems into one line and exit code 2; never a traceback."""
    try:
        yield
    except WeightshareError as e:
        fail(error_line(e))
    except Terminated:
        fail("terminated; no output was left behind", 128 + signal.SIGTERM)
    except KeyboardInterrupt:
        fail("interrupted; no output was left behind", 130)
    except MemoryError:
        fail("out of memory")
    except OSError as e:
        fail(f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}")


def _pairs(items: list[str], option: str, what: str) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        name, sep, value = item.rpartition("=")
        if not sep or not name or not value:
            fail(f"{option} takes NAME={what}, got {item!r}")
        pairs.append((name, value))
    return pairs


# The global flags, accepted after the command too (`weightshare check -v MODEL`): every command honours them,
# and a user should not have to know which options belong to the group.
_GLOBAL_FLAGS = frozenset({"-v", "--verbose", "-q", "--quiet"})


def hoist_global_flags(args: list[str]) -> list[str]:
    """Move -v/-q given after the command in front of it (where the group parses them); ``--`` ends options."""
    end = args.index("--") if "--" in args else len(args)
    flags = [a for a in args[:end] if a in _GLOBAL_FLAGS]
    if not flags:
        return args
    return flags + [a for a in args[:end] if a not in _GLOBAL_FLAGS] + args[end:]


# The output options every command has: given before the command (`weightshare --json convert ...`), they are
# moved after it, where the command parses them.
_OUTPUT_FLAGS = frozenset({"--json"})
_OUTPUT_OPTIONS = frozenset({"--format"})


def sink_output_options(args: list[str]) -> list[str]:
    """Move --json / --format X given before the command to just after it (``--`` ends options)."""
    names = _command_names()
    moved: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args) and args[i] != "--":
        a = args[i]
        if a in names:
            return rest + [a] + moved + args[i + 1 :]
        if a in _OUTPUT_FLAGS or ("=" in a and a.partition("=")[0] in _OUTPUT_OPTIONS):
            moved.append(a)
        elif a in _OUTPUT_OPTIONS and i + 1 < len(args):
            moved += args[i : i + 2]
            i += 1
        else:
            rest.append(a)
        i += 1
    return args  # no command: click says what is wrong with the line as given


def _command_names() -> set[str]:
    return {info.name or (info.callback.__name__ if info.callback else "") for info in app.registered_commands}


def _command_name(args: list[str]) -> str:
    """The first argument that names a command, or "" (click leaves some errors without a context)."""
    names = _command_names()
    return next((a for a in args if a in names), "")


def _run_app(args: list[str]) -> int:
    """Run the app; a usage error is one ``weightshare: error:`` line and exit code 2, as every other error."""
    try:
        code = app(args=args, prog_name="weightshare", standalone_mode=False)
    except _CLICK.NoArgsIsHelpError as e:  # `weightshare` alone: the help, as click prints it
        if e.ctx is not None:
            print(e.ctx.get_help())
        return 2
    except _CLICK.UsageError as e:
        name = _command_name(args)
        command = e.ctx.command_path if e.ctx is not None else f"weightshare {name}".rstrip()
        message = e.format_message().rstrip(".")
        json_error(message, 2)
        err.print(f"weightshare: error: {message} (see '{command} -h')", markup=False, highlight=False, soft_wrap=True)
        return 2
    except Abort:  # Ctrl-C while typer itself reads the arguments
        raise KeyboardInterrupt from None
    return code if isinstance(code, int) else 0


def run(argv: list[str]) -> int:
    """One command line, as ``main`` runs it (without its process-wide set-up): its exit code."""
    args = sink_output_options(hoist_global_flags(argv))
    options = args[: args.index("--")] if "--" in args else args
    JSON_ERRORS["format"] = asked_format(options)
    JSON_ERRORS["command"] = _command_name(args) if JSON_ERRORS["format"] else None
    VERBOSITY["level"] = 0
    return _run_app(args)


def main() -> None:
    # A file size limit (RLIMIT_FSIZE, quota-like) must surface as an EFBIG write error that we clean up
    # after, not as a SIGXFSZ that kills the process and leaves temporaries behind.
    if hasattr(signal, "SIGXFSZ"):  # not on Windows
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _terminate)
    # Skip the interpreter's last full garbage collection at exit, which walks every object the imports made
    # (onnx, numpy, protobuf): about 0.1 CPU s of each command. Nothing weightshare does relies on it: files
    # and temporaries are closed and cleaned by the command itself.
    atexit.register(gc.freeze)
    # The command does no linear algebra: numpy's OpenBLAS need not start (and spin up) a thread per core when
    # numpy is imported (fp16 unpacking), about 0.03-0.05 CPU s. The command's own children inherit it; none of
    # them multiplies matrices with numpy either (ONNX Runtime and LiteRT have their own thread pools).
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if os.environ.get("WEIGHTSHARE_DEBUG"):
        sys.exit(run(sys.argv[1:]))
    try:
        sys.exit(run(sys.argv[1:]))
    except SystemExit:
        raise
    except KeyboardInterrupt as e:  # outside a command's own handling (argument parsing, imports)
        what = "terminated" if isinstance(e, Terminated) else "interrupted"
        err.print(f"weightshare: error: {what}; no output was left behind", markup=False, highlight=False)
        sys.exit(128 + signal.SIGTERM if isinstance(e, Terminated) else 130)
    except Exception as e:  # a bug in weightshare: still one line, and how to get the traceback
        json_error(f"internal error: {type(e).__name__}: {e}", 2)
        err.print(
            f"weightshare: internal error: {type(e).__name__}: {e} (set WEIGHTSHARE_DEBUG=1 for a traceback)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(2)


def dim_args(dim: list[str]) -> dict[str, int]:
    """``--dim NAME=VALUE`` options (verify and check)."""
    dims: dict[str, int] = {}
    for name, value in _pairs(dim, "--dim", "VALUE"):
        if not value.isdigit():  # 0 is a valid length: past_sequence_length=0 is a prefill step
            fail(f"--dim takes NAME=VALUE with a non-negative integer, got {name}={value!r}")
        dims[name] = int(value)
    return dims


def input_args(inputs: list[str]) -> dict[str, str]:
    """``--input NAME=FILE`` options (verify and check): name -> file, read by ``_verify.load_input``."""
    return dict(_pairs(inputs, "--input", "FILE.npy"))


def child_memory_option() -> Any:
    """``--child-memory`` of inspect, check and verify: the runtime children's memory bound (``_runtimes/bound.py``)."""
    return typer.Option(
        None,
        "--child-memory",
        min=1,
        metavar="MIB",
        help="Memory bound of the runtime child processes, in MiB (default: 2 x the largest model's mapped size "
        "+ 2 GiB + 128 MiB per CPU; docs/ci.md). A model over it is not measured (not verified), one line.",
    )


def set_child_memory(mib: int | None) -> None:
    """The children read their bound from the environment they inherit: the one place every command's children,
    and the Python API's, look (``WEIGHTSHARE_CHILD_MEMORY_MIB``)."""
    import os

    from .._runtimes.bound import ENV

    if mib is not None:
        os.environ[ENV] = str(mib)


def dim_option(lead: str = "") -> Any:
    """``--dim`` of verify and check (one text: help texts are documentation, format names included)."""
    return typer.Option(
        [],
        "--dim",
        help=lead + "Value of a symbolic input dimension, NAME=VALUE; '*=VALUE' "
        "sets every other dynamic dimension (TFLite dims have no names). Repeatable.",
    )


def input_option(lead: str = "") -> Any:
    """``--input`` of verify and check."""
    return typer.Option(
        [],
        "--input",
        help=lead + "Use real values for an input in every run: NAME=FILE.npy (or an ONNX TensorProto .pb); TFLite: "
        "SIGNATURE:NAME=FILE.npy for one signature only. Repeatable.",
    )
