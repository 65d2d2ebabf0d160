"""The ``prefixcache`` command: a thin layer that validates options and hands off.

simulate (model-free), replay (through a model; engine is imported lazily, only there), report, and
``plan`` (prefixcache/plan_cli.py, when present). User errors print one clear line and exit with code 2;
Ctrl-C stops a run cleanly, writes the partial run (marked ``"partial": true``) and exits with 130.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer

from prefixcache.cli import console
from prefixcache.cli import serve as serve_cli
from prefixcache.core.errors import InputError
from prefixcache.core.eviction import POLICIES
from prefixcache.reports.record import RunResult, build_record, load_record, save_record
from prefixcache.reports.run_report import summary_table, to_html, to_markdown
from prefixcache.sim.replay import DEFAULT_BLOCK_SIZE, Capacity, warmup_count
from prefixcache.sim.replay import simulate as run_simulation
from prefixcache.workload.scenario import Scenario, load_scenario, parse_capacity
from prefixcache.workload.trace import is_trace_path, load_trace

app = typer.Typer(
    name="prefixcache",
    help="Prefix caching for LLM inference: simulate hit rates on traces and scenarios, replay them through a "
    "model (cached vs uncached TTFT, output check), and render reports.\n\n"
    "Examples:\n\n"
    "  prefixcache simulate scenarios/chat.yaml --capacity 4096 --capacity 16384 --json run.json\n\n"
    "  prefixcache simulate trace.jsonl --capacity-blocks 1000 --capacity unlimited\n\n"
    "  prefixcache replay scenarios/shared_prompt.yaml --json run.json\n\n"
    "  prefixcache report run.json --html run.html --markdown run.md",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A user error found by the CLI itself (bad option value)."""


