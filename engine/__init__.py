"""engine: the model side of prefixcache (torch + transformers)."""

from engine.wrapper import PrefixCachedModel, RowStats, UnsupportedModelError

__all__ = ["PrefixCachedModel", "RowStats", "UnsupportedModelError"]
