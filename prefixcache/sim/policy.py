"""The options of a replay, meaning the same wherever a workload is replayed (simulate, plan, benchmarks).

A :class:`Capacity` is a pool size (blocks, or unlimited); a :class:`ReplayPolicy` says how the cache is
run: the eviction policy, how long each request asks to keep its prefix (``keep_for``, honoured by the
"priority" policy on the trace's clock) and which leading share of the requests only warms the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixcache.core import POLICIES

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Capacity:
    """A pool size: ``blocks`` blocks, or unlimited (None: a pool that never evicts)."""

    blocks: int | None

    def __post_init__(self) -> None:
        b = self.blocks
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"a capacity must be a whole number of blocks >= 1 or unlimited, got {b!r}")

    @classmethod
    def from_tokens(cls, tokens: int | None, block_size: int) -> Capacity:
        """``tokens // block_size`` blocks (None: unlimited). Raises ValueError when that is < 1 block."""
        if tokens is None:
            return cls(None)
        if tokens < block_size:
            raise ValueError(f"capacity {tokens} tokens is less than one block of {block_size} tokens")
        return cls(tokens // block_size)

    @property
    def unlimited(self) -> bool:
        return self.blocks is None

    def tokens(self, block_size: int) -> int | None:
        """The capacity in tokens (None: unlimited)."""
        return None if self.blocks is None else self.blocks * block_size

    def label(self, block_size: int) -> str:
        return "unlimited" if self.blocks is None else f"{self.blocks * block_size:,} tokens ({self.blocks:,} blocks)"

    def sort_key(self) -> tuple[bool, int]:
        """Smallest first, unlimited last."""
        return (self.blocks is None, self.blocks or 0)


def measured_from(n_requests: int, warmup: float) -> int:
    """Index of the first measured request when the first ``warmup`` fraction only warms the cache.

    Raises ValueError unless 0 <= warmup < 1."""
    if isinstance(warmup, bool) or not isinstance(warmup, (int, float)) or not 0.0 <= warmup < 1.0:
        raise ValueError(f"warmup must be a fraction in [0, 1), got {warmup!r}")
    return math.floor(warmup * n_requests)


@dataclass(frozen=True)
class ReplayPolicy:
    """How a replay runs the cache.

    eviction: a name in ``prefixcache.core.POLICIES``.
    keep_for: seconds (trace time) each request asks the cache to keep its prefix; honoured by "priority".
    warmup:   the leading fraction of requests that only warms the cache (left out of the totals).
    """

    eviction: str = "lru"
    keep_for: float | None = None
    warmup: float = 0.0

    def __post_init__(self) -> None:
        if self.eviction not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.eviction!r}; known: {', '.join(sorted(POLICIES))}")
        k = self.keep_for
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, float)) or not k >= 0 or math.isinf(k)):
            raise ValueError(f"keep_for must be a number of seconds >= 0, got {k!r}")
        measured_from(0, self.warmup)

    def measured_from(self, n_requests: int) -> int:
        """Index of the first measured request of ``n_requests``."""
        return measured_from(n_requests, self.warmup)
