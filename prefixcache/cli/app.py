"""The typer app every command registers on, the exit codes, and the one place user errors become one line.

The modules that define commands do not use ``from __future__ import annotations``: typer reads every
command's signature on every invocation, and evaluating string annotations made that about 13 ms of each run
instead of 4 (``tests/test_cli.py`` checks it)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Annotated, Any, NoReturn, TypeVar

import typer
import typer.core
from typer.core import TyperGroup

try:  # typer >= 0.20 carries its own copy of click; older versions use click itself
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors  # type: ignore[no-redef]

from prefixcache._version import __version__
from prefixcache.cli import console
from prefixcache.core.errors import InputError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class OneLineErrors(TyperGroup):
    """The app's click group: a usage error that click finds itself (an unknown option, a value of the wrong
    type, a missing argument) prints one ``error:`` line, like every other user error, instead of a panel."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_errors.NoArgsIsHelpError as exc:  # the help was printed
            sys.exit(exc.exit_code)
        except click_errors.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            _fail(exc.format_message().rstrip(".") + hint, exc.exit_code)
        except click_errors.ClickException as exc:
            _fail(exc.format_message(), exc.exit_code)
        except typer.Abort:
            _fail("aborted", 1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _fail(message: str, code: int) -> NoReturn:
    console.error(" ".join(message.split()))
    sys.exit(code)


app = typer.Typer(
    name="prefixcache",
    help="Prefix caching for LLM inference: simulate hit rates on traces and scenarios, plan capacity, replay "
    "them through a model (cached vs uncached TTFT, output check), and render reports.\n\n"
    "Examples:\n\n"
    "  prefixcache simulate scenarios/chat.yaml --capacity 4096 --capacity 16384 --json run.json\n\n"
    "  prefixcache simulate trace.jsonl --capacity-blocks 1000 --capacity unlimited\n\n"
    "  prefixcache explain scenarios/dated_system_prompt.yaml --top 5\n\n"
    "  prefixcache plan scenarios/mooncake_conversation.yaml --html plan.html\n\n"
    "  prefixcache replay scenarios/chat.yaml --json runs/run.json\n\n"
    "  prefixcache report runs/run.json --html runs/run.html --markdown runs/run.md\n\n"
    "  prefixcache serve --model tiny --port 8000",
    no_args_is_help=True,
    add_completion=False,
    cls=OneLineErrors,
    pretty_exceptions_show_locals=False,
)


def _flags_show_no_type() -> None:
    """typer's rich help prints a type beside every option, flags included (``--help <bool>``); a flag takes no
    value, so show none for flags (the patch is idempotent and skipped on typer versions without the method)."""
    option = getattr(typer.core, "TyperOption", None)
    original = getattr(option, "display_type_rich", None)
    if option is None or original is None or getattr(original, "flags_show_no_type", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> Any:
        if getattr(self, "is_flag", False) or getattr(self, "count", False):
            return None
        return original(self, ctx)

    display_type_rich.flags_show_no_type = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich


_flags_show_no_type()


def _print_version(value: bool) -> None:
    if value:
        console.show(f"prefixcache {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """The group's own options (--version); each command's are its own."""


class UsageError(Exception):
    """A user error found by the CLI itself (a bad option value)."""


F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Turn InputError / UsageError into one red line and exit 2; Ctrl-C before any result into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (InputError, UsageError) as exc:
            console.error(str(exc))
            raise typer.Exit(EXIT_USAGE) from None
        except KeyboardInterrupt:
            console.info("interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper  # type: ignore[return-value]


def interrupted() -> typer.Exit:
    """Report an interrupted run (its partial results were written) and return the exit to raise."""
    console.info("interrupted: the run is partial")
    return typer.Exit(EXIT_INTERRUPTED)
