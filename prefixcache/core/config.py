"""CacheConfig: the frozen settings of one PrefixCache."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NAMESPACE = "default"  # the namespace of a request that names none


@dataclass(frozen=True)
class CacheConfig:
    """Settings of a prefix cache.

    num_blocks:    pool size in blocks (each block holds ``block_size`` tokens of KV).
    block_size:    tokens per block; only full blocks are cached.
    eviction:      name of an eviction policy in ``prefixcache.eviction.POLICIES``.
    hash_seed:     seed of the chained block hash; caches with different seeds never agree.
    verify_tokens: keep each block's token ids and confirm every match against them, so even
                   a hash collision cannot serve another prompt's KV.
    """

    num_blocks: int
    block_size: int = 16
    eviction: str = "lru"
    hash_seed: int = 0
    verify_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"CacheConfig.{name} must be an int, got {type(value).__name__} {value!r}")
            if value <= 0:
                raise ValueError(f"CacheConfig.{name} must be > 0, got {value}")
        if isinstance(self.hash_seed, bool) or not isinstance(self.hash_seed, int) or not 0 <= self.hash_seed < 2**64:
            raise ValueError(f"CacheConfig.hash_seed must be an int in [0, 2**64), got {self.hash_seed!r}")
        from prefixcache.core.eviction import POLICIES  # late: eviction imports nothing from here

        if self.eviction not in POLICIES:
            raise ValueError(
                f"CacheConfig.eviction: unknown policy {self.eviction!r}; known: {', '.join(sorted(POLICIES))}"
            )

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool can hold."""
        return self.num_blocks * self.block_size