def user_errors(fn: Callable) -> Callable:
    """Turn InputError / UsageError into one red line and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (InputError, UsageError) as exc:
            console.error(str(exc))
            raise typer.Exit(EXIT_USAGE) from None

    return wrapper


# ---- shared option handling ----------------------------------------------------------------------------
def _capacities(
    capacity: list[str] | None, capacity_blocks: list[int] | None, block_size: int, scenario: Scenario
) -> list[Capacity]:
    caps: list[Capacity] = []
    for c in capacity or []:
        try:
            caps.append(Capacity.from_tokens(parse_capacity(c, "--capacity"), block_size))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    for b in capacity_blocks or []:
        if b <= 0:
            raise UsageError(f"--capacity-blocks must be > 0, got {b}")
        caps.append(Capacity(b))
    if caps:  # a sweep runs smallest first; unlimited last
        return sorted(dict.fromkeys(caps), key=lambda c: (c.blocks is None, c.blocks or 0))
    if not caps:
        try:
            caps = [Capacity.from_tokens(c, block_size) for c in scenario.capacity] or [Capacity(None)]
        except ValueError as exc:
            raise UsageError(f"{scenario.path}: {exc}") from None
    return caps


def _check_common(warmup: float, eviction: str, block_size: int | None) -> None:
    try:
        warmup_count(1, warmup)
    except ValueError as exc:
        raise UsageError(f"--warmup: {exc}") from None
    if eviction not in POLICIES:
        raise UsageError(f"--eviction: unknown policy {eviction!r}; known: {', '.join(sorted(POLICIES))}")
    if block_size is not None and block_size <= 0:
        raise UsageError(f"--block-size must be > 0, got {block_size}")


def _load(path: Path, block_size: int | None, order: str) -> Scenario:
    if order not in ("file", "timestamp"):
        raise UsageError(f"--order must be 'file' or 'timestamp', got {order!r}")
    if is_trace_path(path):
        trace = load_trace(path, block_size)
        if order == "timestamp":
            trace = trace.by_timestamp()
        return Scenario(name=path.name, path=str(path), trace=trace, block_size=trace.block_size)
    scenario = load_scenario(path)
    if order == "timestamp":
        if scenario.trace is not None:
            return replace(scenario, trace=scenario.trace.by_timestamp())
        order_key = sorted(
            range(len(scenario.requests)),
            key=lambda i: (scenario.requests[i].timestamp is None, scenario.requests[i].timestamp or 0),
        )
        return replace(scenario, requests=tuple(scenario.requests[i] for i in order_key))
    return scenario


def _finish(
    command: str,
    scenario: Scenario,
    settings: dict,
    results: list[RunResult],
    json_out: Path | None,
    html: Path | None,
    markdown: Path | None,
    interrupted: bool,
) -> None:
    record = build_record(command, str(scenario.path), settings, results, partial=interrupted)
    if record["totals"]:
        console.console.print(summary_table(record))
    if json_out is not None:
        save_record(record, json_out)
        console.info(f"run record written to {json_out}" + (" (partial)" if record["partial"] else ""))
    if html is not None and record["totals"]:
        console.info(f"HTML report written to {to_html(record, html)}")
    if markdown is not None and record["totals"]:
        console.info(f"Markdown report written to {to_markdown(record, markdown)[0]}")
    if record["partial"]:
        console.info("interrupted: the run is partial")
        raise typer.Exit(EXIT_INTERRUPTED)


class _Progress:
    """Feeds a rich progress bar with the running token hit rate (updates throttled)."""

    def __init__(self, p: Any) -> None:
        self.p, self.task, self.every, self.n = p, None, 1, 0
        self.prompt = self.cached = 0

    def start(self, cap: Capacity, total: int, block_size: int) -> None:
        if self.task is not None:
            self.p.update(self.task, completed=self.n)
        self.task = self.p.add_task(cap.label(block_size), total=total, hit="—")
        self.every, self.n, self.prompt, self.cached = max(1, total // 200), 0, 0, 0

    def row(self, row: Any, _cache: Any = None) -> None:
        self.n += 1
        if not row.warmup:
            self.prompt += row.prompt_tokens
            self.cached += row.cached_tokens
        if self.n % self.every == 0:
            hit = f"{self.cached / self.prompt:.1%}" if self.prompt else "—"
            self.p.update(self.task, completed=self.n, hit=hit)

    def close(self) -> None:
        if self.task is not None:
            hit = f"{self.cached / self.prompt:.1%}" if self.prompt else "—"
            self.p.update(self.task, completed=self.n, hit=hit)


# ---- commands ------------------------------------------------------------------------------------------
CAPACITY_HELP = "Cache capacity in tokens (e.g. 4096, 64k, 1M, or 'unlimited'); repeat for a sweep."
_JSON_HELP = "Write the run record (JSON, version 1) to this file."


@app.command()
@user_errors
def simulate(
    source: Path = typer.Argument(..., help="Scenario YAML, or a Mooncake-style JSONL trace (plain or .gz)."),
    capacity: list[str] | None = typer.Option(None, "--capacity", "-c", help=CAPACITY_HELP),
    capacity_blocks: list[int] | None = typer.Option(None, "--capacity-blocks", help="Capacity in blocks; repeatable."),
    block_size: int | None = typer.Option(
        None,
        "--block-size",
        help="Tokens per block (default: the scenario's, 16; for traces the trace's own: Mooncake 512, kv-tester 64).",
    ),
    warmup: float = typer.Option(0.0, "--warmup", help="Fraction of the requests used only to warm the cache."),
    eviction: str = typer.Option("lru", "--eviction", help="Eviction policy."),
    order: str = typer.Option("file", "--order", help="'file' order, or 'timestamp' (stable sort)."),
    json_out: Path | None = typer.Option(None, "--json", help=_JSON_HELP),
    html: Path | None = typer.Option(None, "--html", help="Also write an HTML report."),
    markdown: Path | None = typer.Option(None, "--markdown", help="Also write a Markdown report."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
) -> None:
    """Replay a scenario or trace through the prefix cache without a model: hit rates, evictions, occupancy.

    Several --capacity/--capacity-blocks values give a sweep (one replay per capacity). Text and chat
    requests are tokenised with the built-in byte-level tokenizer; model replies are synthesised.
    """
    _check_common(warmup, eviction, block_size)
    scenario = _load(source, block_size, order)
    bs = (
        scenario.trace.block_size
        if scenario.trace is not None
        else (block_size or scenario.block_size or DEFAULT_BLOCK_SIZE)
    )
    caps = _capacities(capacity, capacity_blocks, bs, scenario)
    settings = {
        "source": str(source),
        "block_size": bs,
        "eviction": eviction,
        "warmup": warmup,
        "order": order,
        "capacities": [c.label(bs) for c in caps],
        "requests": len(scenario),
        "kind": "trace" if scenario.is_trace else "scenario",
    }
    results: list[RunResult] = []
    interrupted = False
    with console.progress(progress) as p:
        prog = _Progress(p)
        try:
            results = run_simulation(
                scenario,
                caps,
                block_size=bs,
                eviction=eviction,
                warmup=warmup,
                on_start=lambda c, n: prog.start(c, n, bs),
                on_row=prog.row,
            )
        except KeyboardInterrupt:
            interrupted = True
        prog.close()
    _finish("simulate", scenario, settings, results, json_out, html, markdown, interrupted)


@app.command()
@user_errors
def replay(
    scenario_path: Path = typer.Argument(..., metavar="SCENARIO", help="Scenario YAML (text, chat or token requests)."),
    model: str | None = typer.Option(
        None,
        "--model",
        "-m",
        help="Built-in preset ('tiny', 'small') or a local "
        "Hugging Face model folder. Default: the scenario's model, else 'tiny'.",
    ),
    capacity: list[str] | None = typer.Option(None, "--capacity", "-c", help=CAPACITY_HELP),
    capacity_blocks: list[int] | None = typer.Option(None, "--capacity-blocks", help="Capacity in blocks; repeatable."),
    block_size: int | None = typer.Option(None, "--block-size", help="Tokens per block (default: scenario's, 16)."),
    warmup: float = typer.Option(0.0, "--warmup", help="Fraction of the requests used only to warm the cache."),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline", help="Also run each request uncached."),
    verify: bool = typer.Option(False, "--verify", help="Exit with an error (code 1) if any output differs."),
    eviction: str = typer.Option("lru", "--eviction", help="Eviction policy of the wrapper's cache."),
    max_requests: int | None = typer.Option(None, "--max-requests", help="Replay only the first N requests."),
    dtype: str | None = typer.Option(None, "--dtype", help="float32 (default), bfloat16, float16."),
    device: str | None = typer.Option(None, "--device", help="cpu (default), cuda, ..."),
    json_out: Path | None = typer.Option(None, "--json", help=_JSON_HELP),
    html: Path | None = typer.Option(None, "--html", help="Also write an HTML report."),
    markdown: Path | None = typer.Option(None, "--markdown", help="Also write a Markdown report."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar."),
) -> None:
    """Replay a scenario through a real model, cached and (unless --no-baseline) uncached.

    Records time to first token and total time for both, and whether the outputs match (greedy decoding).
    Chat replies generated in one turn join the history of the conversation's next turn.
    """
    _check_common(warmup, eviction, block_size)
    if max_requests is not None and max_requests <= 0:
        raise UsageError(f"--max-requests must be > 0, got {max_requests}")
    scenario = _load(scenario_path, None, "file")
    if scenario.trace is not None:
        raise UsageError(
            f"{scenario_path}: hash-id traces have no tokens; they can only be simulated (prefixcache simulate)"
        )
    if max_requests is not None:
        scenario = replace(scenario, requests=scenario.requests[:max_requests])
    bs = block_size or scenario.block_size or DEFAULT_BLOCK_SIZE
    caps = _capacities(capacity, capacity_blocks, bs, scenario)
    model_name = model or scenario.model or "tiny"
    try:
        from engine.replay import ReplayError  # lazy: torch + transformers
        from engine.replay import replay as run_replay
    except ImportError as exc:  # pragma: no cover - engine is part of the package
        raise UsageError(f"replay needs the engine package (torch, transformers): {exc}") from None
    settings = {
        "source": str(scenario_path),
        "model": model_name,
        "block_size": bs,
        "eviction": eviction,
        "warmup": warmup,
        "baseline": baseline,
        "capacities": [c.label(bs) for c in caps],
        "requests": len(scenario),
        "dtype": dtype or "float32",
        "device": device or "cpu",
    }
    results: list[RunResult] = []
    interrupted = False
    with console.progress(progress) as p:
        prog = _Progress(p)
        try:
            results, info = run_replay(
                scenario,
                caps,
                model=model_name,
                block_size=bs,
                eviction=eviction,
                warmup=warmup,
                baseline=baseline,
                dtype=dtype,
                device=device,
                on_start=lambda c, n: prog.start(c, n, bs),
                on_row=prog.row,
            )
            settings.update(info)
        except ReplayError as exc:
            raise UsageError(str(exc)) from None
        except KeyboardInterrupt:
            interrupted = True
        prog.close()
    _finish("replay", scenario, settings, results, json_out, html, markdown, interrupted)
    mismatched = sum(1 for r in results for row in r.rows if row.outputs_match is False)
    if mismatched:
        msg = f"{mismatched} request(s) gave different outputs cached and uncached"
        if verify:
            console.error(msg)
            raise typer.Exit(1)
        console.info(f"warning: {msg}")


@app.command()
@user_errors
def report(
    run: Path = typer.Argument(..., help="A run record written with --json."),
    html: Path | None = typer.Option(None, "--html", help="Write a self-contained HTML report (plots embedded)."),
    markdown: Path | None = typer.Option(None, "--markdown", help="Write a Markdown report (plots as PNG beside it)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the (checked) run record to this file."),
) -> None:
    """Render a saved run: a terminal summary, and optionally HTML and Markdown with plots."""
    record = load_record(run)
    if record["totals"]:
        console.console.print(summary_table(record))
    else:
        console.info(f"{run}: the run holds no requests")
    if json_out is not None:
        save_record(record, json_out)
    if html is not None:
        console.info(f"HTML report written to {to_html(record, html)}")
    if markdown is not None:
        console.info(f"Markdown report written to {to_markdown(record, markdown)[0]}")


serve_cli.register(app)  # prefixcache/cli/serve.py; the engine, FastAPI and Ray load only inside the command
try:  # the capacity planner lives in its own module; the CLI works without it
    from prefixcache.cli import plan as plan_cli

    plan_cli.register(app)
except ImportError:  # pragma: no cover
    pass


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
