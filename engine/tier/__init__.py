"""The second tier below the KV pool: entries on local disk (LMDB) or a shared Redis, written through, loaded
back into the pool by the chained block keys a match stops at. See ``engine.tier.kv_tier``."""

from engine.tier.entry import EntryError, TierBinding
from engine.tier.kv_tier import KVTier, TierCounters, TierWarning
from engine.tier.lmdb_store import LmdbStore, StoreError
from engine.tier.open import open_tier
from engine.tier.redis_store import RedisStore
from prefixcache.core.checks import parse_bytes

__all__ = [
    "EntryError",
    "KVTier",
    "LmdbStore",
    "RedisStore",
    "StoreError",
    "TierBinding",
    "TierCounters",
    "TierWarning",
    "open_tier",
    "parse_bytes",
]
