"""Capacity planning for a hash-id trace: hit rate against capacity per policy, the optimal bound, GB answers.

``make_plan(trace, ...)`` computes a :class:`Plan`:

* LRU at EVERY capacity from 1 block to the working set, in one pass (``lru_curve``);
* the optimal bound on a log grid of capacities (``optimal_hits``), and bisected exactly for the
  answers;
* every other policy (FIFO, LFU, priority, ...) by replaying the trace through a real ``PrefixCache`` once
  per grid capacity (the one replay loop, ``prefixcache.sim.replay``, with the same ``ReplayPolicy``);
* answers: the capacity (blocks, tokens and, given a model, GB) that reaches 50/70/90% of the achievable
  hit rate (the unlimited-capacity one).

A hybrid model (recurrent layers beside attention, ``KVShape.hybrid``) is served a prefix only from a
recurrent-state snapshot at its end (``prefixcache.core.snapshots``), so its GB answers count snapshots beside the
KV blocks: by default one per *snapshot site* the cache holds. A site is a block where some request's path ends
(what a chat's next turn or a re-sent prompt restores from) or where paths part (a shared system prompt followed
by different questions): the deepest block a later request's KV match reaches is always one of them, and the
engine's policy keeps its snapshots there (request ends, divergence points). The trace's prefix tree has S sites
in its W blocks; a cache of C blocks, holding part of that tree, is sized for ``ceil(C * S / W)`` (at most S)
snapshots (``snapshots_for``). ``snapshots`` fixes the count instead (the engine's ``max_cached_states``). The hit
rates are the KV cache's: those of a hybrid model whose snapshots are all where they are needed.

With a second tier (``tiers``: :class:`TierRates` and the pool sizes to plan for), the RAM-and-disk answer: for
each pool size P and share X of the achievable hit rate, the smallest tier T (blocks) at which a two-tier replay
(``prefixcache.sim.replay``, the tier's write-through protocol, LRU) reaches X, found by bisection over replays
(exact at block resolution where the hit rate grows with T; T = 0 when the pool alone reaches X), and its
pool / tier / miss split, with time to first token estimated per request as ``uncached tokens / prefill rate +
tier tokens / tier read rate`` (mean and percentiles over the measured requests; loading from the pool, and
decoding, cost nothing here).

Semantics switches: ``warmup`` (only requests after the first fraction count), ``weight`` ("tokens":
cached prompt tokens / prompt tokens, or "blocks": hit blocks / looked-up blocks) and ``order`` ("file" or
"timestamp": a stable sort, which interleaves kv-tester sessions).
"""

from __future__ import annotations

import math
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
from prefixcache.sim.results import percentile
from prefixcache.workload.order import ordered
from prefixcache.workload.trace import Trace

FRACTIONS = (0.5, 0.7, 0.9)
# measured on the `small` preset (fp32) on 2 CPU cores (benchmarks/bench_tier.py, benchmarks/results/tier.json):
# prompt tokens per second of uncached TTFT, and the disk tier's read rate (reading and checking entries), bytes/s
DEFAULT_PREFILL_RATE = 240.0
DEFAULT_TIER_READ_BYTES = 680e6


def snapshot_sites(nt: NodeTrace) -> int:
    """The snapshot sites of a trace's prefix tree: distinct blocks where a request's path ends or where paths part
    (a block with two or more children; the root is none: an empty prefix needs no state). Changes nothing."""
    nodes, offsets = nt.nodes, nt.offsets
    if len(nodes) == 0:
        return 0
    ends = nodes[offsets[1:] - 1]
    inner = np.ones(len(nodes), dtype=bool)
    inner[offsets[:-1]] = False  # a request's first block hangs from the root
    child = nodes[inner]
    parent = nodes[np.flatnonzero(inner) - 1]
    _, first = np.unique(child, return_index=True)  # each block has one parent: one edge per distinct child
    children = np.bincount(parent[first], minlength=nt.num_nodes)
    return len(np.union1d(ends, np.flatnonzero(children >= 2)))


