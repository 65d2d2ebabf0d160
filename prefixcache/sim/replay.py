"""THE replay loop: a workload's requests, in order, through a fresh ``PrefixCache`` per capacity.

Every model-free caller goes through here: ``prefixcache simulate``, the policy replays of ``plan``, the
benchmarks, and anything later (a cluster of replicas drives several :class:`Replayer` s). Per request:
the cache's clock moves to the request's timestamp (milliseconds -> seconds; requests without one keep
the previous time), then ``match`` (or ``match_keys``), ``commit`` (or ``commit_keys``, with the policy's
``keep_for``), ``release`` — see ``prefixcache.sim.requests`` for what is looked up and committed. Each row
also says why its uncached tokens missed (``prefixcache.sim.causes``: the workload's part is computed once
and shared by every replay of it; a :class:`CauseTracker` follows this cache for the rest).

**A second tier** (``tier``: a :class:`~prefixcache.core.tier.TierIndex`, written through, below the pool)
follows that class's protocol exactly, as a model replay does. Per request, with ``keys`` the chained block
keys of the sequence it commits (:func:`tier_keys`) and ``limit`` the blocks a match may serve (tokens:
``(n - 1) // block_size``; keys: every hash id):

1. ``m = match(prompt)`` (``match_keys``): the pool serves ``p = m.cached_blocks`` blocks;
2. ``t = tier.lookup(keys, p, limit)``;
3. only when ``t > 0``: ``commit(handle, prompt[: (p + t) * block_size])`` (``commit_keys(handle,
   keys[: p + t])``), with the request's ``keep_for``: the tier's blocks are loaded into the pool. The tier
   served the blocks that commit cached, ``t' = c1.cached_blocks - p`` (all ``t`` of them unless the pool
   cannot hold the request's path: a block that does not fit is computed);
4. the final commit as without a tier (prompt + reply; the hash ids), ``release``, then
   ``tier.add(keys[: c.cached_blocks])``: the path the pool now holds (new blocks held, the rest refreshed,
   deepest first: the tier evicts as one LRU cache of its size would).

The row's ``cached_tokens`` / ``hit_blocks`` are the pool's and the tier's together (``(p + t')`` blocks;
tokens: ``min((p + t') * block_size, n)``), ``tier_tokens`` / ``tier_blocks`` the tier's part,
``inserted_blocks`` both commits' new blocks. Without a tier nothing of this runs (the rows' tier fields are
None).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager

from prefixcache.core import CacheConfig, PrefixCache
from prefixcache.core.cache import CommitResult
from prefixcache.core.hashing import block_keys
from prefixcache.core.tier import TierIndex
from prefixcache.sim.causes import CauseTracker, workload_causes
from prefixcache.sim.policy import Capacity, ReplayPolicy
from prefixcache.sim.requests import CacheRequests
from prefixcache.sim.results import NO_CAUSES, NO_TIER, Row, RunResult

OnRow = Callable[[Row, PrefixCache], None]  # the row just served, and the cache that served it
OnStart = Callable[[Capacity, int], None]
TIMESTAMP_UNIT_S = 1e-3  # request timestamps are milliseconds (Mooncake, kv-tester, scenarios)
UNLIMITED_POOL_BLOCKS = 2**60  # an unlimited capacity: never full, and free (the core allocates lazily)
REPLAY_GC_THRESHOLD = (50_000, 20, 100)  # a replay allocates many short-lived objects and few cycles


@contextmanager
def fewer_gc_passes() -> Iterator[None]:
    """Run the body with the cyclic garbage collector's thresholds raised to ``REPLAY_GC_THRESHOLD`` (never
    lowered), then restore them. Replays keep large trees alive; the default thresholds make the collector
    re-scan them thousands of times (about 8% of a Mooncake replay). Changes only the collector's thresholds."""
    old = gc.get_threshold()
    gc.set_threshold(*(max(a, b) for a, b in zip(old, REPLAY_GC_THRESHOLD)))
    try:
        yield
    finally:
        gc.set_threshold(*old)


