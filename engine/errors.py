"""The warnings and errors the model side raises (re-exported by ``engine``)."""

from __future__ import annotations


class UncachedCallWarning(UserWarning):
    """A generate call ran without the prefix cache (its reason is in the message and last_uncached_reason)."""


class StaleCacheWarning(UserWarning):
    """The wrapped model's weights changed since the cache was filled; the cached KV was dropped."""


class UnverifiedCacheWarning(UserWarning):
    """``verify_tokens=False``: a block-hash collision would serve another prompt's KV (wrong outputs)."""


class EngineFallbackWarning(UserWarning):
    """A batch API call could not run on the paged engine (the reason is in the message) and ran another way."""


class UnsupportedModelError(ValueError):
    """The model's cache cannot be served from a prefix cache (recurrent state, encoder-decoder, ...)."""


class LoadCheckError(RuntimeError):
    """A cached path failed its check at load on this install (an unknown cache-layer member, a probe beyond float
    tolerance, a probe that raised): ``ModelRuntime`` catches it and runs the model uncached with the reason."""
