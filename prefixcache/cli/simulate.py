"""``prefixcache simulate``: a scenario or trace through the prefix cache without a model."""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from prefixcache.cli import options as opt
from prefixcache.cli.app import UsageError, app, user_errors
from prefixcache.cli.app import interrupted as interrupted_exit
from prefixcache.cli.console import run_progress
from prefixcache.cli.options import ClusterArgs
from prefixcache.cli.outputs import write_cluster, write_run
from prefixcache.reports import cluster_report
from prefixcache.reports.record import TOP_SITES, RunRecord, build_record
from prefixcache.sim.cluster import DEFAULT_NEAR_TOKENS, DEFAULT_PREFILL_RATE, cluster_replay, global_bound
from prefixcache.sim.diagnosis import workload_sites
from prefixcache.sim.policy import Capacity, ReplayPolicy
from prefixcache.sim.queueing import DEFAULT_CHUNK_TOKENS, DEFAULT_STEP_TOKENS
from prefixcache.sim.replay import fewer_gc_passes
from prefixcache.sim.replay import simulate as run_simulation
from prefixcache.sim.requests import CacheRequests, from_scenario
from prefixcache.sim.results import RunResult
from prefixcache.sim.routing import ROUTING_POLICIES
from prefixcache.workload.scenario import Scenario


@app.command()
@user_errors
def simulate(
    source: Annotated[
        Path,
        typer.Argument(
            metavar="SCENARIO_OR_TRACE", help="Scenario YAML, or a Mooncake-style JSONL trace (plain or .gz)."
        ),
    ],
    capacity: opt.CapacityOpt = None,
    capacity_blocks: opt.CapacityBlocksOpt = None,
    tier_capacity: opt.TierCapacityOpt = None,
    block_size: opt.BlockSizeOpt = None,
    warmup: opt.WarmupOpt = 0.0,
    eviction: opt.EvictionOpt = "lru",
    keep_for: opt.KeepForOpt = None,
    order: opt.OrderOpt = "file",
    json_out: opt.JsonOpt = None,
    html: opt.HtmlOpt = None,
    markdown: opt.MarkdownOpt = None,
    progress: opt.ProgressOpt = True,
    replicas: Annotated[
        int | None,
        typer.Option(
            "--replicas",
            min=1,
            help="Simulate a cluster of N replicas, each with a cache of the given capacity, behind a router.",
        ),
    ] = None,
    router: Annotated[
        list[str] | None,
        typer.Option(
            "--router", help=f"Cluster routing policy (repeatable; default all: {', '.join(ROUTING_POLICIES)})."
        ),
    ] = None,
    prefill_rate: Annotated[
        float, typer.Option("--prefill-rate", help="Cluster load model: tokens per second each replica prefills.")
    ] = DEFAULT_PREFILL_RATE,
    prefill_queue: Annotated[
        str,
        typer.Option(
            "--prefill-queue",
            help="Cluster load model: how a replica works through its queued prompts: fcfs (one at a time, in "
            "arrival order) or chunked (engine steps; each prompt gets at most --prefill-chunk-tokens of a step).",
        ),
    ] = "fcfs",
    prefill_step_tokens: Annotated[
        int | None,
        typer.Option(
            "--prefill-step-tokens",
            help=f"--prefill-queue chunked: tokens one step prefills (default {DEFAULT_STEP_TOKENS:,}; vLLM's "
            "--max-num-batched-tokens).",
        ),
    ] = None,
    prefill_chunk_tokens: Annotated[
        int | None,
        typer.Option(
            "--prefill-chunk-tokens",
            help=f"--prefill-queue chunked: the most one prompt gets of a step (default {DEFAULT_CHUNK_TOKENS:,}; "
            "0: no cap; vLLM's --long-prefill-token-threshold).",
        ),
    ] = None,
    guard_abs: Annotated[
        float | None,
        typer.Option(
            "--guard-abs", help="Load guard: absolute queue difference, in tokens of queued prefill (default 131072)."
        ),
    ] = None,
    guard_rel: Annotated[
        float | None, typer.Option("--guard-rel", help="Load guard: relative queue difference (default 1.5).")
    ] = None,
    near_tokens: Annotated[
        float | None,
        typer.Option(
            "--near-tokens",
            help="prefix_balanced: a short held prefix picks among replicas within this many queued tokens of the "
            f"least loaded (default {DEFAULT_NEAR_TOKENS:,.0f}; 0: plain least loaded).",
        ),
    ] = None,
) -> None:
    """Replay a scenario or trace through the prefix cache without a model: hit rates, evictions, occupancy,
    and why prefill was not saved (uncached tokens by cause; the divergence points are in --json, --html and
    --markdown, and 'prefixcache explain' shows them with what to change).

    Several --capacity/--capacity-blocks values give a sweep (one replay per capacity). Text and chat
    requests are tokenised with the built-in byte-level tokenizer; model replies are synthesised.
    With --replicas N: a cluster of N caches of one capacity each, routed by each --router in turn, side by
    side with one cache of N times the capacity (load modelled in time: see --prefill-rate and --prefill-queue).
    With --tier-capacity: a second tier below the pool (written through; a lookup that stops in the pool goes on
    in the tier, whose blocks are loaded into the pool), hits counted in each; with --replicas, one tier shared
    by every replica (and by the one big cache they are compared with).
    """
    opt.check_outputs(json_out, html, markdown)
    args = WorkloadArgs(source, capacity, capacity_blocks, block_size, warmup, eviction, keep_for, order, tier_capacity)
    # Loading, replays and the record make many objects and few cycles. The work is a call, so that what it
    # made is freed (by reference counts) before the collector's thresholds come back; else the next
    # allocation would start a pass over all of it just before it goes anyway.
    with fewer_gc_passes():
        if replicas is None:
            _simulate(args, progress, json_out, html, markdown)
        else:
            cluster = ClusterArgs(
                replicas,
                router,
                prefill_rate,
                prefill_queue,
                prefill_step_tokens,
                prefill_chunk_tokens,
                guard_abs,
                guard_rel,
                near_tokens,
            )
            record = run_cluster(args, cluster, progress)
            write_cluster(record, json_out, html, markdown)
            if any(r.get("partial") for r in record["routers"]):
                raise interrupted_exit()


