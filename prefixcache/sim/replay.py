"""Model-free replay of a scenario or trace through PrefixCache.

Hash-id traces go through ``match_keys`` / ``commit_keys`` / ``release``: every hash id of a request may
hit and every one is committed (also the partial last block: its id names that partial block). Token
scenarios go through ``match`` / ``commit`` / ``release``; the reply a model would generate is synthesised
(seeded ASCII, ``max_new_tokens`` byte tokens) and cached with the prompt, less its last token (which has no
KV yet in a real model), and it joins the history of later turns of a conversation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prefixcache.core.cache import PrefixCache
from prefixcache.core.config import CacheConfig
from prefixcache.reports.record import Row, RunResult
from prefixcache.workload.render import ByteRenderer, Conversations, Renderer, synthetic_reply
from prefixcache.workload.scenario import Scenario
from prefixcache.workload.trace import Trace

OnRow = Callable[[Row, PrefixCache], None]
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Capacity:
    """A pool size: ``blocks`` blocks, or unlimited (a pool big enough that nothing is ever evicted)."""

    blocks: int | None  # None = unlimited

    @classmethod
    def from_tokens(cls, tokens: int | None, block_size: int) -> Capacity:
        """``tokens // block_size`` blocks (None: unlimited). Raises ValueError when that is < 1 block."""
        if tokens is None:
            return cls(None)
        if tokens < block_size:
            raise ValueError(f"capacity {tokens} tokens is less than one block of {block_size} tokens")
        return cls(tokens // block_size)

    def label(self, block_size: int) -> str:
        return "unlimited" if self.blocks is None else f"{self.blocks * block_size:,} tokens ({self.blocks:,} blocks)"


def warmup_count(n: int, warmup: float) -> int:
    """Requests used to warm the cache: the first ``floor(warmup * n)``. Raises ValueError unless 0 <= warmup < 1."""
    if not 0.0 <= warmup < 1.0:
        raise ValueError(f"warmup must be a fraction in [0, 1), got {warmup}")
    return int(warmup * n)


def unlimited_blocks(scenario: Scenario, block_size: int) -> int:
    """A pool size at which the scenario never evicts (an upper bound on the blocks it can insert)."""
    if scenario.trace is not None:
        return max(1, scenario.trace.unique_blocks())
    conv = Conversations()
    r = ByteRenderer()
    total = 0
    for i, req in enumerate(scenario.requests):
        n = len(conv.prompt(req, r)) + (req.max_new_tokens or scenario.max_new_tokens)
        total += n // block_size + 1
        conv.add_reply(req, synthetic_reply(scenario.seed, i, req.max_new_tokens or scenario.max_new_tokens))
    return max(1, total * 2)  # chat replies re-rendered as text may differ in length; stay generous


def simulate_trace(
    trace: Trace,
    num_blocks: int,
    *,
    eviction: str = "lru",
    warmup: float = 0.0,
    unlimited: bool = False,
    on_row: OnRow | None = None,
) -> RunResult:
    """Replay ``trace`` in its order through a fresh cache of ``num_blocks`` blocks of the trace's block size.

    A KeyboardInterrupt stops the replay; the rows so far come back with ``partial=True``.
    """
    cache = PrefixCache(CacheConfig(num_blocks=num_blocks, block_size=trace.block_size, eviction=eviction))
    n = len(trace)
    n_warm = warmup_count(n, warmup)
    ids, offsets, in_len, ts, nss = (
        trace.ids,
        trace.offsets.tolist(),
        trace.input_length.tolist(),
        trace.timestamp.tolist(),
        trace.namespace,
    )
    rows: list[Row] = []
    stats = cache.stats
    partial = False
    try:
        for i in range(n):
            keys = ids[offsets[i] : offsets[i + 1]].tolist()
            evicted0 = stats.blocks_evicted
            m = cache.match_keys(keys, nss[i], num_tokens=in_len[i])
            try:
                c = cache.commit_keys(m.handle)
            finally:
                cache.release(m.handle)
            row = Row(
                i,
                nss[i],
                in_len[i],
                m.cached_tokens,
                len(keys),
                m.cached_blocks,
                len(c.block_ids),
                stats.blocks_evicted - evicted0,
                cache.num_cached_blocks,
                i < n_warm,
                ts[i],
            )
            rows.append(row)
            if on_row is not None:
                on_row(row, cache)
    except KeyboardInterrupt:
        partial = True
    return RunResult(num_blocks, trace.block_size, tuple(rows), partial, unlimited)


def simulate_requests(
    scenario: Scenario,
    num_blocks: int,
    block_size: int,
    *,
    eviction: str = "lru",
    warmup: float = 0.0,
    unlimited: bool = False,
    renderer: Renderer | None = None,
    on_row: OnRow | None = None,
) -> RunResult:
    """Replay a text/chat/token scenario through a fresh cache; replies are synthesised (see module doc).

    A KeyboardInterrupt stops the replay; the rows so far come back with ``partial=True``.
    """
    cache = PrefixCache(CacheConfig(num_blocks=num_blocks, block_size=block_size, eviction=eviction))
    renderer = renderer or ByteRenderer()
    conv = Conversations()
    reqs = scenario.requests
    n_warm = warmup_count(len(reqs), warmup)
    rows: list[Row] = []
    stats = cache.stats
    partial = False
    try:
        for i, req in enumerate(reqs):
            prompt = conv.prompt(req, renderer)
            k = req.max_new_tokens or scenario.max_new_tokens
            reply = synthetic_reply(scenario.seed, i, k)
            evicted0 = stats.blocks_evicted
            m = cache.match(prompt, req.namespace)
            try:
                c = cache.commit(m.handle, prompt + list(reply.encode("ascii"))[:-1])
            finally:
                cache.release(m.handle)
            conv.add_reply(req, reply)
            row = Row(
                i,
                req.namespace,
                len(prompt),
                m.cached_tokens,
                -(-len(prompt) // block_size),
                m.cached_blocks,
                len(c.block_ids),
                stats.blocks_evicted - evicted0,
                cache.num_cached_blocks,
                i < n_warm,
                req.timestamp,
                k,
            )
            rows.append(row)
            if on_row is not None:
                on_row(row, cache)
    except KeyboardInterrupt:
        partial = True
    return RunResult(num_blocks, block_size, tuple(rows), partial, unlimited)


def simulate(
    scenario: Scenario,
    capacities: list[Capacity],
    *,
    block_size: int | None = None,
    eviction: str = "lru",
    warmup: float = 0.0,
    on_start: Callable[[Capacity, int], None] | None = None,
    on_row: OnRow | None = None,
) -> list[RunResult]:
    """One replay per capacity (a sweep), in the given order. Stops after a replay that was interrupted."""
    bs = block_size or scenario.block_size or (scenario.trace.block_size if scenario.trace else DEFAULT_BLOCK_SIZE)
    results = []
    unl = None
    for cap in capacities:
        if cap.blocks is None and unl is None:
            unl = unlimited_blocks(scenario, bs)
        nb = cap.blocks if cap.blocks is not None else unl
        assert nb is not None
        if on_start is not None:
            on_start(cap, len(scenario))
        if scenario.trace is not None:
            r = simulate_trace(
                scenario.trace, nb, eviction=eviction, warmup=warmup, unlimited=cap.blocks is None, on_row=on_row
            )
        else:
            r = simulate_requests(
                scenario, nb, bs, eviction=eviction, warmup=warmup, unlimited=cap.blocks is None, on_row=on_row
            )
        results.append(r)
        if r.partial:
            break
    return results
