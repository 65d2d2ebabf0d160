"""THE replay loop: a workload's requests, in order, through a fresh ``PrefixCache`` per capacity.

Every model-free caller goes through here: ``prefixcache simulate``, the policy replays of ``plan``, the
benchmarks, and anything later (a cluster of replicas drives several :class:`Replayer` s). Per request:
the cache's clock moves to the request's timestamp (milliseconds -> seconds; requests without one keep
the previous time), then ``match`` (or ``match_keys``), ``commit`` (or ``commit_keys``, with the policy's
``keep_for``), ``release`` — see ``prefixcache.sim.requests`` for what is looked up and committed. Each row
also says why its uncached tokens missed (``prefixcache.sim.causes``: the workload's part is computed once
and shared by every replay of it; a :class:`CauseTracker` follows this cache for the rest).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from prefixcache.core import CacheConfig, PrefixCache
from prefixcache.sim.causes import CauseTracker, workload_causes
from prefixcache.sim.policy import Capacity, ReplayPolicy
from prefixcache.sim.requests import CacheRequests
from prefixcache.sim.results import NO_CAUSES, Row, RunResult

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


class Replayer:
    """One cache of ``pool_blocks`` blocks that serves ``reqs``' requests one at a time (``serve(i)``).

    Rows carry miss causes while requests are served in order 0, 1, 2, ... (as :func:`replay` does); after a
    request served out of order, the causes are None (the tracker would otherwise guess). ``causes=False``
    leaves them out (None) for callers that never read them (plan's policy replays, benchmarks)."""

    def __init__(self, reqs: CacheRequests, pool_blocks: int, policy: ReplayPolicy, *, causes: bool = True) -> None:
        self.reqs = reqs
        self.policy = policy
        self.clock = TraceClock()
        config = CacheConfig(num_blocks=pool_blocks, block_size=reqs.block_size, eviction=policy.eviction)
        self.cache = PrefixCache(config, clock=self.clock)
        self.causes = CauseTracker(workload_causes(reqs)) if causes else None

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
        if reqs.mode == "keys":
            keys = reqs.request_keys(i)
            cached, hit, c = cache.serve_keys(keys, ns, num_tokens=n, keep_for=self.policy.keep_for)
        else:
            assert reqs.prompts is not None and reqs.commits is not None
            m = cache.match(reqs.prompts[i], ns)
            try:
                c = cache.commit(m.handle, reqs.commits[i], keep_for=self.policy.keep_for)
            finally:
                cache.release(m.handle)
            cached, hit = m.cached_tokens, m.cached_blocks
        causes = None if self.causes is None else self.causes.observe(i, cached, c)
        return Row._make(
            (
                i,
                ns,
                n,
                cached,
                reqs.lookup_blocks[i],
                hit,
                c.cached_blocks - c.first_block,
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
        )


def replay(
    reqs: CacheRequests,
    capacity: Capacity,
    policy: ReplayPolicy = ReplayPolicy(),
    *,
    pool_blocks: int | None = None,
    on_row: OnRow | None = None,
    causes: bool = True,
) -> RunResult:
    """Replay every request of ``reqs`` in order through a fresh cache of ``capacity``.

    An unlimited capacity is a pool of ``UNLIMITED_POOL_BLOCKS`` (the core allocates nothing up front, so
    it costs only what is cached); ``pool_blocks`` overrides that.
    A KeyboardInterrupt stops the replay; the rows so far come back with ``partial=True``. ``causes``: see
    :class:`Replayer`.
    """
    if capacity.blocks is not None:
        pool = capacity.blocks
    else:
        pool = pool_blocks if pool_blocks is not None else UNLIMITED_POOL_BLOCKS
    rep = Replayer(reqs, pool, policy, causes=causes)
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
    return RunResult(capacity, pool, reqs.block_size, tuple(rows), partial)


def simulate(
    reqs: CacheRequests,
    capacities: Sequence[Capacity],
    policy: ReplayPolicy = ReplayPolicy(),
    *,
    on_start: OnStart | None = None,
    on_row: OnRow | None = None,
    causes: bool = True,
) -> list[RunResult]:
    """One replay per capacity (a sweep), in the given order; stops after a replay that was interrupted. The
    workload's part of the miss causes is computed once, for every capacity (``causes``: see :class:`Replayer`)."""
    results = []
    for cap in capacities:
        if on_start is not None:
            on_start(cap, len(reqs))
        r = replay(reqs, cap, policy, on_row=on_row, causes=causes)
        results.append(r)
        if r.partial:
            break
    return results
