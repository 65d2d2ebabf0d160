"""The cache namespace of a model and a caller's name (imports nothing heavy: the Ray router uses it too)."""

from __future__ import annotations


def cache_namespace(fingerprint: str, name: str) -> str:
    """The namespace a model with ``fingerprint`` caches the caller's ``name`` (tenant, adapter, cache salt) under:
    caches of different models, and of different names, never share a block."""
    return f"{fingerprint}:{name}"
