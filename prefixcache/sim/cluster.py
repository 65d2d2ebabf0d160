"""A cluster of N replicas, each with its own prefix cache, behind a router: model-free, in time.

Each replica is a :class:`~prefixcache.sim.replay.Replayer` (the one replay loop's per-request step) with its
own ``PrefixCache`` of C blocks. A :class:`~prefixcache.sim.routing.ClusterIndex` mirrors exactly what every
replica caches, fed by the replicas' own cache events, and the routing policy (the very code the Ray Serve
router runs) picks a replica per request from it and from the replicas' loads.

**Load, in time.** Every replica prefills at a fixed rate (``LoadModel.prefill_rate``, tokens per second). A
request arriving at its timestamp with ``u`` uncached prompt tokens brings them to the chosen replica, which
works through its queue as ``LoadModel.queue`` says (``prefixcache.sim.queueing``): first come, first served,
one prompt at a time (``fcfs``, the default), or step by step with a cap on what one prompt takes of a step
(``chunked``, vLLM's scheduler with ``--long-prefill-token-threshold``). A request's queueing delay is its time on
the replica beyond its own prefill (``u / rate``). A replica's load, as the router sees it at a request's
arrival, is the prefill work it has not finished yet, in tokens (the same under both queues, so are the routing
decisions); ``prefix_balanced``'s thresholds are tokens too: the load guard at
``DEFAULT_GUARD_TOKENS`` (and 1.5x), and ``near`` at ``DEFAULT_NEAR_TOKENS``: a request whose longest held
prefix is too short to follow (under ``min_match``) goes, among the replicas within ``near`` tokens of the least
loaded, to the one holding the longest prefix (``prefixcache.sim.routing.RoutingConfig``). Decoding is not
modelled (prefix caching changes only prefill); requests without a timestamp arrive with the previous one.
Reported: per-replica requests, prefill tokens and busy time (their max/min), the queueing delay (p50/p99),
and the cluster's token hit rate beside one global cache of N x C blocks (the bound any routing of N separate
caches can reach).

**A shared tier** (``ClusterSpec.tier``): one :class:`~prefixcache.core.tier.TierIndex` below every replica's
pool (a Redis every replica writes through and reads), each replica following the tier protocol of
``prefixcache.sim.replay``; what a replica finds there is loaded into its pool and not prefilled (the load's
time is not modelled). The router sees the pools only (the tier is the same for every replica). The global
bound then is one cache of N x C blocks above the same tier.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixcache.core.events import CacheEvent
from prefixcache.core.tier import TierIndex
from prefixcache.sim.policy import Capacity, ReplayPolicy
from prefixcache.sim.queueing import PrefillQueue, replica_delays
from prefixcache.sim.replay import TIMESTAMP_UNIT_S, UNLIMITED_POOL_BLOCKS, Replayer, fewer_gc_passes, replay
from prefixcache.sim.requests import CacheRequests
from prefixcache.sim.results import Row, RunResult, percentile
from prefixcache.sim.routing import ROUTING_POLICIES, ClusterIndex, LoadGuard, RoutingConfig, make_policy, prompt_keys

DEFAULT_PREFILL_RATE = 10_000.0  # tokens per second per replica
DEFAULT_GUARD_TOKENS = 131_072.0  # the load guard's absolute threshold here: loads are tokens of queued prefill
DEFAULT_NEAR_TOKENS = 3_000.0  # RoutingConfig.near here: a short prefix settles loads this close (tokens)


@dataclass(frozen=True)
class LoadModel:
    """How load is modelled: each replica prefills ``prefill_rate`` tokens per second, working through its
    queued prompts as ``queue`` says (``fcfs`` by default; see ``prefixcache.sim.queueing``)."""

    prefill_rate: float = DEFAULT_PREFILL_RATE
    queue: PrefillQueue = field(default_factory=PrefillQueue)

    def __post_init__(self) -> None:
        r = self.prefill_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not (r > 0 and math.isfinite(r)):
            raise ValueError(f"prefill_rate must be a positive number of tokens per second, got {r!r}")
        if not isinstance(self.queue, PrefillQueue):
            raise TypeError(f"queue must be a PrefillQueue, got {self.queue!r}")


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster to simulate: ``replicas`` caches of ``capacity`` each, routed by ``router``.

    ``guard`` and ``near`` (tokens of queued prefill, the router's load here) go into the router's
    ``RoutingConfig``: a cold or short request goes, among the replicas loaded at most ``near`` tokens above the
    least loaded, to the one holding the longest prefix (0: plain least loaded)."""

    replicas: int
    capacity: Capacity
    router: str = "prefix_balanced"
    guard: LoadGuard = field(default_factory=lambda: LoadGuard(DEFAULT_GUARD_TOKENS, 1.5))
    load: LoadModel = field(default_factory=LoadModel)
    near: float = DEFAULT_NEAR_TOKENS
    tier: Capacity | None = None  # a second tier shared by every replica (None: none; Capacity(None): no limit)

    def __post_init__(self) -> None:
        n = self.replicas
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"replicas must be an integer >= 1, got {n!r}")
        if self.router not in ROUTING_POLICIES:
            raise ValueError(f"unknown router {self.router!r}; known: {', '.join(ROUTING_POLICIES)}")
        if self.tier is not None and not isinstance(self.tier, Capacity):
            raise TypeError(f"tier must be a Capacity or None, got {self.tier!r}")
        self.routing()  # checks guard and near

    def routing(self) -> RoutingConfig:
        """The router's settings. Raises ValueError for a bad ``near``."""
        return RoutingConfig(guard=self.guard, near=self.near)


