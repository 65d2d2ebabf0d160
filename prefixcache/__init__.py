"""prefixcache: a block-hash radix tree over a KV block pool, model-free (no torch, no transformers).

Layers (each imports only those before it): ``core`` (the cache) <- ``workload`` (traces, scenarios) <-
``sim`` (replay, curves, planning) <- ``reports`` <- ``cli``. The model side lives in the ``engine`` package.
"""

from prefixcache._version import __version__
from prefixcache.core import (
    DEFAULT_NAMESPACE,
    POLICIES,
    CacheConfig,
    CacheStats,
    CommitResult,
    MatchResult,
    PrefixCache,
    RequestHandle,
)

__all__ = [
    "DEFAULT_NAMESPACE",
    "POLICIES",
    "CacheConfig",
    "CacheStats",
    "CommitResult",
    "MatchResult",
    "PrefixCache",
    "RequestHandle",
    "__version__",
]
