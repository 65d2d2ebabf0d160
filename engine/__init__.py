"""engine: the model side of prefixcache (torch + transformers)."""

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
    "PrefixCachedModel",
    "RowStats",
    "StaleCacheWarning",
    "UncachedCallWarning",
    "UnsupportedModelError",
    "UnverifiedCacheWarning",
]
