"""engine: the model side of prefixcache (torch + transformers)."""

from engine.contiguous import RowStats
from engine.errors import (
    EngineFallbackWarning,
    StaleCacheWarning,
    UncachedCallWarning,
    UnsupportedModelError,
    UnverifiedCacheWarning,
)
from engine.explain import Explanation
from engine.memory import PoolSizeWarning, PoolTooLargeError
from engine.runtime import ModelRuntime, RuntimeConfig
from engine.wrapper import PrefixCachedModel

__all__ = [
    "EngineFallbackWarning",
    "Explanation",
    "ModelRuntime",
    "PoolSizeWarning",
    "PoolTooLargeError",
    "PrefixCachedModel",
    "RowStats",
    "RuntimeConfig",
    "StaleCacheWarning",
    "UncachedCallWarning",
    "UnsupportedModelError",
    "UnverifiedCacheWarning",
]
