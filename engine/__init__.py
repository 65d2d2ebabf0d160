"""engine: the model side of prefixcache (torch + transformers)."""

from engine.memory import PoolSizeWarning, PoolTooLargeError
from engine.wrapper import (
    Explanation,
    PrefixCachedModel,
    RowStats,
    StaleCacheWarning,
    UncachedCallWarning,
    UnsupportedModelError,
    UnverifiedCacheWarning,
)

__all__ = [
    "Explanation",
    "PoolSizeWarning",
    "PoolTooLargeError",
    "PrefixCachedModel",
    "RowStats",
    "StaleCacheWarning",
    "UncachedCallWarning",
    "UnsupportedModelError",
    "UnverifiedCacheWarning",
]