def snapshots_for(blocks: int, sites: int, working_set: int) -> int:
    """Snapshots a cache of ``blocks`` blocks is sized for: the trace's ``sites`` per block of its ``working_set``,
    rounded up, at most ``sites`` (module docstring)."""
    return min(sites, -(-blocks * sites // max(1, working_set)))


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
    snapshots: int | None = None  # a hybrid model: the recurrent-state snapshots counted in ``gb``


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
    tiers: TierPlan | None = None  # the RAM-and-disk answers (None: not asked for)
    snapshot_sites: int | None = None  # a hybrid model: the trace's snapshot sites (module docstring)
    fixed_snapshots: int | None = None  # a hybrid model: snapshots sized for at every capacity (None: by sites)

    def snapshots(self, blocks: int) -> int | None:
        """The recurrent-state snapshots sized beside ``blocks`` KV blocks (None: not a hybrid model)."""
        if self.model is None or not self.model.hybrid:
            return None
        if self.fixed_snapshots is not None:
            return self.fixed_snapshots
        return snapshots_for(blocks, self.snapshot_sites or 0, self.working_set_blocks)

    def gb(self, blocks: int) -> float | None:
        """GB of KV for ``blocks`` blocks of this plan's model, and of its snapshots for a hybrid model (None
        without a model)."""
        return None if self.model is None else self.model.gb(blocks, self.block_size, self.snapshots(blocks) or 0)

    @property
    def curve_names(self) -> list[str]:
        return list(self.rates)


@dataclass(frozen=True)
class TierRates:
    """What time to first token is estimated from: ``prefill_rate`` tokens per second, and a tier read rate of
    ``read_bytes`` bytes per second (turned into tokens with ``bytes_per_token``, the model's KV per token) or
    ``read_tokens`` tokens per second (exactly one of the two)."""

    prefill_rate: float = DEFAULT_PREFILL_RATE
    read_bytes: float | None = DEFAULT_TIER_READ_BYTES
    read_tokens: float | None = None
    bytes_per_token: int | None = None

    def __post_init__(self) -> None:
        for name in ("prefill_rate", "read_bytes", "read_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
                raise ValueError(f"{name} must be a positive number per second, got {v!r}")
        if (self.read_bytes is None) == (self.read_tokens is None):
            raise ValueError("give the tier read rate in bytes/s or in tokens/s (exactly one)")
        if self.read_bytes is not None and self.bytes_per_token is None:
            raise ValueError("a read rate in bytes/s needs the model's KV bytes per token")

    @property
    def tokens_per_s(self) -> float:
        """The tier read rate in tokens per second."""
        if self.read_tokens is not None:
            return self.read_tokens
        assert self.read_bytes is not None and self.bytes_per_token is not None
        return self.read_bytes / self.bytes_per_token

    def ttft_s(self, uncached_tokens: int, tier_tokens: int) -> float:
        """One request's estimated time to first token: its prefill plus reading the tier's tokens."""
        return uncached_tokens / self.prefill_rate + tier_tokens / self.tokens_per_s


@dataclass(frozen=True)
class TierPoint:
    """One two-tier replay: a pool of ``pool_blocks`` above a tier of ``tier_blocks`` (0: no tier), its hit
    rates (the plan's weight: pool + tier, and each part; ``miss_rate`` = 1 - ``rate``) and estimated TTFT."""

    pool_blocks: int
    tier_blocks: int
    rate: float
    pool_rate: float
    tier_rate: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float

    @property
    def miss_rate(self) -> float:
        return 1.0 - self.rate


@dataclass(frozen=True)
class TierAnswer:
    """The smallest tier that, below a pool of ``pool_blocks``, reaches ``fraction`` of the achievable hit rate:
    ``point`` is its replay (``point.tier_blocks`` 0: the pool alone does; None: not reached even by a tier that
    holds the working set)."""

    fraction: float
    target_rate: float
    pool_blocks: int
    point: TierPoint | None


@dataclass(frozen=True)
class TierPlan:
    """The RAM-and-disk answers: per pool size, ``pool_only`` (no tier) and an answer per fraction; ``no_cache``:
    the estimated TTFT with no cache at all; ``replays``: the two-tier replays it took."""

    rates: TierRates
    pools: tuple[int, ...]
    pool_only: tuple[TierPoint, ...]
    answers: tuple[TierAnswer, ...]
    no_cache: TierPoint
    replays: int


def tier_point(
    reqs: CacheRequests, pool: int, tier: int, policy: ReplayPolicy, weight: str, rates: TierRates
) -> TierPoint:
    """Replay ``reqs`` through a pool of ``pool`` blocks above a tier of ``tier`` blocks (0: none; the LRU
    policy's warm-up) and estimate TTFT. Changes nothing."""
    run = replay(reqs, Capacity(pool), policy, causes=False, tier=Capacity(tier) if tier else None)
    t = run.totals()
    key = "token" if weight == "tokens" else "block"
    ttft = [rates.ttft_s(r.prompt_tokens - r.cached_tokens, r.tier_tokens or 0) for r in run.rows if not r.warmup]
    return TierPoint(
        pool,
        tier,
        float(t[f"{key}_hit_rate"]),
        float(t[f"pool_{key}_hit_rate"]) if tier else float(t[f"{key}_hit_rate"]),
        float(t[f"tier_{key}_hit_rate"]) if tier else 0.0,
        sum(ttft) / len(ttft) if ttft else 0.0,
        percentile(ttft, 50) or 0.0,
        percentile(ttft, 90) or 0.0,
    )


def plan_tiers(
    reqs: CacheRequests,
    pools: Sequence[int],
    rates: TierRates,
    *,
    working_set: int,
    unlimited: float,
    weight: str = "tokens",
    warmup: float = 0.0,
    fractions: Sequence[float] = FRACTIONS,
    guess: Callable[[float], int | None] = lambda frac: None,
) -> TierPlan:
    """For each pool size (blocks) and fraction: the smallest tier reaching ``fraction * unlimited`` (module
    docstring). ``working_set``: the distinct blocks (a tier that size never evicts); ``guess(fraction)``: where
    to start looking (e.g. the single-cache LRU answer). Changes nothing."""
    policy = ReplayPolicy("lru", None, warmup)
    memo: dict[tuple[int, int], TierPoint] = {}

    def at(pool: int, tier: int) -> TierPoint:
        if (pool, tier) not in memo:
            memo[pool, tier] = tier_point(reqs, pool, tier, policy, weight, rates)
        return memo[pool, tier]

    W = max(1, working_set)
    answers: list[TierAnswer] = []
    pool_only: list[TierPoint] = []
    for pool in pools:
        pool_only.append(at(pool, 0))
        for frac in fractions:
            target = frac * unlimited - 1e-12

            def reaches(t: int, pool: int = pool, target: float = target) -> bool:
                return at(pool, t).rate >= target

            tier = 0 if reaches(0) else _smallest(reaches, W, guess(frac))
            answers.append(TierAnswer(frac, frac * unlimited, pool, None if tier is None else at(pool, tier)))
    # no cache: every measured prompt token is prefilled
    ttft = [rates.ttft_s(n, 0) for n in reqs.prompt_tokens[policy.measured_from(len(reqs)) :]]
    mean = sum(ttft) / len(ttft) if ttft else 0.0
    no_cache = TierPoint(0, 0, 0.0, 0.0, 0.0, mean, percentile(ttft, 50) or 0.0, percentile(ttft, 90) or 0.0)
    return TierPlan(rates, tuple(pools), tuple(pool_only), tuple(answers), no_cache, len(memo))


def _smallest(ok: Callable[[int], bool], hi: int, guess: int | None) -> int | None:
    """The smallest t in [1, hi] with ``ok(t)``, by bisection (``ok`` is taken to be monotone), starting with a
    bracket galloped from ``guess`` (first step ``guess // 256``); None when ``ok(hi)`` fails."""
    if not ok(hi):
        return None
    lo = 0  # ok(lo) is False (0: by the caller), ok(hi) is True
    if guess is not None and 1 <= guess < hi:
        first = max(1, guess // 256)
        if ok(guess):
            hi, step = guess, first
            while hi - step > lo and ok(hi - step):  # gallop down
                hi, step = hi - step, step * 2
            lo = max(lo, hi - step)
        else:
            lo, step = guess, first
            while lo + step < hi and not ok(lo + step):  # gallop up
                lo, step = lo + step, step * 2
            hi = min(hi, lo + step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


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
    pools: Sequence[int] = (),
    tier_rates: TierRates | None = None,
    snapshots: int | None = None,
) -> Plan:
    """Compute the plan for ``trace`` (a ``prefixcache.trace.Trace``). Changes nothing.

    ``policies``: names in the eviction registry ("lru" comes from the one-pass curve, the rest from one
    replay per grid capacity); ``points``: size of the log grid; ``bound``: compute the optimal bound;
    ``keep_for``: seconds of retention each request asks for (used by the "priority" policy's replays);
    ``pools``: pool sizes (blocks) to plan a second tier below (with ``tier_rates``, default ``TierRates()``
    with the model's bytes per token), LRU, in the plan's weight and warm-up; ``snapshots``: a hybrid model's
    snapshots to size for at every capacity (None: one per snapshot site held, see the module docstring).
    """
    if weight not in WEIGHTS:
        raise ValueError(f"weight must be one of {', '.join(WEIGHTS)}, got {weight!r}")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; known: {', '.join(sorted(POLICIES))}")
    hybrid = model is not None and model.hybrid
    if snapshots is not None and not hybrid:
        raise ValueError("a snapshot count needs a hybrid model (recurrent layers beside attention)")
    if snapshots is not None and (isinstance(snapshots, bool) or not isinstance(snapshots, int) or snapshots < 1):
        raise ValueError(f"snapshots must be an integer >= 1, got {snapshots!r}")
    if pools and hybrid:
        raise ValueError(
            "plan does not model a second tier that holds a hybrid model's recurrent-state snapshots beside the KV: "
            "plan a hybrid model without --pool-capacity"
        )
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
    sites = snapshot_sites(nt) if hybrid else None

    def answer(name: str, frac: float, cap: int | None, exact: bool) -> Answer:
        snaps = None
        if cap is not None and sites is not None:
            snaps = snapshots if snapshots is not None else snapshots_for(cap, sites, nt.num_nodes)
        return Answer(
            name,
            frac,
            frac * unlimited,
            cap,
            None if cap is None else cap * nt.block_size,
            None if cap is None or model is None else model.gb(cap, nt.block_size, snaps or 0),
            exact,
            snaps,
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
    tiers = None
    if pools:
        t = time.perf_counter()
        say(f"planning a second tier below {len(pools)} pool size(s) (two-tier replays, bisected)")
        rates_ = tier_rates or TierRates(bytes_per_token=None if model is None else model.bytes_per_token)
        lru_answer = {a.fraction: a.capacity_blocks for a in answers if a.curve == "lru"}
        tiers = plan_tiers(
            reqs,
            pools,
            rates_,
            working_set=W,
            unlimited=unlimited,
            weight=weight,
            warmup=warmup,
            fractions=fractions,
            guess=lambda frac: lru_answer.get(frac),
        )
        seconds["tiers"] = time.perf_counter() - t
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
        tiers,
        sites,
        snapshots if hybrid else None,
    )
