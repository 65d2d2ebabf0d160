"""What a replay measured: one :class:`Row` per request, a :class:`RunResult` per capacity, and totals.

Rows are NamedTuples (cheap to make on the hot path); a run keeps them in replay order. Times are
seconds, None when not measured (only a model replay measures them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
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
    no_state_tokens: int | None = None  # a hybrid model's KV was cached but no recurrent-state snapshot reached it
    reuse_blocks: int | None = None  # LRU capacity (blocks) that would have kept every evicted block
    shared_tokens: int | None = None  # the longest common prefix with any earlier request's sequence
    shared_with: int | None = None  # that earlier request
    # the second tier (prefixcache.core.tier; None: replayed without one). ``cached_tokens`` and ``hit_blocks``
    # count every token and block served without prefill, pool and tier together; these are the tier's part
    tier_tokens: int | None = None  # tokens the tier served (loaded into the pool before the suffix)
    tier_blocks: int | None = None  # blocks the tier served
    tier_used_blocks: int | None = None  # blocks the tier holds after this request


ROW_FIELDS: tuple[str, ...] = Row._fields
CAUSE_FIELDS: dict[str, str] = {  # cause -> its Row field, in the order of prefixcache.sim.causes.CAUSES
    "cold": "cold_tokens",
    "evicted": "evicted_tokens",
    "diverged": "diverged_tokens",
    "partial_block": "partial_block_tokens",
    "namespace": "namespace_tokens",
    "not_cached": "not_cached_tokens",
    "no_state": "no_state_tokens",
}
NO_CAUSES: tuple[None, ...] = (None,) * 10  # the cause fields of a row that was not analysed
TIER_FIELDS: tuple[str, ...] = ("tier_tokens", "tier_blocks", "tier_used_blocks")
NO_TIER: tuple[None, ...] = (None,) * len(TIER_FIELDS)  # the tier fields of a row replayed without a tier


@dataclass(frozen=True)
class RunResult:
    """The rows of one replay at one capacity; ``partial`` when it was stopped early.

    ``pool_blocks`` is the pool the replay really used (for an unlimited capacity: one big enough that
    nothing was ever evicted). ``tier``: the second tier's capacity (None: no tier; ``Capacity(None)``: a tier
    without a limit).
    """

    capacity: Capacity
    pool_blocks: int
    block_size: int
    rows: tuple[Row, ...]
    partial: bool = False
    tier: Capacity | None = None

    @property
    def capacity_tokens(self) -> int | None:
        return self.capacity.tokens(self.block_size)

    def totals(self) -> dict[str, Any]:
        """Sums and rates over the measured rows (see :func:`totals`; computed once, a fresh dict each call)."""
        return dict(self._totals)

    @cached_property
    def _totals(self) -> dict[str, Any]:
        return totals(self.rows, self.capacity, self.pool_blocks, self.block_size, cols=self.columns, tier=self.tier)

    @cached_property
    def columns(self) -> dict[str, tuple[Any, ...]]:
        """The rows column by column: ``ROW_FIELDS`` -> one value per row, in replay order (made once)."""
        return columns(self.rows)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def columns(rows: Sequence[Row]) -> dict[str, tuple[Any, ...]]:
    """``rows`` column by column: ``ROW_FIELDS`` -> one value per row, in order."""
    cols = list(zip(*rows)) if rows else [() for _ in ROW_FIELDS]
    return dict(zip(ROW_FIELDS, cols))


def totals(
    rows: Iterable[Row],
    capacity: Capacity,
    pool_blocks: int,
    block_size: int,
    *,
    cols: dict[str, tuple[Any, ...]] | None = None,
    tier: Capacity | None = None,
) -> dict[str, Any]:
    """Sums and rates over the measured (non-warm-up) rows (``cols``: their ``columns``, when made already;
    ``tier``: the second tier's capacity, None without one). ``cached_tokens``, ``hit_blocks`` and their rates
    count pool and tier together; ``pool_*`` and ``tier_*`` split them (None without a tier). Changes nothing."""
    rows = list(rows)
    c = columns(rows) if cols is None else cols
    if True in c["warmup"]:
        c = columns([r for r in rows if not r.warmup])
    n = len(c["index"])
    prompt = sum(c["prompt_tokens"])
    cached = sum(c["cached_tokens"])
    blocks = sum(c["blocks"])
    hit_blocks = sum(c["hit_blocks"])
    with_hit = n - c["hit_blocks"].count(0)  # hit blocks are counts: > 0 unless 0
    peak = max(c["pool_used_blocks"], default=0)
    t: dict[str, Any] = {
        "capacity_tokens": capacity.tokens(block_size),
        "capacity_blocks": capacity.blocks,
        "pool_blocks": pool_blocks,
        "block_size": block_size,
        "requests": n,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "blocks": blocks,
        "hit_blocks": hit_blocks,
        "block_hit_rate": hit_blocks / blocks if blocks else 0.0,
        "requests_with_hit": with_hit,
        "hit_request_share": with_hit / n if n else 0.0,
        "prefill_tokens_saved": cached,
        "inserted_blocks": sum(c["inserted_blocks"]),
        "evicted_blocks": sum(c["evicted_blocks"]),
        "peak_pool_blocks": peak,
        "peak_pool_occupancy": None if capacity.blocks is None else peak / pool_blocks,
    }
    t.update(_tier_totals(c, tier, block_size, prompt, cached, blocks, hit_blocks))
    analysed = n > 0 and not any(None in c[f] for f in CAUSE_FIELDS.values())
    t["uncached_tokens"] = prompt - cached
    for f in CAUSE_FIELDS.values():
        t[f] = sum(c[f]) if analysed else None
    t["partial_block_share"] = t["partial_block_tokens"] / prompt if analysed and prompt else None

    def given(field: str) -> list[Any]:
        return [v for v in c[field] if v is not None]

    ttft_c = given("ttft_cached_s")
    ttft_u = given("ttft_uncached_s")
    if ttft_c or ttft_u:
        for name, vals in (("cached", ttft_c), ("uncached", ttft_u)):
            for q in (50, 90, 99):
                t[f"ttft_{name}_p{q}_s"] = percentile(vals, q)
        tot_c = given("total_cached_s")
        tot_u = given("total_uncached_s")
        t["time_cached_s"] = sum(tot_c) if tot_c else None
        t["time_uncached_s"] = sum(tot_u) if tot_u else None
        c50, u50 = t["ttft_cached_p50_s"], t["ttft_uncached_p50_s"]
        t["ttft_speedup_p50"] = u50 / c50 if c50 and u50 else None
        checked = given("outputs_match")
        t["outputs_checked"] = len(checked)
        t["outputs_mismatched"] = sum(1 for ok in checked if not ok)
    return t


def _tier_totals(
    c: dict[str, tuple[Any, ...]],
    tier: Capacity | None,
    block_size: int,
    prompt: int,
    cached: int,
    blocks: int,
    hit_blocks: int,
) -> dict[str, Any]:
    """The pool / tier split of the served tokens and blocks (all None without a tier)."""
    keys = (
        "tier_capacity_blocks",
        "tier_capacity_tokens",
        "pool_tokens",
        "tier_tokens",
        "pool_token_hit_rate",
        "tier_token_hit_rate",
        "pool_hit_blocks",
        "tier_hit_blocks",
        "pool_block_hit_rate",
        "tier_block_hit_rate",
        "peak_tier_blocks",
    )
    if tier is None:
        return {"tier": False, **dict.fromkeys(keys)}
    tier_tokens = sum(v or 0 for v in c["tier_tokens"])
    tier_blocks = sum(v or 0 for v in c["tier_blocks"])
    values = (
        tier.blocks,
        tier.tokens(block_size),
        cached - tier_tokens,
        tier_tokens,
        (cached - tier_tokens) / prompt if prompt else 0.0,
        tier_tokens / prompt if prompt else 0.0,
        hit_blocks - tier_blocks,
        tier_blocks,
        (hit_blocks - tier_blocks) / blocks if blocks else 0.0,
        tier_blocks / blocks if blocks else 0.0,
        max((v or 0 for v in c["tier_used_blocks"]), default=0),
    )
    return {"tier": True, **dict(zip(keys, values))}
