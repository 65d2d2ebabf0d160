"""The typer app every command registers on, the exit codes, and the one place user errors become one line."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from prefixcache.cli import console
from prefixcache.core.errors import InputError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

app = typer.Typer(
    name="prefixcache",
    help="Prefix caching for LLM inference: simulate hit rates on traces and scenarios, plan capacity, replay "
    "them through a model (cached vs uncached TTFT, output check), and render reports.\n\n"
    "Examples:\n\n"
    "  prefixcache simulate scenarios/chat.yaml --capacity 4096 --capacity 16384 --json run.json\n\n"
    "  prefixcache simulate trace.jsonl --capacity-blocks 1000 --capacity unlimited\n\n"
    "  prefixcache explain scenarios/dated_system_prompt.yaml --top 5\n\n"
    "  prefixcache plan scenarios/mooncake_conversation.yaml --html plan.html\n\n"
    "  prefixcache replay scenarios/shared_prompt.yaml --json run.json\n\n"
    "  prefixcache report run.json --html run.html --markdown run.md",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


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
