"""engine: the model side of prefixcache (torch + transformers)."""

from engine.wrapper import (
    PrefixCachedModel,
    RowStats,
    StaleCacheWarning,
    UncachedCallWarning,
    UnsupportedModelError,
    UnverifiedCacheWarning,
)

__all__ = [
    "PrefixCachedModel",
    "RowStats",
    "StaleCacheWarning",
    "UncachedCallWarning",
    "UnsupportedModelError",
    "UnverifiedCacheWarning",
]
