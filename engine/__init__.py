"""engine: the model side of prefixcache (torch + transformers)."""

from engine.wrapper import PrefixCachedModel, RowStats, UncachedCallWarning, UnsupportedModelError

__all__ = ["PrefixCachedModel", "RowStats", "UncachedCallWarning", "UnsupportedModelError"]
