"""The cache core: config, chained block hashes, radix tree, allocator, eviction registry, stats and the
``PrefixCache`` facade. Imports only numpy, xxhash and sortedcontainers."""

from prefixcache.core.cache import CommitResult, MatchResult, PrefixCache, RequestHandle
from prefixcache.core.config import DEFAULT_NAMESPACE, CacheConfig
from prefixcache.core.errors import InputError
from prefixcache.core.eviction import POLICIES
from prefixcache.core.stats import CacheStats

__all__ = [
    "DEFAULT_NAMESPACE",
    "POLICIES",
    "CacheConfig",
    "CacheStats",
    "CommitResult",
    "InputError",
    "MatchResult",
    "PrefixCache",
    "RequestHandle",
]