def _simulate(
    args: "WorkloadArgs", progress: bool, json_out: Path | None, html: Path | None, markdown: Path | None
) -> None:
    """Run the workload, print its summary and write the requested files."""
    run = run_workload(args, progress)
    write_run(run.record, json_out, html, markdown)


@dataclass(frozen=True)
class Simulated:
    """A workload simulated by the CLI: its requests as the cache saw them, and the run record."""

    reqs: CacheRequests
    record: RunRecord


@dataclass(frozen=True)
class WorkloadArgs:
    """What to replay and how, as given on the command line (shared by simulate, simulate --replicas and
    explain)."""

    source: Path
    capacity: list[str] | None
    capacity_blocks: list[int] | None
    block_size: int | None
    warmup: float
    eviction: str
    keep_for: float | None
    order: str
    tier_capacity: str | None = None  # --tier-capacity, as given (None: no second tier)


@dataclass(frozen=True)
class Prepared:
    """A checked workload: the policy, scenario, block size, capacities, second tier (None: none), requests."""

    policy: ReplayPolicy
    scenario: Scenario
    block_size: int
    capacities: list[Capacity]
    tier: Capacity | None
    reqs: CacheRequests


def _prepare(a: WorkloadArgs) -> Prepared:
    """Check the replay options, load the source and turn it into cache requests. Raises UsageError/InputError
    for bad options or input (the options' syntax before the source is read)."""
    policy = opt.replay_policy(a.eviction, a.keep_for, a.warmup)
    opt.check_block_size(a.block_size)
    opt.check_order(a.order)
    if a.tier_capacity is not None:  # its syntax before any loading; its blocks once the block size is known
        opt.tier_capacity(a.tier_capacity, 1)
    scenario = opt.load_workload(a.source, a.block_size, a.order)
    bs = opt.block_size_of(scenario, a.block_size)
    caps = opt.capacities(a.capacity, a.capacity_blocks, bs, scenario)
    tier = opt.tier_capacity(a.tier_capacity, bs)
    return Prepared(policy, scenario, bs, caps, tier, from_scenario(scenario, bs))


