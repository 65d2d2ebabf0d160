"""``prefixcache replay``: a scenario through a real model, cached and uncached (engine imported lazily)."""

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from prefixcache.cli import console
from prefixcache.cli import options as opt
from prefixcache.cli.app import UsageError, app, user_errors
from prefixcache.cli.console import run_progress
from prefixcache.cli.outputs import write_run
from prefixcache.core.checks import parse_bytes
from prefixcache.reports.record import build_record
from prefixcache.sim.diagnosis import DivergenceSite
from prefixcache.sim.results import RunResult
from prefixcache.workload.trace import NO_TOKENS

EXIT_MISMATCH = 1


@app.command()
@user_errors
def replay(
    scenario_path: Annotated[
        Path, typer.Argument(metavar="SCENARIO", help="Scenario YAML (text, chat or token requests).")
    ],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="Built-in preset ('tiny', 'small') or a local Hugging Face model folder. "
            "Default: the scenario's model, else 'tiny'.",
        ),
    ] = None,
    capacity: opt.CapacityOpt = None,
    capacity_blocks: opt.CapacityBlocksOpt = None,
    block_size: opt.BlockSizeOpt = None,
    warmup: opt.WarmupOpt = 0.0,
    baseline: Annotated[bool, typer.Option("--baseline/--no-baseline", help="Also run each request uncached.")] = True,
    verify: Annotated[bool, typer.Option("--verify", help="Exit with code 1 if any output differs.")] = False,
    eviction: opt.EvictionOpt = "lru",
    max_requests: Annotated[
        int | None, typer.Option("--max-requests", help="Replay only the first N requests.")
    ] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32 (default), bfloat16, float16.")] = None,
    device: Annotated[
        str | None, typer.Option("--device", help="cpu (default), cuda, cuda:1, ... (checked before anything loads).")
    ] = None,
    disk_cache: Annotated[
        Path | None,
        typer.Option("--disk-cache", help="A disk tier below each pool, in DIR/pool-<capacity> (LMDB)."),
    ] = None,
    disk_cache_size: Annotated[
        str | None, typer.Option("--disk-cache-size", help="Each disk tier's budget, e.g. 50G (default 8G).")
    ] = None,
    json_out: opt.JsonOpt = None,
    html: opt.HtmlOpt = None,
    markdown: opt.MarkdownOpt = None,
    progress: opt.ProgressOpt = True,
) -> None:
    """Replay a scenario through a real model, cached and (unless --no-baseline) uncached.

    Records time to first token and total time for both, and whether the outputs match (greedy decoding).
    Chat replies generated in one turn join the history of the conversation's next turn.
    """
    policy = opt.replay_policy(eviction, None, warmup)
    opt.check_block_size(block_size)
    if max_requests is not None and max_requests <= 0:
        raise UsageError(f"--max-requests must be > 0, got {max_requests}")
    opt.check_outputs(json_out, html, markdown)
    if disk_cache_size is not None:
        if disk_cache is None:
            raise UsageError("--disk-cache-size needs --disk-cache DIR")
        try:
            parse_bytes(disk_cache_size, "--disk-cache-size")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    try:
        from engine.device import usable_device
        from engine.malloc import keep_freed_memory
        from engine.replay import ReplayError
        from engine.replay import replay as run_replay
    except ImportError as exc:
        raise UsageError(
            f"replay needs the model side (torch, transformers): pip install 'prefixcache[hf]' ({exc})"
        ) from None
    keep_freed_memory()  # this process runs the model, as `serve` does: freed temporaries stay in the heap
    try:
        device = usable_device(device)  # before loading anything: a missing GPU is found at once
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    scenario = opt.load_workload(scenario_path, None, "file")
    if scenario.trace is not None:
        raise UsageError(f"{scenario_path}: {NO_TOKENS}")
    if max_requests is not None:
        scenario = replace(scenario, requests=scenario.requests[:max_requests])
    bs = opt.block_size_of(scenario, block_size)
    caps = opt.capacities(capacity, capacity_blocks, bs, scenario)
    model_name = model or scenario.model or "tiny"
    settings = {
        "source": str(scenario_path),
        "model": model_name,
        "requests": len(scenario),
        "block_size": bs,
        "eviction": policy.eviction,
        "warmup": policy.warmup,
        "baseline": baseline,
        "capacities": [c.label(bs) for c in caps],
        "dtype": dtype or "float32",
        "device": device,
        "disk_cache": None if disk_cache is None else str(disk_cache),
    }
    results: list[RunResult] = []
    sites: list[DivergenceSite] = []
    interrupted = False
    with run_progress(progress, lambda c: c.label(bs)) as prog:
        try:
            results, info = run_replay(
                scenario,
                caps,
                model=model_name,
                block_size=bs,
                eviction=policy.eviction,
                warmup=policy.warmup,
                baseline=baseline,
                dtype=dtype,
                device=device,
                on_start=prog.start,
                on_row=prog.row,
                sites=sites,
                disk_cache=disk_cache,
                max_disk_bytes=disk_cache_size,
            )
            settings.update(info)
        except ReplayError as exc:
            raise UsageError(str(exc)) from None
        except KeyboardInterrupt:
            interrupted = True
    mismatched = sum(1 for r in results for row in r.rows if row.outputs_match is False)
    try:
        write_run(
            build_record("replay", str(scenario.path), settings, results, partial=interrupted, divergences=sites),
            json_out,
            html,
            markdown,
        )
    finally:
        if mismatched:
            message = f"{mismatched} request(s) gave different outputs cached and uncached"
            if verify:
                console.error(message)
                raise typer.Exit(EXIT_MISMATCH)
            console.info(f"warning: {message}")
