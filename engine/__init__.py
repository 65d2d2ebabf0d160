"""engine: the model side of prefixcache (torch + transformers)."""

from engine.wrapper import Explanation, PrefixCachedModel, RowStats, UncachedCallWarning, UnsupportedModelError

__all__ = ["Explanation", "PrefixCachedModel", "RowStats", "UncachedCallWarning", "UnsupportedModelError"]
