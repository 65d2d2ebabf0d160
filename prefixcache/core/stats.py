"""Counters of one PrefixCache."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CacheStats:
    """Running totals since the cache was made (or reset). Mutated only by PrefixCache."""

    lookups: int = 0
    prompt_tokens: int = 0  # tokens offered to lookups
    cached_tokens: int = 0  # of those, served from cache
    lookup_blocks: int = 0  # blocks offered to lookups (full blocks, or keys)
    hit_blocks: int = 0  # of those, served from cache
    lookups_with_hit: int = 0
    blocks_inserted: int = 0
    blocks_evicted: int = 0
    blocks_not_cached: int = 0  # committed blocks that did not fit (everything else pinned)

    @property
    def token_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0

    def as_dict(self) -> dict[str, int | float]:
        d = asdict(self)
        d["token_hit_rate"] = self.token_hit_rate
        d["block_hit_rate"] = self.block_hit_rate
        return d