class TraceClock:
    """The time retention is measured on: the last served request's timestamp, in seconds (``now``). Its own
    object, not a method of the replayer: a bound method handed to the cache would make the replayer and its
    cache a reference cycle, kept until the garbage collector's next full pass."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tier_keys(reqs: CacheRequests, i: int, hash_seed: int = 0) -> list[Hashable]:
    """Request i's keys in a second tier: one per full block of the sequence it commits (tokens mode: the
    16-byte chained digests of ``prefixcache.core.hashing.block_keys``; keys mode: ``(namespace, hash id)``).
    Made once per workload and kept in ``reqs.memo`` (hash seed 0, the replay caches'); don't change them."""
    memo: dict[int, list[Hashable]] = reqs.memo.setdefault(f"tier_keys/{hash_seed}", {})
    keys = memo.get(i)
    if keys is None:
        ns = reqs.namespace[i]
        if reqs.mode == "keys":
            keys = [(ns, k) for k in reqs.request_keys(i)]
        else:
            assert reqs.commits is not None
            keys = list(block_keys(reqs.commits[i], ns, block_size=reqs.block_size, hash_seed=hash_seed))
        memo[i] = keys
    return keys


class Replayer:
    """One cache of ``pool_blocks`` blocks that serves ``reqs``' requests one at a time (``serve(i)``), above a
    second tier when ``tier`` is given (the module docstring's protocol; several replayers may share one tier).

    Rows carry miss causes while requests are served in order 0, 1, 2, ... (as :func:`replay` does); after a
    request served out of order, the causes are None (the tracker would otherwise guess). ``causes=False``
    leaves them out (None) for callers that never read them (plan's policy replays, benchmarks)."""

    def __init__(
        self,
        reqs: CacheRequests,
        pool_blocks: int,
        policy: ReplayPolicy,
        *,
        causes: bool = True,
        tier: TierIndex | None = None,
    ) -> None:
        self.reqs = reqs
        self.policy = policy
        self.clock = TraceClock()
        config = CacheConfig(num_blocks=pool_blocks, block_size=reqs.block_size, eviction=policy.eviction)
        self.cache = PrefixCache(config, clock=self.clock)
        self.causes = CauseTracker(workload_causes(reqs)) if causes else None
        self.tier = tier

    def serve(self, i: int, warmup: bool = False) -> Row:
        """Look up, commit and release request ``i``; returns its row. Changes the cache."""
        reqs, cache = self.reqs, self.cache
        ts = reqs.timestamp[i]
        if ts is not None:
            self.clock.now = ts * TIMESTAMP_UNIT_S
        ns = reqs.namespace[i]
        n = reqs.prompt_tokens[i]
        stats = cache.stats
        evicted0 = stats.blocks_evicted
        tier: tuple[int | None, ...] = NO_TIER
        causes: tuple[object, ...] | None
        if self.tier is not None:
            cached, hit, inserted, causes, tier = self._serve_tiered(i)
        elif reqs.mode == "keys":
            keys = reqs.request_keys(i)
            cached, hit, c = cache.serve_keys(keys, ns, num_tokens=n, keep_for=self.policy.keep_for)
            inserted = c.cached_blocks - c.first_block
            causes = None if self.causes is None else self.causes.observe(i, cached, c)
        else:
            assert reqs.prompts is not None and reqs.commits is not None
            m = cache.match(reqs.prompts[i], ns)
            try:
                c = cache.commit(m.handle, reqs.commits[i], keep_for=self.policy.keep_for)
            finally:
                cache.release(m.handle)
            cached, hit = m.cached_tokens, m.cached_blocks
            inserted = c.cached_blocks - c.first_block
            causes = None if self.causes is None else self.causes.observe(i, cached, c)
        return Row._make(
            (
                i,
                ns,
                n,
                cached,
                reqs.lookup_blocks[i],
                hit,
                inserted,
                stats.blocks_evicted - evicted0,
                cache.num_cached_blocks,
                warmup,
                ts,
                reqs.output_tokens[i],
                None,
                None,
                None,
                None,
                None,
            )
            + (NO_CAUSES if causes is None else causes)
            + tier
        )

    def _serve_tiered(self, i: int) -> tuple[int, int, int, tuple[object, ...] | None, tuple[int, int, int]]:
        """Request ``i`` through the pool and the tier (the module docstring's protocol): its cached tokens and
        blocks (pool + tier), inserted blocks (both commits), miss causes and tier fields. Changes both."""
        reqs, cache, tier = self.reqs, self.cache, self.tier
        assert tier is not None
        ns, n, bs = reqs.namespace[i], reqs.prompt_tokens[i], reqs.block_size
        keep_for = self.policy.keep_for
        keys = tier_keys(reqs, i)
        loaded: CommitResult | None = None
        if reqs.mode == "keys":
            hash_ids = reqs.request_keys(i)
            m = cache.match_keys(hash_ids, ns, num_tokens=n)
            limit = len(hash_ids)
        else:
            assert reqs.prompts is not None
            prompt = reqs.prompts[i]
            m = cache.match(prompt, ns)
            limit = (n - 1) // bs
        try:
            p = m.cached_blocks
            t = tier.lookup(keys, p, limit)
            if t:
                if reqs.mode == "keys":
                    loaded = cache.commit_keys(m.handle, hash_ids[: p + t], keep_for=keep_for)
                else:
                    loaded = cache.commit(m.handle, prompt[: (p + t) * bs], keep_for=keep_for)
                t = loaded.cached_blocks - p
            if reqs.mode == "keys":
                c = cache.commit_keys(m.handle, keep_for=keep_for)
            else:
                assert reqs.commits is not None
                c = cache.commit(m.handle, reqs.commits[i], keep_for=keep_for)
        finally:
            cache.release(m.handle)
        tier.add(keys[: c.cached_blocks])
        hit = p + t
        cached = min(hit * bs, n)
        causes = None if self.causes is None else self.causes.observe(i, cached, c, loaded)
        return cached, hit, c.cached_blocks - c.first_block + t, causes, (cached - m.cached_tokens, t, len(tier))


def replay(
    reqs: CacheRequests,
    capacity: Capacity,
    policy: ReplayPolicy = ReplayPolicy(),
    *,
    pool_blocks: int | None = None,
    on_row: OnRow | None = None,
    causes: bool = True,
    tier: Capacity | None = None,
) -> RunResult:
    """Replay every request of ``reqs`` in order through a fresh cache of ``capacity`` (above a fresh second
    tier of ``tier`` blocks when given: see the module docstring; ``Capacity(None)``: a tier without a limit).

    An unlimited capacity is a pool of ``UNLIMITED_POOL_BLOCKS`` (the core allocates nothing up front, so
    it costs only what is cached); ``pool_blocks`` overrides that.
    A KeyboardInterrupt stops the replay; the rows so far come back with ``partial=True``. ``causes``: see
    :class:`Replayer`.
    """
    if capacity.blocks is not None:
        pool = capacity.blocks
    else:
        pool = pool_blocks if pool_blocks is not None else UNLIMITED_POOL_BLOCKS
    rep = Replayer(reqs, pool, policy, causes=causes, tier=None if tier is None else TierIndex(tier.blocks))
    first = policy.measured_from(len(reqs))
    rows: list[Row] = []
    partial = False
    try:
        with fewer_gc_passes():
            for i in range(len(reqs)):
                row = rep.serve(i, i < first)
                rows.append(row)
                if on_row is not None:
                    on_row(row, rep.cache)
    except KeyboardInterrupt:
        partial = True
    rep.cache.reset()  # nobody reads this cache again: its tree goes now, not at a later collector pass
    return RunResult(capacity, pool, reqs.block_size, tuple(rows), partial, tier)


def simulate(
    reqs: CacheRequests,
    capacities: Sequence[Capacity],
    policy: ReplayPolicy = ReplayPolicy(),
    *,
    on_start: OnStart | None = None,
    on_row: OnRow | None = None,
    causes: bool = True,
    tier: Capacity | None = None,
) -> list[RunResult]:
    """One replay per capacity (a sweep), in the given order, each above a fresh tier of ``tier`` when given;
    stops after a replay that was interrupted. The workload's part of the miss causes is computed once, for
    every capacity (``causes``: see :class:`Replayer`)."""
    results = []
    for cap in capacities:
        if on_start is not None:
            on_start(cap, len(reqs))
        r = replay(reqs, cap, policy, on_row=on_row, causes=causes, tier=tier)
        results.append(r)
        if r.partial:
            break
    return results
