"""What a replay measured: one :class:`Row` per request, a :class:`RunResult` per capacity, and totals.

Rows are NamedTuples (cheap to make on the hot path); a run keeps them in replay order. Times are
seconds, None when not measured (only a model replay measures them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from prefixcache.sim.policy import Capacity


class Row(NamedTuple):
    """One request's outcome at one capacity."""

    index: int  # type: ignore[assignment]  # a field named like tuple.index, kept for the record format
    namespace: str
    prompt_tokens: int
    cached_tokens: int
    blocks: int  # blocks looked up (hash ids of a trace; ceil(prompt / block_size) for token prompts)
    hit_blocks: int
    inserted_blocks: int
    evicted_blocks: int  # evicted while serving this request
    pool_used_blocks: int  # cached blocks in the pool after this request's commit
    warmup: bool = False  # True: served to warm the cache, left out of the totals
    timestamp: float | None = None  # milliseconds
    output_tokens: int | None = None
    ttft_cached_s: float | None = None
    total_cached_s: float | None = None
    ttft_uncached_s: float | None = None
    total_uncached_s: float | None = None
    outputs_match: bool | None = None
    # why the uncached tokens missed (prefixcache.sim.causes; None: not analysed): they sum to prompt - cached
    cold_tokens: int | None = None
    evicted_tokens: int | None = None
    diverged_tokens: int | None = None
    partial_block_tokens: int | None = None
    namespace_tokens: int | None = None
    not_cached_tokens: int | None = None
    reuse_blocks: int | None = None  # LRU capacity (blocks) that would have kept every evicted block
    shared_tokens: int | None = None  # the longest common prefix with any earlier request's sequence
    shared_with: int | None = None  # that earlier request


ROW_FIELDS: tuple[str, ...] = Row._fields
CAUSE_FIELDS: dict[str, str] = {  # cause -> its Row field, in the order of prefixcache.sim.causes.CAUSES
    "cold": "cold_tokens",
    "evicted": "evicted_tokens",
    "diverged": "diverged_tokens",
    "partial_block": "partial_block_tokens",
    "namespace": "namespace_tokens",
    "not_cached": "not_cached_tokens",
}
NO_CAUSES: tuple[None, ...] = (None,) * 9  # the cause fields of a row that was not analysed


@dataclass(frozen=True)
class RunResult:
    """The rows of one replay at one capacity; ``partial`` when it was stopped early.

    ``pool_blocks`` is the pool the replay really used (for an unlimited capacity: one big enough that
    nothing was ever evicted).
    """

    capacity: Capacity
    pool_blocks: int
    block_size: int
    rows: tuple[Row, ...]
    partial: bool = False

    @property
    def capacity_tokens(self) -> int | None:
        return self.capacity.tokens(self.block_size)

    def totals(self) -> dict[str, Any]:
        """Sums and rates over the measured rows (see :func:`totals`)."""
        return totals(self.rows, self.capacity, self.pool_blocks, self.block_size)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def totals(rows: Iterable[Row], capacity: Capacity, pool_blocks: int, block_size: int) -> dict[str, Any]:
    """Sums and rates over the measured (non-warm-up) rows. Changes nothing."""
    rows = [r for r in rows if not r.warmup]
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.cached_tokens for r in rows)
    blocks = sum(r.blocks for r in rows)
    hit_blocks = sum(r.hit_blocks for r in rows)
    with_hit = sum(1 for r in rows if r.hit_blocks > 0)
    peak = max((r.pool_used_blocks for r in rows), default=0)
    t: dict[str, Any] = {
        "capacity_tokens": capacity.tokens(block_size),
        "capacity_blocks": capacity.blocks,
        "pool_blocks": pool_blocks,
        "block_size": block_size,
        "requests": len(rows),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "blocks": blocks,
        "hit_blocks": hit_blocks,
        "block_hit_rate": hit_blocks / blocks if blocks else 0.0,
        "requests_with_hit": with_hit,
        "hit_request_share": with_hit / len(rows) if rows else 0.0,
        "prefill_tokens_saved": cached,
        "inserted_blocks": sum(r.inserted_blocks for r in rows),
        "evicted_blocks": sum(r.evicted_blocks for r in rows),
        "peak_pool_blocks": peak,
        "peak_pool_occupancy": None if capacity.blocks is None else peak / pool_blocks,
    }
    analysed = bool(rows) and all(getattr(r, f) is not None for f in CAUSE_FIELDS.values() for r in rows)
    t["uncached_tokens"] = prompt - cached
    for f in CAUSE_FIELDS.values():
        t[f] = sum(getattr(r, f) for r in rows) if analysed else None
    t["partial_block_share"] = t["partial_block_tokens"] / prompt if analysed and prompt else None
    ttft_c = [r.ttft_cached_s for r in rows if r.ttft_cached_s is not None]
    ttft_u = [r.ttft_uncached_s for r in rows if r.ttft_uncached_s is not None]
    if ttft_c or ttft_u:
        for name, vals in (("cached", ttft_c), ("uncached", ttft_u)):
            for q in (50, 90, 99):
                t[f"ttft_{name}_p{q}_s"] = percentile(vals, q)
        tot_c = [r.total_cached_s for r in rows if r.total_cached_s is not None]
        tot_u = [r.total_uncached_s for r in rows if r.total_uncached_s is not None]
        t["time_cached_s"] = sum(tot_c) if tot_c else None
        t["time_uncached_s"] = sum(tot_u) if tot_u else None
        c50, u50 = t["ttft_cached_p50_s"], t["ttft_uncached_p50_s"]
        t["ttft_speedup_p50"] = u50 / c50 if c50 and u50 else None
        checked = [r.outputs_match for r in rows if r.outputs_match is not None]
        t["outputs_checked"] = len(checked)
        t["outputs_mismatched"] = sum(1 for ok in checked if not ok)
    return t
