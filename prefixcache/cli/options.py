"""Option declarations shared by several commands (defined once), and the checks that turn them into values.

Each ``*Opt`` is an ``Annotated`` type a command uses as its parameter annotation; the functions below raise
UsageError (one line, exit 2) for a bad value.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

import typer

from prefixcache.cli.app import UsageError
from prefixcache.core import POLICIES
from prefixcache.reports.output import STDOUT, check_output
from prefixcache.sim.cluster import ClusterSpec, LoadModel
from prefixcache.sim.policy import DEFAULT_BLOCK_SIZE, Capacity, ReplayPolicy
from prefixcache.sim.queueing import QUEUE_DISCIPLINES, PrefillQueue
from prefixcache.sim.routing import ROUTING_POLICIES, LoadGuard
from prefixcache.workload.order import ORDERS, ordered
from prefixcache.workload.scenario import Scenario, load_scenario, parse_capacity
from prefixcache.workload.trace import is_trace_path, load_trace

CapacityOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--capacity", "-c", help="Cache capacity in tokens (e.g. 4096, 64k, 1M, or 'unlimited'); repeat for a sweep."
    ),
]
TierCapacityOpt = Annotated[
    str | None,
    typer.Option(
        "--tier-capacity",
        help="Replay a second tier below the pool (local disk or a shared store, written through): its capacity "
        "in tokens (e.g. 1M, or 'unlimited'). Default: no tier.",
    ),
]
CapacityBlocksOpt = Annotated[
    list[int] | None, typer.Option("--capacity-blocks", help="Cache capacity in blocks; repeatable.")
]
BlockSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--block-size",
        help="Tokens per block (default: the scenario's, else 16; a trace: its own, Mooncake 512, kv-tester 64).",
    ),
]
EvictionOpt = Annotated[str, typer.Option("--eviction", help=f"Eviction policy: {', '.join(sorted(POLICIES))}.")]
KeepForOpt = Annotated[
    float | None,
    typer.Option(
        "--keep-for",
        help="Seconds (trace time) each request asks the cache to keep its prefix; honoured by --eviction priority.",
    ),
]
WarmupOpt = Annotated[
    float, typer.Option("--warmup", help="Leading fraction of the requests that only warms the cache (not measured).")
]
OrderOpt = Annotated[str, typer.Option("--order", help="Request order: 'file', or 'timestamp' (a stable sort).")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="Write the results as JSON to this file ('-': stdout).")]
HtmlOpt = Annotated[Path | None, typer.Option("--html", help="Write a self-contained HTML report ('-': stdout).")]
MarkdownOpt = Annotated[
    Path | None,
    typer.Option("--markdown", help="Write a Markdown report to this file, its plots as PNG files beside it."),
]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")]


RECORD_INT_LIMIT = 2**63  # a run record stores sizes as 64-bit integers


def replay_policy(eviction: str, keep_for: float | None, warmup: float) -> ReplayPolicy:
    """The policy options as a ReplayPolicy; UsageError names the bad option."""
    if eviction not in POLICIES:
        raise UsageError(f"--eviction: unknown policy {eviction!r}; known: {', '.join(sorted(POLICIES))}")
    try:
        return ReplayPolicy(eviction, keep_for, warmup)
    except ValueError as exc:
        option = "--keep-for" if "keep_for" in str(exc) else "--warmup"
        raise UsageError(f"{option}: {exc}") from None


def check_block_size(block_size: int | None) -> None:
    if block_size is not None and block_size <= 0:
        raise UsageError(f"--block-size must be > 0, got {block_size}")
    if block_size is not None and block_size >= RECORD_INT_LIMIT:
        raise UsageError(f"--block-size {block_size:,} is too large (at most 2**63 - 1)")


def check_order(order: str) -> None:
    if order not in ORDERS:
        raise UsageError(f"--order must be one of {', '.join(ORDERS)}, got {order!r}")


def check_outputs(json_out: Path | None, html: Path | None, markdown: Path | None) -> None:
    """Refuse unwritable output paths before any work (InputError names the path), and two options naming
    the same file or both standard output (UsageError)."""
    named = {"--json": json_out, "--html": html, "--markdown": markdown}
    given = {option: path for option, path in named.items() if path is not None}
    for option, path in given.items():
        check_output(path, files_beside=option == "--markdown")
    seen: dict[str, str] = {}
    for option, path in given.items():
        key = STDOUT if str(path) == STDOUT else os.path.realpath(path)
        if os.path.exists(key) and not os.path.isfile(key):  # a device or a FIFO takes several writes
            continue
        if key in seen:
            where = "standard output" if key == STDOUT else str(path)
            raise UsageError(f"{seen[key]} and {option} both write to {where}; give each its own file")
        seen[key] = option


def stdout_taken(*outputs: Path | None) -> bool:
    """Whether one of the outputs is standard output; then a command shows its tables on stderr, so that
    stdout holds that output alone (``--json - | jq``)."""
    return any(p is not None and str(p) == STDOUT for p in outputs)


def load_workload(path: Path, block_size: int | None, order: str) -> Scenario:
    """A scenario YAML, or a trace file wrapped in a Scenario, in ``order``."""
    check_order(order)
    if is_trace_path(path):
        trace = load_trace(path, block_size)
        scenario = Scenario(name=path.name, path=str(path), trace=trace, block_size=trace.block_size)
    else:
        scenario = load_scenario(path)
        if scenario.trace is not None and block_size is not None and block_size != scenario.trace.block_size:
            trace = load_trace(scenario.trace.path, block_size)
            scenario = replace(scenario, trace=trace, block_size=block_size)
    return ordered(scenario, order)


def block_size_of(scenario: Scenario, block_size: int | None) -> int:
    """The block size a run uses: a trace's own, else the option, the scenario's, 16."""
    if scenario.trace is not None:
        return scenario.trace.block_size
    return block_size or scenario.block_size or DEFAULT_BLOCK_SIZE


def capacities(
    capacity: list[str] | None, capacity_blocks: list[int] | None, block_size: int, scenario: Scenario
) -> list[Capacity]:
    """The capacities to run (smallest first, unlimited last): the options', else the scenario's, else unlimited."""
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
    if not caps:
        try:
            caps = [Capacity.from_tokens(c, block_size) for c in scenario.capacity] or [Capacity(None)]
        except ValueError as exc:
            raise UsageError(f"{scenario.path}: {exc}") from None
    too_big = next((c for c in caps if c.blocks is not None and c.blocks >= RECORD_INT_LIMIT), None)
    if too_big is not None:
        raise UsageError(f"capacity {too_big.blocks:,} blocks is too large (at most 2**63 - 1); use 'unlimited'")
    return sorted(dict.fromkeys(caps), key=Capacity.sort_key)


def tier_capacity(value: str | None, block_size: int, option: str = "--tier-capacity") -> Capacity | None:
    """A size option in tokens (--tier-capacity) as a Capacity (None: not given; ``Capacity(None)``: 'unlimited');
    UsageError names the option and the bad value."""
    if value is None:
        return None
    try:
        cap = Capacity.from_tokens(parse_capacity(value, option), block_size)
    except ValueError as exc:
        msg = str(exc)
        raise UsageError(msg if msg.startswith(option) else f"{option} {value!r}: {msg}") from None
    if cap.blocks is not None and cap.blocks >= RECORD_INT_LIMIT:
        raise UsageError(f"{option} {value!r}: {cap.blocks:,} blocks is too large (at most 2**63 - 1)")
    return cap


_RATE_MULT = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def read_rate(value: str, option: str = "--tier-read-rate") -> tuple[float | None, float | None]:
    """A tier read rate: bytes per second ("2G", "2GB/s", "500M", "2e9") or tokens per second ("40k tok",
    "40000 tokens/s"), as (bytes/s, None) or (None, tokens/s). UsageError names the option and the value."""
    s = value.strip().lower().replace(" ", "").replace("_", "").replace(",", "")
    s = s.removesuffix("/s")
    tokens = s.endswith(("tok", "tokens"))
    s = s.removesuffix("tokens").removesuffix("tok") if tokens else s.removesuffix("b")
    mult = _RATE_MULT.get(s[-1:], 1.0)
    try:
        number = float(s[:-1] if s[-1:] in _RATE_MULT else s) * mult
    except ValueError:
        number = math.nan
    if not (number > 0 and math.isfinite(number)):
        raise UsageError(
            f"{option} {value!r}: expected a positive rate in bytes/s (e.g. 2G) or tokens/s (e.g. '40k tok')"
        )
    return (None, number) if tokens else (number, None)


def routers(names: list[str] | None) -> list[str]:
    """The routing policies to compare (default: all of them, in registry order)."""
    chosen = list(dict.fromkeys(names or ROUTING_POLICIES))
    bad = [n for n in chosen if n not in ROUTING_POLICIES]
    if bad:
        raise UsageError(f"--router {bad[0]!r}: unknown; known: {', '.join(ROUTING_POLICIES)}")
    return chosen


@dataclass(frozen=True)
class ClusterArgs:
    """The cluster options of ``simulate --replicas``, as given on the command line."""

    replicas: int
    router: list[str] | None
    prefill_rate: float
    prefill_queue: str
    prefill_step_tokens: int | None
    prefill_chunk_tokens: int | None
    guard_abs: float | None
    guard_rel: float | None
    near_tokens: float | None


def prefill_queue(c: ClusterArgs) -> PrefillQueue:
    """The replicas' queue from --prefill-queue, --prefill-step-tokens and --prefill-chunk-tokens (0: no cap)."""
    if c.prefill_queue not in QUEUE_DISCIPLINES:
        raise UsageError(f"--prefill-queue {c.prefill_queue!r}: unknown; known: {', '.join(QUEUE_DISCIPLINES)}")
    given = [name for name, v in (("step", c.prefill_step_tokens), ("chunk", c.prefill_chunk_tokens)) if v is not None]
    if c.prefill_queue != "chunked":
        if given:
            raise UsageError(f"--prefill-{given[0]}-tokens applies to --prefill-queue chunked only")
        return PrefillQueue(c.prefill_queue)
    default = PrefillQueue("chunked")
    step = default.step_tokens if c.prefill_step_tokens is None else c.prefill_step_tokens
    chunk = default.chunk_tokens if c.prefill_chunk_tokens is None else c.prefill_chunk_tokens
    if step < 1:
        raise UsageError(f"--prefill-step-tokens {step}: must be at least 1")
    if chunk is not None and chunk < 0:
        raise UsageError(f"--prefill-chunk-tokens {chunk}: must be at least 0 (0: no cap)")
    return PrefillQueue("chunked", step, chunk or None)


def cluster_spec(c: ClusterArgs, capacity: Capacity) -> ClusterSpec:
    """The cluster options as a ClusterSpec; UsageError names the bad option."""
    queue = prefill_queue(c)
    try:
        load = LoadModel(c.prefill_rate, queue)
    except ValueError as exc:  # the queue is checked: the rate is wrong
        raise UsageError(f"--prefill-rate: {exc}") from None
    defaults = ClusterSpec(c.replicas, capacity)
    default = defaults.guard
    try:
        guard = LoadGuard(
            default.abs_threshold if c.guard_abs is None else c.guard_abs,
            default.rel_threshold if c.guard_rel is None else c.guard_rel,
        )
    except ValueError as exc:
        raise UsageError(f"--guard-abs/--guard-rel: {exc}") from None
    near = defaults.near if c.near_tokens is None else c.near_tokens
    try:
        return ClusterSpec(c.replicas, capacity, guard=guard, load=load, near=near)
    except ValueError as exc:
        raise UsageError(f"--near-tokens: {exc}") from None
