"""prefixcache: a block-hash radix tree over a KV block pool, model-free (no torch, no transformers)."""

from prefixcache.cache import DEFAULT_NAMESPACE, CommitResult, MatchResult, PrefixCache, RequestHandle
from prefixcache.config import CacheConfig
from prefixcache.eviction import POLICIES
from prefixcache.stats import CacheStats

__all__ = [
    "CacheConfig",
    "CacheStats",
    "CommitResult",
    "DEFAULT_NAMESPACE",
    "MatchResult",
    "POLICIES",
    "PrefixCache",
    "RequestHandle",
]
__version__ = "0.1.0"
