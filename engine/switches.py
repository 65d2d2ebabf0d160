"""The engine's opt-out environment variables (``PREFIXCACHE_KERNEL``, ``PREFIXCACHE_HUGE_PAGES``,
``PREFIXCACHE_LAST_ROWS``, ``PREFIXCACHE_LEAN_LAYERS``, ``PREFIXCACHE_DECODE_LAYER``): one reading of what "off"
means for all of them."""

from __future__ import annotations

import os

OFF = ("0", "off", "no", "false")


def switched_off(name: str) -> bool:
    """Whether the environment variable ``name`` turns its feature off (0, off, no or false, any case). Reads only."""
    return os.environ.get(name, "").strip().lower() in OFF