@dataclass(frozen=True)
class ClusterResult:
    """One cluster replay: the rows in request order (each from the replica that served it) and, per request,
    the replica, the routing reason, the queueing delay (under ``spec.load.queue``), the tokens it prefilled
    and the arrival time (seconds of trace time)."""

    spec: ClusterSpec
    run: RunResult
    replica: tuple[int, ...]
    reason: tuple[str, ...]
    queue_delay_s: tuple[float, ...]
    prefill_tokens: tuple[int, ...]
    arrival_s: tuple[float, ...]

    def delays(self, queue: PrefillQueue) -> list[float]:
        """Every request's queueing delay had its replicas worked through their queues by ``queue`` instead
        (the routing decisions stay: they depend only on the work not yet done, the same under every queue)."""
        return replica_delays(self.arrival_s, self.prefill_tokens, self.replica, self.spec.load.prefill_rate, queue)

    def summary(self, queue: PrefillQueue | None = None) -> dict[str, Any]:
        """Hit rates, per-replica shares, imbalance and queueing delay over the measured requests (the delays
        under ``queue`` when given: see ``delays``)."""
        n = self.spec.replicas
        queue = self.spec.load.queue if queue is None else queue
        all_delays = self.queue_delay_s if queue == self.spec.load.queue else self.delays(queue)
        t = self.run.totals()
        measured = [k for k, row in enumerate(self.run.rows) if not row.warmup]
        reqs = [0] * n
        prefill = [0] * n
        reasons: dict[str, int] = {}
        for k in measured:
            r = self.replica[k]
            reqs[r] += 1
            prefill[r] += self.prefill_tokens[k]
            reasons[self.reason[k]] = reasons.get(self.reason[k], 0) + 1
        delays = [all_delays[k] for k in measured]
        busy = [p / self.spec.load.prefill_rate for p in prefill]
        return {
            "router": self.spec.router,
            "replicas": n,
            "capacity_blocks_per_replica": self.spec.capacity.blocks,
            "shared_tier": self.spec.tier is not None,
            "tier_capacity_blocks": t["tier_capacity_blocks"],
            "pool_token_hit_rate": t["pool_token_hit_rate"],
            "tier_token_hit_rate": t["tier_token_hit_rate"],
            "tier_tokens": t["tier_tokens"],
            "prefill_rate": self.spec.load.prefill_rate,
            **queue.settings(),
            "requests": t["requests"],
            "prompt_tokens": t["prompt_tokens"],
            "cached_tokens": t["cached_tokens"],
            "token_hit_rate": t["token_hit_rate"],
            "block_hit_rate": t["block_hit_rate"],
            "requests_per_replica": reqs,
            "prefill_tokens_per_replica": prefill,
            "busy_s_per_replica": busy,
            "requests_max_min": _ratio(reqs),
            "prefill_max_min": _ratio(prefill),
            "busy_max_min": _ratio(busy),
            "queue_delay_p50_s": percentile(delays, 50),
            "queue_delay_p99_s": percentile(delays, 99),
            "queue_delay_mean_s": sum(delays) / len(delays) if delays else None,
            "reasons": reasons,
        }


