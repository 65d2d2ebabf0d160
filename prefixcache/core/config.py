"""CacheConfig: the frozen settings of one PrefixCache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixcache.core.checks import check_int, check_str

DEFAULT_NAMESPACE = "default"  # the namespace of a request that names none
MAX_BLOCKS = 2**63 - 1  # block ids are int64


@dataclass(frozen=True)
class CacheConfig:
    """Settings of a prefix cache. Every field is type-checked (numpy integers are accepted for the ints and
    stored as ``int``; bools are not ints here).

    num_blocks:    pool size in blocks (each block holds ``block_size`` tokens of KV). Costs nothing until
                   used: a pool of 2**40 blocks is as cheap to make as one of 8.
    block_size:    tokens per block; only full blocks are cached.
    eviction:      name of an eviction policy in ``prefixcache.core.POLICIES``.
    hash_seed:     seed of the chained block hash; caches with different seeds never agree.
    verify_tokens: confirm every match against the cached token ids, so even a hash collision cannot serve
                   another prompt's KV. With the default hash the tree compares token bytes either way (it
                   is as cheap as comparing hashes); the flag matters with an injected hasher.
    """

    num_blocks: int
    block_size: int = 16
    eviction: str = "lru"
    hash_seed: int = 0
    verify_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size"):
            value = check_int(getattr(self, name), f"CacheConfig.{name}")
            if value <= 0:
                raise ValueError(f"CacheConfig.{name} must be > 0, got {value}")
            object.__setattr__(self, name, value)
        if self.num_blocks > MAX_BLOCKS:
            raise ValueError(f"CacheConfig.num_blocks must be < 2**63 (block ids are int64), got {self.num_blocks}")
        seed = check_int(self.hash_seed, "CacheConfig.hash_seed")
        if not 0 <= seed < 2**64:
            raise ValueError(f"CacheConfig.hash_seed must be an int in [0, 2**64), got {seed}")
        object.__setattr__(self, "hash_seed", seed)
        if not isinstance(self.verify_tokens, (bool, np.bool_)):
            raise TypeError(
                f"CacheConfig.verify_tokens must be a bool, got {type(self.verify_tokens).__name__} "
                f"{self.verify_tokens!r}"
            )
        object.__setattr__(self, "verify_tokens", bool(self.verify_tokens))
        check_str(self.eviction, "CacheConfig.eviction")
        from prefixcache.core.eviction import POLICIES  # late: eviction imports nothing from here

        if self.eviction not in POLICIES:
            raise ValueError(
                f"CacheConfig.eviction: unknown policy {self.eviction!r}; known: {', '.join(sorted(POLICIES))}"
            )

    @property
    def capacity_tokens(self) -> int:
        """Tokens the pool can hold."""
        return self.num_blocks * self.block_size
