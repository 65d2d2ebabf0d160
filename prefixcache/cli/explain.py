"""``prefixcache explain``: why prefill was not saved — uncached tokens by cause, the top divergence points and
the fix each cause suggests, for a scenario or trace (simulated with the usual options) or a saved run."""

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from prefixcache.cli import console
from prefixcache.cli import options as opt
from prefixcache.cli.app import UsageError, app, interrupted, user_errors
from prefixcache.cli.simulate import WorkloadArgs, run_workload
from prefixcache.reports import causes_report as why
from prefixcache.reports.document import rich_table
from prefixcache.reports.output import write_output
from prefixcache.reports.record import RunRecord, load_record
from prefixcache.reports.run_report import title
from prefixcache.sim.causes import workload_causes
from prefixcache.sim.diagnosis import DivergenceSite, decoder_for, image_swaps, sides
from prefixcache.sim.requests import CacheRequests


def looks_like_record(path: Path) -> bool:
    """A run record written with --json (a JSON object with a version), not a trace or a scenario."""
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError, RecursionError):
        return False
    return isinstance(raw, dict) and "version" in raw and "runs" in raw


def _fork(record: RunRecord, reqs: CacheRequests | None, k: int) -> DivergenceSite | None:
    """Request k's divergence as a one-request site: from the workload when there is one, else the record's."""
    if reqs is not None:
        fork = workload_causes(reqs).forks.get(k)
        if fork is None:
            return None
        decode = decoder_for(reqs)
        row = next((r for r in record.runs[0].rows if r.index == k), None)
        lost = row.diverged_tokens if row is not None and row.diverged_tokens else 0
        return DivergenceSite(
            fork.position, 1, lost, k, fork.partner, decode(fork.before), decode(fork.this), decode(fork.other)
        )
    return next((s for s in record.divergences if s.example == k), None)


def _request(record: RunRecord, k: int, fork: DivergenceSite | None) -> list[Any]:
    """What the terminal shows about request ``k``."""
    first = why.request_rows(record, k)[0][1]
    line = f"request {k} (namespace {first.namespace}): {first.prompt_tokens:,} prompt tokens"
    if first.shared_with is not None:
        line += f"; its first {first.shared_tokens:,} tokens are shared with request {first.shared_with}"
    out: list[Any] = [line]
    if fork is not None:
        this, other = sides(fork, 40, 24)
        out.append(f"it departs from request {fork.partner} at token {fork.position:,}: {this} vs {other}")
    out.append(rich_table(why.request_table(record, k)))
    return out


def _run(record: RunRecord, top: int) -> list[Any]:
    """What the terminal shows about the run: causes, top divergence points, fixes."""
    out: list[Any] = [rich_table(why.cause_table(record))]
    line = why.headline(record)
    if line is not None:
        out.append(line)
    if record.divergences:
        out.append(f"Top divergence points (of {len(record.divergences)}), by the prefill tokens they cost:")
        for k, s in enumerate(record.divergences[:top], 1):
            this, other = sides(s, 24, 16)
            out.append(
                f"  {k}. position {s.position:,}: {this} vs {other} — {s.requests:,} request(s), "
                f"{s.tokens:,} tokens lost (e.g. request {s.example} vs {s.partner})"
            )
    elif why.is_keys(record):
        out.append("hash-id traces carry no tokens: a divergence cannot be told from new content (it counts as cold)")
    else:
        out.append("no divergence point: no prompt departs from an earlier one before content seen again")
    lines = why.fix_lines(record)
    if lines:
        out.append("What to do, by the tokens at stake:")
        out += [f"  • {text}" for text in lines]
    return out


@app.command()
@user_errors
def explain(
    source: Annotated[
        Path,
        typer.Argument(
            metavar="SCENARIO_OR_RUN", help="Scenario YAML, a hash-id trace, or a run record written with --json."
        ),
    ],
    request: Annotated[
        int | None, typer.Option("--request", "-r", help="Explain request K (0-based, in replay order) in full.")
    ] = None,
    top: Annotated[int, typer.Option("--top", help="How many divergence points to show.")] = 10,
    capacity: opt.CapacityOpt = None,
    capacity_blocks: opt.CapacityBlocksOpt = None,
    block_size: opt.BlockSizeOpt = None,
    warmup: opt.WarmupOpt = 0.0,
    eviction: opt.EvictionOpt = "lru",
    keep_for: opt.KeepForOpt = None,
    order: opt.OrderOpt = "file",
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Write the explanation as JSON to this file ('-': stdout).")
    ] = None,
    progress: opt.ProgressOpt = True,
) -> None:
    """Say why prefill was not saved: uncached tokens by cause (cold, evicted, diverged, partial_block,
    namespace, not_cached; no_state in a hybrid model's replay), the divergence points that cost the most, and
    what to change.

    A scenario or trace is simulated first (same options as simulate); a run record is explained as it ran.
    """
    if top < 1:
        raise UsageError(f"--top must be >= 1, got {top}")
    if request is not None and request < 0:
        raise UsageError(f"--request must be >= 0, got {request}")
    opt.check_outputs(json_out, None, None)
    reqs: CacheRequests | None = None
    if looks_like_record(source):
        given = [
            name
            for name, value, default in (
                ("--capacity", capacity, None),
                ("--capacity-blocks", capacity_blocks, None),
                ("--block-size", block_size, None),
                ("--warmup", warmup, 0.0),
                ("--eviction", eviction, "lru"),
                ("--keep-for", keep_for, None),
                ("--order", order, "file"),
            )
            if value != default
        ]
        if given:
            raise UsageError(f"{', '.join(given)}: a saved run is explained as it ran; these apply to a scenario")
        record = load_record(source)
        made = False
    else:
        args = WorkloadArgs(source, capacity, capacity_blocks, block_size, warmup, eviction, keep_for, order)
        sim = run_workload(args, progress)
        record, reqs, made = sim.record, sim.reqs, True
    out: dict[str, Any] = why.explanation_json(record, top)
    shown: list[Any] = [title(record).replace(f"prefixcache {record.command}", "prefixcache explain", 1)]
    if not why.analysed(record):
        console.info(f"{source}: the run has no miss causes (recorded before they existed, or no requests)")
    elif request is not None:
        if not why.request_rows(record, request):
            n = max(len(run.rows) for run in record.runs)
            raise UsageError(f"--request {request}: the run has {n} requests (0..{n - 1})")
        fork = _fork(record, reqs, request)
        out["request"] = why.request_json(record, request, fork)
        shown += _request(record, request, fork)
    else:
        shown += _run(record, top)
        swaps = image_swaps(reqs) if reqs is not None else []
        if swaps:
            out["image_swaps"] = [dataclasses.asdict(x) for x in swaps]
            first = swaps[0]
            shown.append(
                f"Another image behind the same placeholder ids: {len(swaps):,} request(s) carry an image where an "
                f"earlier one, with the same tokens before it, had another (e.g. request {first.request}'s "
                f"{first.image} at token {first.position:,}, where request {first.partner} had {first.partner_image}). "
                "Blocks are keyed by the image's content, so none of it was served: it counts as new content (cold)."
            )
    for part in shown:
        console.show(part, to_stderr=opt.stdout_taken(json_out))  # stdout carries the JSON alone
    if json_out is not None:
        where = write_output(json_out, json.dumps(out, indent=1) + "\n")
        console.info(f"explanation written to {where}")
    if made and record.partial:
        raise interrupted()