def _ratio(values: Sequence[float]) -> float | None:
    """max / min, None when the smallest is 0 (a replica that got nothing)."""
    lo = min(values, default=0)
    return max(values) / lo if lo > 0 else None


class _Mirror:
    """Feeds one replica's cache events into the shared index."""

    def __init__(self, index: ClusterIndex[int], replica: int) -> None:
        self.index, self.replica = index, replica

    def __call__(self, event: CacheEvent) -> None:
        self.index.apply(self.replica, event)


def cluster_replay(
    reqs: CacheRequests,
    spec: ClusterSpec,
    policy: ReplayPolicy = ReplayPolicy(),
    *,
    on_row: Callable[[Row, int], None] | None = None,
) -> ClusterResult:
    """Replay ``reqs`` in order across ``spec.replicas`` caches routed by ``spec.router`` (module docstring).

    ``on_row(row, replica)`` sees each served request. Changes nothing outside the replay."""
    n = spec.replicas
    pool = UNLIMITED_POOL_BLOCKS if spec.capacity.blocks is None else spec.capacity.blocks
    router = make_policy(spec.router, spec.routing())
    index: ClusterIndex[int] = ClusterIndex()
    replicas = list(range(n))
    tier = None if spec.tier is None else TierIndex(spec.tier.blocks)
    nodes = [Replayer(reqs, pool, policy, tier=tier) for _ in replicas]
    for r, node in enumerate(nodes):
        index.add_replica(r)
        if router.uses_index:
            node.cache.subscribe(_Mirror(index, r))
    rate = spec.load.prefill_rate
    busy_until = [0.0] * n
    first = policy.measured_from(len(reqs))
    rows: list[Row] = []
    chosen: list[int] = []
    reasons: list[str] = []
    arrivals: list[float] = []
    tokens: list[int] = []
    now = 0.0
    partial = False
    try:
        with fewer_gc_passes():
            for i in range(len(reqs)):
                ts = reqs.timestamp[i]
                if ts is not None:
                    now = ts * TIMESTAMP_UNIT_S
                loads = {r: max(0.0, busy_until[r] - now) * rate for r in replicas}
                matched: dict[int, int] = {}
                blocks = reqs.lookup_blocks[i]
                if router.uses_index:
                    ns = reqs.namespace[i]
                    if reqs.mode == "keys":
                        matched = index.match(reqs.request_keys(i), ns, "keys")
                    else:
                        assert reqs.prompts is not None
                        keys = prompt_keys(reqs.prompts[i], ns, block_size=reqs.block_size)
                        matched = index.match(keys, ns, "tokens")
                decision = router.choose(replicas, matched, loads, blocks=blocks)
                r = decision.replica
                row = nodes[r].serve(i, i < first)
                work = row.prompt_tokens - row.cached_tokens
                busy_until[r] = max(now, busy_until[r]) + work / rate  # when its queue drains, under any queue
                rows.append(row)
                chosen.append(r)
                reasons.append(decision.reason)
                arrivals.append(now)
                tokens.append(work)
                if on_row is not None:
                    on_row(row, r)
    except KeyboardInterrupt:
        partial = True
    run = RunResult(spec.capacity, pool, reqs.block_size, tuple(rows), partial, spec.tier)
    delays = replica_delays(arrivals, tokens, chosen, rate, spec.load.queue)
    return ClusterResult(spec, run, tuple(chosen), tuple(reasons), tuple(delays), tuple(tokens), tuple(arrivals))


def global_bound(reqs: CacheRequests, spec: ClusterSpec, policy: ReplayPolicy = ReplayPolicy()) -> RunResult:
    """One cache of N x C blocks fed every request (above a tier like the cluster's shared one, if it has one):
    what a perfect router over N caches could at best reach."""
    cap = Capacity(None if spec.capacity.blocks is None else spec.capacity.blocks * spec.replicas)
    return replay(reqs, cap, policy, tier=spec.tier)
