"""The cache core: config, chained block hashes, radix tree, allocator, eviction registry, stats, events and
the ``PrefixCache`` facade. Imports only numpy, xxhash and sortedcontainers."""

from prefixcache.core.cache import (
    BlockCommit,
    CommitResult,
    Divergence,
    MatchResult,
    OutOfBlocks,
    PrefixCache,
    RequestHandle,
)
from prefixcache.core.config import DEFAULT_NAMESPACE, CacheConfig
from prefixcache.core.errors import InputError
from prefixcache.core.events import BlocksRemoved, BlocksStored, CacheCleared, CacheEvent
from prefixcache.core.eviction import POLICIES
from prefixcache.core.hashing import block_keys
from prefixcache.core.stats import CacheStats
from prefixcache.core.tier import TierIndex, TierStats

__all__ = [
    "DEFAULT_NAMESPACE",
    "POLICIES",
    "BlockCommit",
    "BlocksRemoved",
    "BlocksStored",
    "CacheCleared",
    "CacheConfig",
    "CacheEvent",
    "CacheStats",
    "CommitResult",
    "Divergence",
    "InputError",
    "MatchResult",
    "OutOfBlocks",
    "PrefixCache",
    "RequestHandle",
    "TierIndex",
    "TierStats",
    "block_keys",
]
