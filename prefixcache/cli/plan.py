"""``prefixcache plan``: hit rate at every capacity (one-pass LRU), other policies, the optimal bound, and the
capacity (blocks, tokens, GB) that reaches 50/70/90% of the achievable hit rate; with --pool-capacity, the RAM
(pool) and disk (second tier) for each share, with time to first token estimated from --prefill-rate and
--tier-read-rate.

Validates options and hands off to prefixcache.sim.plan (computing) and prefixcache.reports.plan_report.
"""

import math
from pathlib import Path
from typing import Annotated

import typer

from prefixcache.cli import console
from prefixcache.cli import options as opt
from prefixcache.cli.app import UsageError, app, user_errors
from prefixcache.core import POLICIES
from prefixcache.reports.document import write_html, write_markdown
from prefixcache.reports.plan_report import answer_table, curve_table, document, tier_table, write_json
from prefixcache.sim.kv_size import PRESETS, KVShape, resolve_model
from prefixcache.sim.lru_curve import WEIGHTS
from prefixcache.sim.plan import DEFAULT_PREFILL_RATE, TierRates, make_plan


@app.command("plan")
@user_errors
def plan(
    trace: Annotated[
        Path,
        typer.Argument(
            metavar="TRACE_OR_SCENARIO",
            help="Hash-id trace (Mooncake JSONL, plain or .gz) or a scenario YAML that points to one.",
        ),
    ],
    eviction: Annotated[
        list[str] | None,
        typer.Option(
            "--eviction",
            "--policy",
            "-p",
            help="Eviction policy to compare (repeatable; default lru). lru is computed at every capacity in one "
            "pass; the others replay once per grid capacity.",
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="Model for GB answers: a preset (tiny, small, tiny-hybrid, small-hybrid) or a transformers "
            "config.json (or its folder). A hybrid model's answers count its recurrent-state snapshots too."
        ),
    ] = None,
    layers: Annotated[int | None, typer.Option(min=1, help="Model layers (with --kv-heads, --head-dim).")] = None,
    kv_heads: Annotated[int | None, typer.Option(min=1, help="KV heads per layer.")] = None,
    head_dim: Annotated[int | None, typer.Option(min=1, help="Dimension of one head.")] = None,
    dtype: Annotated[
        str | None, typer.Option(help="KV dtype: bf16, fp16, fp32, fp8 (default: the model's, else bf16).")
    ] = None,
    snapshots: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Hybrid model: recurrent-state snapshots to size memory for at every capacity (the engine's "
            "max_cached_states). Default: one per snapshot site the cache holds (where a request's path ends or "
            "paths part), in proportion to the capacity.",
        ),
    ] = None,
    warmup: opt.WarmupOpt = 0.0,
    keep_for: opt.KeepForOpt = None,
    order: opt.OrderOpt = "file",
    weight: Annotated[
        str,
        typer.Option(help="tokens (cached prompt tokens / prompt tokens) or blocks (hit blocks / looked-up blocks)."),
    ] = "tokens",
    points: Annotated[
        int, typer.Option(min=2, max=200, help="Capacities in the log grid (table, replayed policies, bound).")
    ] = 16,
    bound: Annotated[bool, typer.Option("--bound/--no-bound", help="Compute the optimal (Belady) bound.")] = True,
    block_size: opt.BlockSizeOpt = None,
    pool_capacity: Annotated[
        list[str] | None,
        typer.Option(
            "--pool-capacity",
            help="Plan a second tier (disk) below a pool (RAM) of this many tokens (e.g. 64k; repeatable): the "
            "smallest tier for each share of the achievable hit rate, the pool/tier/miss split and estimated TTFT.",
        ),
    ] = None,
    prefill_rate: Annotated[
        float,
        typer.Option(
            "--prefill-rate",
            help=f"With --pool-capacity: tokens per second the model prefills (default {DEFAULT_PREFILL_RATE:,.0f}: "
            "the small preset's uncached TTFT on 2 CPU cores; give your own).",
        ),
    ] = DEFAULT_PREFILL_RATE,
    tier_read_rate: Annotated[
        str,
        typer.Option(
            "--tier-read-rate",
            help="With --pool-capacity: how fast the tier is read, bytes/s (e.g. 2G; turned into tokens with the "
            "model's KV size, --model, default small) or tokens/s (e.g. '40k tok'). Default 680M: the disk tier "
            "measured on 2 CPU cores.",
        ),
    ] = "680M",
    json_out: opt.JsonOpt = None,
    html: opt.HtmlOpt = None,
    markdown: opt.MarkdownOpt = None,
) -> None:
    """Hit rate against cache capacity: the LRU curve at every capacity, other policies side by side, the
    optimal bound, and the capacity (GB with a model) for 50/70/90% of the achievable hit rate."""
    policies = list(dict.fromkeys(eviction or ["lru"]))
    for p in policies:  # the same checks as simulate's options, per policy
        opt.replay_policy(p, keep_for, warmup)
    if weight not in WEIGHTS:
        raise UsageError(f"--weight must be one of {', '.join(WEIGHTS)}, got {weight!r}")
    opt.check_block_size(block_size)
    opt.check_order(order)
    opt.check_outputs(json_out, html, markdown)
    if keep_for is not None and "priority" not in policies:
        console.info("note: --keep-for only changes the 'priority' policy; add --eviction priority")
    try:
        shape = resolve_model(model, layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    hybrid = shape is not None and shape.hybrid
    if snapshots is not None and not hybrid:
        raise UsageError("--snapshots sizes a hybrid model's recurrent-state snapshots: give one with --model")
    if pool_capacity and hybrid:
        raise UsageError(
            f"--pool-capacity: {model} is a hybrid model; plan does not model a second tier that holds its "
            "recurrent-state snapshots beside the KV (the engine keeps a quarter of a disk tier for them): "
            "plan it without --pool-capacity"
        )
    read_bytes, read_tokens = opt.read_rate(tier_read_rate)
    if not (prefill_rate > 0 and math.isfinite(prefill_rate)):
        raise UsageError(f"--prefill-rate must be a positive number of tokens per second, got {prefill_rate}")
    for c in pool_capacity or []:  # the syntax, before loading
        cap = opt.tier_capacity(c, 1, "--pool-capacity")
        if cap is None or cap.blocks is None:
            raise UsageError(f"--pool-capacity {c!r}: give a size (a pool without a limit needs no tier)")
    scenario = opt.load_workload(trace, block_size, "file")
    if scenario.trace is None:
        raise UsageError(
            f"{trace}: plan needs a hash-id trace; this scenario has text/chat/token requests "
            "(use `prefixcache simulate` with several --capacity values instead)"
        )
    tr = scenario.trace
    console.info(
        f"{trace}: {len(tr):,} requests, {tr.num_blocks:,} block references, block size {tr.block_size}; "
        f"policies {', '.join(policies)}{' + optimal bound' if bound else ''}"
    )
    if shape is not None:
        console.info(kv_line(shape, dtype is not None))
        if hybrid:
            console.info(state_line(shape, snapshots))
    assert all(p in POLICIES for p in policies)
    pools: list[int] = []
    rates = None
    if pool_capacity:
        for c in pool_capacity:
            cap = opt.tier_capacity(c, tr.block_size, "--pool-capacity")
            assert cap is not None and cap.blocks is not None  # checked above
            pools.append(cap.blocks)
        pools = sorted(set(pools))
        kv = shape if shape is not None else PRESETS["small"]
        if read_bytes is not None and shape is None:
            console.info(f"tier read rate in bytes/s: KV size of the small model ({kv.bytes_per_token:,} B/token)")
        rates = TierRates(prefill_rate, read_bytes, read_tokens, kv.bytes_per_token)
    try:
        result = make_plan(
            tr,
            policies=policies,
            weight=weight,
            warmup=warmup,
            order=order,
            points=points,
            bound=bound,
            model=shape,
            keep_for=keep_for,
            progress=console.info,
            pools=pools,
            tier_rates=rates,
            snapshots=snapshots,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    to_stderr = opt.stdout_taken(json_out, html, markdown)
    console.show(curve_table(result), to_stderr=to_stderr)
    console.show(answer_table(result), to_stderr=to_stderr)
    tiers = tier_table(result)
    if tiers is not None:
        console.show(tiers, to_stderr=to_stderr)
    console.info("time: " + ", ".join(f"{k} {v:.2f}s" for k, v in result.seconds.items()))
    if json_out is not None:
        console.info(f"JSON written to {write_json(result, json_out)}")
    if html is not None or markdown is not None:
        doc = document(result)
        if html is not None:
            console.info(f"HTML report written to {write_html(doc, html)}")
        if markdown is not None:
            md, *pngs = write_markdown(doc, markdown)
            console.info(f"Markdown written to {md} (plot {', '.join(pngs)})")


def kv_line(shape: KVShape, dtype_given: bool) -> str:
    """What the GB figures assume: the model's K/V shape and the dtype it was sized with (and where from)."""
    where = "from --dtype" if dtype_given else "the default here; --dtype to change"
    return (
        f"KV sized for {shape.name}: {shape.layers_text()}, {shape.dtype} ({where}) = "
        f"{shape.bytes_per_token:,} bytes per token"
    )


def state_line(shape: KVShape, snapshots: int | None) -> str:
    """What a hybrid model's GB figures add: one recurrent-state snapshot, and how many are counted."""
    count = (
        f"{snapshots:,} snapshots at every capacity (--snapshots)"
        if snapshots is not None
        else "one snapshot per snapshot site the cache holds (--snapshots N to fix the count)"
    )
    return f"recurrent state of {shape.name}: {shape.state_text()} per snapshot; GB = KV blocks + {count}"
