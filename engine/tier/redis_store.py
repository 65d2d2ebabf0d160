"""RedisStore: a shared second tier on a Redis (or Valkey) server, for several processes or machines.

The same entries as on disk (``engine.tier.entry``), under the same store keys (prefixed ``pc:``), so two
processes serving one model share every block either of them wrote. The server owns the budget: run it with
``maxmemory`` and ``maxmemory-policy allkeys-lru`` (the process keeps no index of a shared tier; a lookup asks
the server). Every call has a short socket timeout; a failure raises ``StoreError`` at once, and the tier
above it stops asking for ``RETRY_S`` (requests are served from the pool or recomputed meanwhile).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from engine.tier.lmdb_store import StoreError

KEY_PREFIX = b"pc:"
SOCKET_TIMEOUT_S = 2.0


class RedisStore:
    """Entries on the Redis server at ``url`` (``redis://host:port/db``)."""

    shared = True
    readonly = False
    capped = False

    def __init__(self, url: str, *, socket_timeout: float = SOCKET_TIMEOUT_S) -> None:
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - the [serve] extra installs it
            raise StoreError("a shared tier needs the redis package: pip install 'prefixcache[tier]'") from exc
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise StoreError(f"shared cache {url!r}: expected a redis:// (or rediss://, unix://) URL")
        self.url = url
        self.name = f"shared cache {url}"
        self._errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout, retry_on_timeout=False
        )
        self.ping()

    def ping(self) -> None:
        """Raise StoreError unless the server answers."""
        self._call(self.client.ping)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._errors as exc:
            raise StoreError(f"{self.name}: {type(exc).__name__}: {exc}") from exc

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(KEY_PREFIX + k)
        return [bool(x) for x in self._call(pipe.execute)]

    def read(self, keys: Sequence[bytes], use: Callable[[int, Any], bool]) -> None:
        """Call ``use(i, entry)`` for ``keys[i]`` in order (one MGET), until it returns False."""
        if not keys:
            return
        values = self._call(self.client.mget, [KEY_PREFIX + k for k in keys])
        for i, value in enumerate(values):
            if not use(i, value):
                break

    def write(self, puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key in deletes:
            pipe.delete(KEY_PREFIX + key)
        for key, entry in puts:
            pipe.set(KEY_PREFIX + key, entry)
        self._call(pipe.execute)

    def scan(self, prefix: bytes) -> list[bytes]:
        """A shared tier keeps no local index: nothing to restore."""
        return []

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self.client.close()