def run_workload(args: WorkloadArgs, progress: bool) -> Simulated:
    """Check the simulation options, load the source and replay it at every capacity (a Ctrl-C keeps the rows
    so far: the record is marked partial). Raises UsageError/InputError for bad options or input."""
    w = _prepare(args)
    policy, scenario, bs, caps, reqs = w.policy, w.scenario, w.block_size, w.capacities, w.reqs
    settings = {
        "source": str(args.source),
        "kind": "trace" if scenario.is_trace else "scenario",
        "requests": len(reqs),
        "block_size": bs,
        "eviction": policy.eviction,
        "keep_for": policy.keep_for,
        "warmup": policy.warmup,
        "order": args.order,
        "capacities": [c.label(bs) for c in caps],
        "tier_capacity": None if w.tier is None else w.tier.label(bs),
    }
    results: list[RunResult] = []
    interrupted = False
    with run_progress(progress, lambda c: c.label(bs)) as prog:
        try:
            results = run_simulation(reqs, caps, policy, on_start=prog.start, on_row=prog.on_row, tier=w.tier)
        except KeyboardInterrupt:
            interrupted = True
    sites = workload_sites(reqs, results[0].rows, top=TOP_SITES) if results else []
    record = build_record("simulate", str(scenario.path), settings, results, partial=interrupted, divergences=sites)
    return Simulated(reqs, record)


def run_cluster(args: WorkloadArgs, cluster: ClusterArgs, progress: bool) -> dict[str, Any]:
    """Check the cluster options, load the source and replay it through a cluster once per router, then one
    cache of the cluster's total size. Returns the cluster record. Raises UsageError/InputError."""
    routers = opt.routers(cluster.router)
    w = _prepare(args)
    policy, scenario, bs, caps, reqs = w.policy, w.scenario, w.block_size, w.capacities, w.reqs
    if len(caps) != 1:
        raise UsageError("--replicas takes one capacity (per replica): one --capacity or --capacity-blocks")
    spec = replace(opt.cluster_spec(cluster, caps[0]), tier=w.tier)
    replicas = cluster.replicas
    summaries = []
    with run_progress(progress, lambda name: f"router {name}") as prog:
        for name in routers:
            prog.start(name, len(reqs))
            on_row = None if prog.on_row is None else (lambda row, _replica: prog.row(row))
            result = cluster_replay(reqs, replace(spec, router=name), policy, on_row=on_row)
            summaries.append({**result.summary(), "partial": result.run.partial})
            if result.run.partial:
                break
    bound = global_bound(reqs, spec, policy)
    settings = {
        "source": str(args.source),
        "requests": len(reqs),
        "block_size": bs,
        "replicas": replicas,
        "capacity_blocks_per_replica": caps[0].blocks,
        "shared_tier_blocks": None if w.tier is None else w.tier.blocks,
        "shared_tier": None if w.tier is None else w.tier.label(bs),
        "prefill_rate": spec.load.prefill_rate,
        **spec.load.queue.settings(),
        "guard": {"abs_threshold": spec.guard.abs_threshold, "rel_threshold": spec.guard.rel_threshold},
        "near_tokens": spec.near,
        "eviction": policy.eviction,
        "keep_for": policy.keep_for,
        "warmup": policy.warmup,
        "order": args.order,
    }
    return cluster_report.build(str(scenario.path), settings, bound.totals(), summaries)
