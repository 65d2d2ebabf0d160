"""The one module that owns the terminal: results go to stdout, errors, status lines and progress to stderr."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from prefixcache.core.errors import InputError

console = Console()
err_console = Console(stderr=True)


def error(message: str) -> None:
    """Print a user-facing error (no traceback) to stderr, on one line."""
    one_line = " ".join(message.splitlines())
    err_console.print(f"[bold red]error:[/] {escape(one_line)}", highlight=False, soft_wrap=True, markup=True)


def info(message: str) -> None:
    """Print a short status line to stderr (keeps stdout for results)."""
    err_console.print(message, highlight=False, soft_wrap=True, markup=False)


def show(renderable: Any, *, to_stderr: bool = False) -> None:
    """Print a result (a rich Table, plain text: no markup) to stdout, or to stderr when stdout carries an
    output file.

    Raises InputError when stdout cannot be written (e.g. a full disk); a closed pipe propagates."""
    try:
        (err_console if to_stderr else console).print(renderable, markup=False, highlight=False)
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise InputError(f"cannot write to standard output: {exc.strerror or exc}") from None


class RunProgress:
    """A progress bar per replay with the running token hit rate (updates throttled to ~200 per replay)."""

    def __init__(self, progress: Progress, label: Any) -> None:
        self.p, self.label = progress, label
        self.task: Any = None
        self.every = self.n = self.prompt = self.cached = 0

    @property
    def on_row(self) -> Any:
        """The per-request callback to hand a replay: ``row``, or None when nothing is shown (saves a call)."""
        return None if self.p.disable else self.row

    def start(self, capacity: Any, total: int) -> None:
        """A new replay begins (``capacity`` is labelled with ``label(capacity)``)."""
        self.close()
        self.task = self.p.add_task(self.label(capacity), total=total, hit="—")
        self.every, self.n, self.prompt, self.cached = max(1, total // 200), 0, 0, 0

    def row(self, row: Any, cache: Any = None) -> None:
        """One request served (a ``prefixcache.sim.results.Row``)."""
        self.n += 1
        if not row.warmup:
            self.prompt += row.prompt_tokens
            self.cached += row.cached_tokens
        if self.n % self.every == 0:
            self._update()

    def _update(self) -> None:
        hit = f"{self.cached / self.prompt:.1%}" if self.prompt else "—"
        self.p.update(self.task, completed=self.n, hit=hit)

    def close(self) -> None:
        if self.task is not None:
            self._update()


@contextmanager
def run_progress(enabled: bool, label: Any) -> Iterator[RunProgress]:
    """A RunProgress on stderr; shows nothing when disabled or when stderr is not a terminal."""
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
        rp = RunProgress(p, label)
        try:
            yield rp
        finally:
            rp.close()
