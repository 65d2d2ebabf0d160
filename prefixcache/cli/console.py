"""The one module that owns the rich console: tables and messages go to stdout, errors and progress to stderr."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console()
err_console = Console(stderr=True)


def error(message: str) -> None:
    """Print a user-facing error (no traceback) to stderr."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)


def info(message: str) -> None:
    """Print a short status line to stderr (keeps stdout for results)."""
    err_console.print(message, highlight=False, soft_wrap=True)


@contextmanager
def progress(enabled: bool = True) -> Iterator[Progress]:
    """A progress display with a ``hit`` field (running hit rate); shows nothing when disabled or not a TTY."""
    enabled = enabled and err_console.is_terminal
    p = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("token hit rate {task.fields[hit]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        disable=not enabled,
        transient=False,
    )
    with p:
        yield p
