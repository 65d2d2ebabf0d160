"""Capacity planning for a hash-id trace: hit rate against capacity per policy, the optimal bound, GB answers.

``make_plan(trace, ...)`` computes a :class:`Plan`:

* LRU at EVERY capacity from 1 block to the working set, in one pass (``lru_curve``);
* the optimal bound on a log grid of capacities (``optimal_hits``), and bisected exactly for the
  answers;
* every other policy (FIFO, LFU, priority, ...) by replaying the trace through a real ``PrefixCache`` once
  per grid capacity (the one replay loop, ``prefixcache.sim.replay``, with the same ``ReplayPolicy``);
* answers: the capacity (blocks, tokens and, given a model, GB) that reaches 50/70/90% of the achievable
  hit rate (the unlimited-capacity one).

Semantics switches: ``warmup`` (only requests after the first fraction count), ``weight`` ("tokens":
cached prompt tokens / prompt tokens, or "blocks": hit blocks / looked-up blocks) and ``order`` ("file" or
"timestamp": a stable sort, which interleaves kv-tester sessions).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from prefixcache.core import POLICIES
from prefixcache.sim.kv_size import KVShape
from prefixcache.sim.lru_curve import WEIGHTS, HitCurve, lru_curve
from prefixcache.sim.node_trace import NodeTrace, canonical_blocks
from prefixcache.sim.optimal import next_uses, optimal_hits
from prefixcache.sim.policy import Capacity, ReplayPolicy
from prefixcache.sim.replay import replay
from prefixcache.sim.requests import CacheRequests, from_trace
from prefixcache.workload.order import ordered
from prefixcache.workload.trace import Trace

FRACTIONS = (0.5, 0.7, 0.9)


def replay_rate(reqs: CacheRequests, capacity: int, policy: ReplayPolicy, weight: str) -> float:
    """The measured hit rate (``weight``: "tokens" or "blocks") of one replay at ``capacity`` blocks."""
    t = replay(reqs, Capacity(capacity), policy, causes=False).totals()  # only the hit rate is read
    return float(t["token_hit_rate"] if weight == "tokens" else t["block_hit_rate"])


def log_grid(max_capacity: int, points: int = 24, min_capacity: int = 1) -> list[int]:
    """About ``points`` log-spaced capacities from ``min_capacity`` to ``max_capacity`` (both included)."""
    if max_capacity < 1:
        return [1]
    lo = max(1, min(min_capacity, max_capacity))
    grid = np.unique(np.round(np.geomspace(lo, max_capacity, num=max(2, points))).astype(np.int64))
    return [int(c) for c in grid]


@dataclass(frozen=True)
class Answer:
    """The smallest capacity reaching ``fraction`` of the achievable hit rate, for one curve.

    ``exact``: found at block resolution (LRU's full curve, the bound by bisection); otherwise the first
    grid capacity that reaches it (an over-estimate of at most one grid step). None when never reached.
    """

    curve: str
    fraction: float
    target_rate: float
    capacity_blocks: int | None
    capacity_tokens: int | None
    gb: float | None
    exact: bool


@dataclass(frozen=True)
class Plan:
    """Hit rate against capacity for one trace (see the module docstring). Rates follow ``weight``."""

    trace: str
    order: str
    weight: str
    warmup: float
    block_size: int
    requests: int
    measured_requests: int
    working_set_blocks: int  # distinct blocks: the capacity where nothing is ever evicted
    unlimited_rate: float  # the achievable hit rate
    grid: tuple[int, ...]  # capacities (blocks) of the table and of the replayed policies
    rates: dict[str, tuple[float, ...]]  # curve name ("lru", "fifo", ..., "optimal") -> rate at each grid point
    answers: tuple[Answer, ...]
    model: KVShape | None
    lru: HitCurve = field(repr=False)
    seconds: dict[str, float] = field(default_factory=dict)
    keep_for: float | None = None

    def gb(self, blocks: int) -> float | None:
        """GB of KV for ``blocks`` blocks of this plan's model (None without a model)."""
        return None if self.model is None else self.model.gb(blocks, self.block_size)

    @property
    def curve_names(self) -> list[str]:
        return list(self.rates)


def _rate_of(hits: int, weight: str, curve: HitCurve) -> float:
    total = curve.total_blocks if weight == "blocks" else curve.total_tokens
    return hits / total if total else 0.0


def make_plan(
    trace: Trace,
    *,
    policies: Sequence[str] = ("lru",),
    weight: str = "tokens",
    warmup: float = 0.0,
    order: str = "file",
    points: int = 16,
    bound: bool = True,
    model: KVShape | None = None,
    keep_for: float | None = None,
    fractions: Sequence[float] = FRACTIONS,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Compute the plan for ``trace`` (a ``prefixcache.trace.Trace``). Changes nothing.

    ``policies``: names in the eviction registry ("lru" comes from the one-pass curve, the rest from one
    replay per grid capacity); ``points``: size of the log grid; ``bound``: compute the optimal bound;
    ``keep_for``: seconds of retention each request asks for (used by the "priority" policy's replays).
    """
    if weight not in WEIGHTS:
        raise ValueError(f"weight must be one of {', '.join(WEIGHTS)}, got {weight!r}")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; known: {', '.join(sorted(POLICIES))}")
    say = progress or (lambda msg: None)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    tr = ordered(trace, order)
    reqs = from_trace(tr)
    nt: NodeTrace = canonical_blocks(tr)
    curve = lru_curve(nt, warmup)
    seconds["lru_curve"] = time.perf_counter() - t0
    W = max(1, nt.num_nodes)
    unl_hits = curve.hits(W, weight)
    unlimited = _rate_of(unl_hits, weight, curve)
    grid = tuple(log_grid(W, points))
    rates: dict[str, tuple[float, ...]] = {}
    answers: list[Answer] = []

    def answer(name: str, frac: float, cap: int | None, exact: bool) -> Answer:
        return Answer(
            name,
            frac,
            frac * unlimited,
            cap,
            None if cap is None else cap * nt.block_size,
            None if cap is None or model is None else model.gb(cap, nt.block_size),
            exact,
        )

    # LRU: every capacity
    all_rates = curve.rates(weight)
    for p in policies:
        if p == "lru":
            rates["lru"] = tuple(float(all_rates[c - 1]) for c in grid)
            for frac in fractions:
                target = frac * unl_hits
                arr = curve.hit_blocks if weight == "blocks" else curve.hit_tokens
                idx = int(np.searchsorted(arr, target - 1e-9 * max(1, target), side="left"))
                answers.append(answer("lru", frac, idx + 1 if idx < len(arr) else None, True))
    # other policies: one replay per grid capacity
    for p in policies:
        if p == "lru":
            continue
        t = time.perf_counter()
        say(f"replaying {p} at {len(grid)} capacities ({tr.num_blocks:,} block references each)")
        pol = ReplayPolicy(p, keep_for, warmup)
        row = [replay_rate(reqs, c, pol, weight) for c in grid]
        rates[p] = tuple(row)
        seconds[f"replay_{p}"] = time.perf_counter() - t
        for frac in fractions:
            cap = next((c for c, r in zip(grid, row) if r >= frac * unlimited - 1e-12), None)
            answers.append(answer(p, frac, cap, False))
    # optimal bound
    if bound:
        t = time.perf_counter()
        say("computing the optimal bound")
        nu = next_uses(nt)
        unl_tokens = curve.hits(W, "tokens")
        memo: dict[int, int] = {}

        def opt(c: int) -> int:
            if c not in memo:
                o = optimal_hits(nt, c, warmup, nu=nu, unlimited_tokens=unl_tokens)
                memo[c] = o.hit_blocks if weight == "blocks" else o.hit_tokens
            return memo[c]

        rates["optimal"] = tuple(_rate_of(opt(c), weight, curve) for c in grid)
        for frac in fractions:
            target = frac * unl_hits
            lo, hi = 1, W  # opt is non-decreasing in capacity and reaches unl_hits at W
            if opt(hi) < target - 1e-9:
                answers.append(answer("optimal", frac, None, True))
                continue
            while lo < hi:
                mid = (lo + hi) // 2
                if opt(mid) >= target - 1e-9 * max(1, target):
                    hi = mid
                else:
                    lo = mid + 1
            answers.append(answer("optimal", frac, lo, True))
        seconds["optimal"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t0
    return Plan(
        str(getattr(trace, "path", "")),
        order,
        weight,
        warmup,
        nt.block_size,
        len(nt),
        curve.measured_requests,
        nt.num_nodes,
        unlimited,
        grid,
        rates,
        tuple(answers),
        model,
        curve,
        seconds,
        keep_for,
    )
