"""``prefixcache simulate``: a scenario or trace through the prefix cache without a model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from prefixcache.cli import options as opt
from prefixcache.cli.app import app, user_errors
from prefixcache.cli.console import run_progress
from prefixcache.cli.outputs import write_run
from prefixcache.reports.record import build_record
from prefixcache.sim.replay import simulate as run_simulation
from prefixcache.sim.requests import from_scenario
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
    """Replay a scenario or trace through the prefix cache without a model: hit rates, evictions, occupancy.

    Several --capacity/--capacity-blocks values give a sweep (one replay per capacity). Text and chat
    requests are tokenised with the built-in byte-level tokenizer; model replies are synthesised.
    """
    policy = opt.replay_policy(eviction, keep_for, warmup)
    opt.check_block_size(block_size)
    opt.check_order(order)
    opt.check_outputs(json_out, html, markdown)
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
    write_run(
        build_record("simulate", str(scenario.path), settings, results, partial=interrupted), json_out, html, markdown
    )
