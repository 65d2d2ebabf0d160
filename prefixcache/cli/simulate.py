"""``prefixcache simulate``: a scenario or trace through the prefix cache without a model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from prefixcache.cli import options as opt
from prefixcache.cli.app import app, user_errors
from prefixcache.cli.console import run_progress
from prefixcache.cli.outputs import write_run
from prefixcache.reports.record import TOP_SITES, RunRecord, build_record
from prefixcache.sim.diagnosis import workload_sites
from prefixcache.sim.replay import simulate as run_simulation
from prefixcache.sim.requests import CacheRequests, from_scenario
from prefixcache.sim.results import RunResult


@app.command()
@user_errors
def simulate(
    source: Annotated[Path, typer.Argument(help="Scenario YAML, or a Mooncake-style JSONL trace (plain or .gz).")],
    capacity: opt.CapacityOpt = None,
    capacity_blocks: opt.CapacityBlocksOpt = None,
    block_size: opt.BlockSizeOpt = None,
    warmup: opt.WarmupOpt = 0.0,
    eviction: opt.EvictionOpt = "lru",
    keep_for: opt.KeepForOpt = None,
    order: opt.OrderOpt = "file",
    json_out: opt.JsonOpt = None,
    html: opt.HtmlOpt = None,
    markdown: opt.MarkdownOpt = None,
    progress: opt.ProgressOpt = True,
) -> None:
    """Replay a scenario or trace through the prefix cache without a model: hit rates, evictions, occupancy,
    and why prefill was not saved (miss causes, divergence points).

    Several --capacity/--capacity-blocks values give a sweep (one replay per capacity). Text and chat
    requests are tokenised with the built-in byte-level tokenizer; model replies are synthesised.
    """
    opt.check_outputs(json_out, html, markdown)
    run = run_workload(source, capacity, capacity_blocks, block_size, warmup, eviction, keep_for, order, progress)
    write_run(run.record, json_out, html, markdown)


@dataclass(frozen=True)
class Simulated:
    """A workload simulated by the CLI: its requests as the cache saw them, and the run record."""

    reqs: CacheRequests
    record: RunRecord


def run_workload(
    source: Path,
    capacity: list[str] | None,
    capacity_blocks: list[int] | None,
    block_size: int | None,
    warmup: float,
    eviction: str,
    keep_for: float | None,
    order: str,
    progress: bool,
) -> Simulated:
    """Check the simulation options, load ``source`` and replay it at every capacity (a Ctrl-C keeps the rows
    so far: the record is marked partial). Raises UsageError/InputError for bad options or input."""
    policy = opt.replay_policy(eviction, keep_for, warmup)
    opt.check_block_size(block_size)
    opt.check_order(order)
    scenario = opt.load_workload(source, block_size, order)
    bs = opt.block_size_of(scenario, block_size)
    caps = opt.capacities(capacity, capacity_blocks, bs, scenario)
    reqs = from_scenario(scenario, bs)
    settings = {
        "source": str(source),
        "kind": "trace" if scenario.is_trace else "scenario",
        "requests": len(reqs),
        "block_size": bs,
        "eviction": policy.eviction,
        "keep_for": policy.keep_for,
        "warmup": policy.warmup,
        "order": order,
        "capacities": [c.label(bs) for c in caps],
    }
    results: list[RunResult] = []
    interrupted = False
    with run_progress(progress, lambda c: c.label(bs)) as prog:
        try:
            results = run_simulation(reqs, caps, policy, on_start=prog.start, on_row=prog.on_row)
        except KeyboardInterrupt:
            interrupted = True
    sites = workload_sites(reqs, results[0].rows, top=TOP_SITES) if results else []
    record = build_record("simulate", str(scenario.path), settings, results, partial=interrupted, divergences=sites)
    return Simulated(reqs, record)
