"""Routing requests across replicas that each keep their own prefix cache: an exact index of what every
replica holds, and the routing policies. Model-free: the Ray Serve router (``engine/serve/router.py``) and the
cluster simulator run the very same code.

``ClusterIndex`` is built from the replicas' own cache events (``BlocksStored`` / ``BlocksRemoved`` /
``CacheCleared``, see ``prefixcache.core.events``), never from guesses: an evicted prefix stops attracting
traffic as soon as its ``BlocksRemoved`` is applied. Block keys are chained, so one key names its block
together with every block before it (tokens mode: the cache's 16-byte digests, see
``prefixcache.core.hashing.block_keys``; keys mode: the caller's ids, e.g. Mooncake ``hash_ids``). The index
is therefore a map, per (mode, namespace), from key to the set of replicas holding that block (a bit mask);
a request's longest held prefix on a replica is the run of its leading keys that the replica holds, exactly
what that replica's ``PrefixCache.match`` would serve.

A policy turns "how many leading blocks each replica holds" and "how loaded each replica is" (plain numbers
the caller supplies: queue lengths, outstanding prefill tokens, ...) into a ``Decision``. ``ROUTING_POLICIES``
names them: ``round_robin``, ``least_loaded``, ``prefix`` (longest held prefix) and ``prefix_balanced``, after
SGLang's cache-aware router: the longest held prefix, unless the ``LoadGuard`` finds the replicas too
unbalanced (then the least loaded) or no replica holds any of the request ("cold") or the longest held prefix
covers less than ``min_match`` of it ("short"). Those go to the least loaded replica, except that with
``near`` > 0 a short held prefix settles near ties: among the replicas whose load is at most the least load +
``near``, the one holding the longest prefix (ties: least loaded, then in turn). A short prefix then keeps its
requests together where that costs at most ``near`` of load; a cold request still goes to the least loaded,
and the guard's branch stays purely least loaded (as SGLang's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from prefixcache.core.events import BlocksRemoved, BlocksStored, CacheCleared
from prefixcache.core.hashing import block_keys

R = TypeVar("R", bound=Hashable)  # a replica's id: an int in a simulation, a Ray replica id string, ...
Key = Hashable
CacheEvent = BlocksStored | BlocksRemoved | CacheCleared


class IndexSyncError(ValueError):
    """An event contradicts the index (a lost, repeated or reordered event): the index no longer mirrors
    that replica. The caller should drop the replica's entries (``forget``) rather than route on them."""


def prompt_keys(tokens: Any, namespace: str, *, block_size: int, hash_seed: int = 0) -> list[bytes]:
    """The keys a ``PrefixCache`` would look up for a token prompt in ``namespace``: its full blocks, but at
    most ``(n - 1) // block_size`` of them (one token always goes through the model). Changes nothing."""
    n = len(tokens)
    return block_keys(
        tokens, namespace, block_size=block_size, hash_seed=hash_seed, max_blocks=max(0, n - 1) // block_size
    )


class ClusterIndex(Generic[R]):
    """Which replica holds which cached block, exactly, as told by the replicas' cache events.

    Per (mode, namespace) a dict maps each held key to a bit mask of the replicas holding it. A replica is
    known from its first event or ``add_replica``; ``forget`` drops it and everything it held.
    """

    def __init__(self) -> None:
        self._maps: dict[tuple[str, str], dict[Key, int]] = {}
        self._bit: dict[R, int] = {}
        self._by_bit: dict[int, R] = {}
        self._held: dict[R, int] = {}

    # ---- replicas ----------------------------------------------------------------------------------------
    @property
    def replicas(self) -> tuple[R, ...]:
        return tuple(self._bit)

    def add_replica(self, replica: R) -> None:
        """Know ``replica`` (holding nothing yet). Changes the index only if it was unknown."""
        if replica in self._bit:
            return
        bit = next(b for b in range(len(self._bit) + 1) if b not in self._by_bit)
        self._bit[replica] = bit
        self._by_bit[bit] = replica
        self._held[replica] = 0

    def forget(self, replica: R) -> None:
        """Drop ``replica`` and every block it held (it died, was removed, or fell out of sync)."""
        if replica not in self._bit:
            return
        self._drop_all(replica)
        bit = self._bit.pop(replica)
        del self._by_bit[bit]
        del self._held[replica]

    def num_blocks(self, replica: R) -> int:
        """Blocks ``replica`` holds, per the index."""
        return self._held.get(replica, 0)

    # ---- events ------------------------------------------------------------------------------------------
    def apply(self, replica: R, event: CacheEvent) -> None:
        """Apply one of ``replica``'s cache events. Raises IndexSyncError (changing nothing) when the event
        contradicts the index: a stored block already held or hung under a parent the replica does not hold,
        a removed block it does not hold."""
        self.add_replica(replica)
        if isinstance(event, BlocksStored):
            self._stored(replica, event)
        elif isinstance(event, BlocksRemoved):
            self._removed(replica, event)
        elif isinstance(event, CacheCleared):
            self._drop_all(replica)
        else:
            raise TypeError(f"not a cache event: {type(event).__name__}")

    def apply_all(self, replica: R, events: Iterable[CacheEvent]) -> None:
        """Apply ``events`` of ``replica`` in order (see ``apply``)."""
        for event in events:
            self.apply(replica, event)

    def _stored(self, replica: R, e: BlocksStored) -> None:
        bit = 1 << self._bit[replica]
        m = self._maps.setdefault((e.mode, e.namespace), {})
        if e.parent is not None and not m.get(e.parent, 0) & bit:
            raise IndexSyncError(f"replica {replica!r} stored blocks under a parent block it does not hold")
        if any(m.get(k, 0) & bit for k in e.keys):
            raise IndexSyncError(f"replica {replica!r} stored a block it already holds")
        for k in e.keys:
            m[k] = m.get(k, 0) | bit
        self._held[replica] += len(e.keys)

    def _removed(self, replica: R, e: BlocksRemoved) -> None:
        bit = 1 << self._bit[replica]
        m = self._maps.get((e.mode, e.namespace), {})
        if not all(m.get(k, 0) & bit for k in e.keys):
            raise IndexSyncError(f"replica {replica!r} removed a block it does not hold")
        for k in e.keys:
            rest = m[k] & ~bit
            if rest:
                m[k] = rest
            else:
                del m[k]
        self._held[replica] -= len(e.keys)

    def discard(self, replica: R, mode: str, namespace: str, keys: Iterable[Key]) -> None:
        """Drop whichever of ``keys`` ``replica`` holds, ignoring the others: the lenient removal for a replica
        whose events went out of sync (the index may under-claim, never over-claim)."""
        if replica not in self._bit:
            return
        bit = 1 << self._bit[replica]
        m = self._maps.get((mode, namespace), {})
        for k in keys:
            mask = m.get(k, 0)
            if mask & bit:
                self._held[replica] -= 1
                if mask & ~bit:
                    m[k] = mask & ~bit
                else:
                    del m[k]

    def _drop_all(self, replica: R) -> None:
        bit = 1 << self._bit[replica]
        for m in self._maps.values():
            for k in [k for k, mask in m.items() if mask & bit]:
                rest = m[k] & ~bit
                if rest:
                    m[k] = rest
                else:
                    del m[k]
        self._held[replica] = 0

    # ---- queries -----------------------------------------------------------------------------------------
    def match(self, keys: Sequence[Key], namespace: str, mode: str = "tokens") -> dict[R, int]:
        """For each replica holding at least the first block: how many leading ``keys`` it holds. Changes
        nothing. (Tokens mode: pass ``prompt_keys(...)`` so the counts are what ``match`` would serve.)"""
        m = self._maps.get((mode, namespace))
        if not m or not keys:
            return {}
        alive = m.get(keys[0], 0)
        depth: dict[R, int] = {}
        i = 1
        while alive and i < len(keys):
            held = m.get(keys[i], 0) & alive
            if held != alive:
                self._record(alive & ~held, i, depth)
                alive = held
            i += 1
        self._record(alive, i, depth)
        return depth

    def _record(self, mask: int, blocks: int, out: dict[R, int]) -> None:
        bit = 0
        while mask:
            if mask & 1:
                out[self._by_bit[bit]] = blocks
            mask >>= 1
            bit += 1

    def holders(self, key: Key, namespace: str, mode: str = "tokens") -> frozenset[R]:
        """The replicas holding the block ``key``. Changes nothing."""
        mask = self._maps.get((mode, namespace), {}).get(key, 0)
        return frozenset(r for r, b in self._bit.items() if mask >> b & 1)


# ---- policies ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadGuard:
    """The replicas count as unbalanced when the most loaded one's load exceeds the least loaded one's by more
    than ``abs_threshold`` AND by more than ``rel_threshold`` times (SGLang's cache-aware router: 64, 1.5)."""

    abs_threshold: float = 64.0
    rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if not self.abs_threshold >= 0:
            raise ValueError(f"LoadGuard.abs_threshold must be >= 0, got {self.abs_threshold!r}")
        if not self.rel_threshold >= 1:
            raise ValueError(f"LoadGuard.rel_threshold must be >= 1, got {self.rel_threshold!r}")

    def unbalanced(self, loads: Iterable[float]) -> bool:
        """Whether ``loads`` are too unbalanced to route by prefix. Changes nothing."""
        values = list(loads)
        if not values:
            return False
        hi, lo = max(values), min(values)
        return hi - lo > self.abs_threshold and hi > lo * self.rel_threshold


@dataclass(frozen=True)
class RoutingConfig:
    """Settings of the prefix policies (defaults: SGLang's cache-aware router's ``--balance-abs-threshold``,
    ``--balance-rel-threshold`` and ``--cache-threshold``).

    guard:     when it finds the loads unbalanced, ``prefix_balanced`` routes by load.
    min_match: ``prefix_balanced`` follows a held prefix only when it covers at least this fraction of the
               request's blocks; a shorter one (say a template's first block that every tenant's request starts
               with) would otherwise pull unrelated requests onto one replica.
    near:      in the caller's load units (queued requests, tokens of queued prefill, ...): a cold or short
               request goes, among the replicas whose load is at most the least load + ``near``, to the one
               holding the longest prefix (ties: least loaded, then in turn). 0 (the default): only exact ties,
               in turn, i.e. plain least loaded as before, so the Ray router is unchanged unless it is set.
    """

    guard: LoadGuard = LoadGuard()
    min_match: float = 0.3
    near: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_match <= 1:
            raise ValueError(f"RoutingConfig.min_match must be in [0, 1], got {self.min_match!r}")
        d = self.near
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (math.isfinite(d) and d >= 0):
            raise ValueError(f"RoutingConfig.near must be a finite number >= 0 (in load units), got {d!r}")


@dataclass(frozen=True)
class Decision(Generic[R]):
    """Where a request goes: ``replica``; ``matched_blocks`` of its leading blocks that replica holds (per the
    index; 0 for policies that do not look); ``reason``: prefix, cold (no replica holds any of it), short (the
    longest held prefix is below ``min_match``), load (the guard overrode the prefix), round_robin or
    least_loaded."""

    replica: R
    matched_blocks: int
    reason: str


class RoutingPolicy(Protocol):
    """Chooses a replica. ``uses_index``: whether ``matched`` must be filled (else an empty map will do)."""

    uses_index: bool

    def choose(
        self, replicas: Sequence[R], matched: Mapping[R, int], loads: Mapping[R, float], *, blocks: int | None = None
    ) -> Decision[R]:
        """A replica among ``replicas`` (in the caller's fixed order) given each one's held leading blocks
        (``matched``; absent means 0), its load (``loads``; absent means 0) and the request's length in blocks
        as looked up (``blocks``; None: unknown, no ``min_match``). Changes the policy's turn only."""
        ...


class _Turns:
    """Deterministic tie-breaking: successive ties go to successive candidates (round robin among equals)."""

    def __init__(self) -> None:
        self.turn = 0

    def pick(self, tied: Sequence[R]) -> R:
        if len(tied) == 1:
            return tied[0]
        choice = tied[self.turn % len(tied)]
        self.turn += 1
        return choice


def _least_loaded(candidates: Sequence[R], loads: Mapping[R, float], turns: _Turns) -> R:
    low = min(loads.get(r, 0.0) for r in candidates)
    return turns.pick([r for r in candidates if loads.get(r, 0.0) == low])


def _check(replicas: Sequence[R]) -> None:
    if not replicas:
        raise ValueError("no replica to route to")


class RoundRobin:
    """Request i goes to replica i mod N, whatever they hold."""

    uses_index = False

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(
        self, replicas: Sequence[R], matched: Mapping[R, int], loads: Mapping[R, float], *, blocks: int | None = None
    ) -> Decision[R]:
        _check(replicas)
        r = self._turns.pick(replicas)
        return Decision(r, matched.get(r, 0), "round_robin")


class LeastLoaded:
    """The least loaded replica (ties in turn)."""

    uses_index = False

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(
        self, replicas: Sequence[R], matched: Mapping[R, int], loads: Mapping[R, float], *, blocks: int | None = None
    ) -> Decision[R]:
        _check(replicas)
        r = _least_loaded(replicas, loads, self._turns)
        return Decision(r, matched.get(r, 0), "least_loaded")


class PrefixAffinity:
    """The replica holding the longest prefix of the request (ties: least loaded, then in turn); a request
    nobody holds goes to the least loaded replica. With a ``guard``, unbalanced loads route by load instead;
    with ``min_match``, so does a request whose longest held prefix covers less than that fraction of it.
    With ``near`` > 0, such a cold or short request goes, among the replicas loaded at most ``near`` above the
    least, to the one holding the longest prefix (ties: least loaded, then in turn); see ``RoutingConfig``."""

    uses_index = True

    def __init__(self, guard: LoadGuard | None = None, min_match: float = 0.0, near: float = 0.0) -> None:
        self.guard = guard
        self.min_match = min_match
        self.near = near
        self._turns = _Turns()

    def _near_tie(self, replicas: Sequence[R], matched: Mapping[R, int], loads: Mapping[R, float]) -> R:
        """The least loaded replica or, with ``near`` > 0, the longest holder among the near-least loaded."""
        if self.near <= 0:
            return _least_loaded(replicas, loads, self._turns)
        low = min(loads.get(r, 0.0) for r in replicas)
        near = [r for r in replicas if loads.get(r, 0.0) <= low + self.near]
        best = max(matched.get(r, 0) for r in near)
        return _least_loaded([r for r in near if matched.get(r, 0) == best], loads, self._turns)

    def choose(
        self, replicas: Sequence[R], matched: Mapping[R, int], loads: Mapping[R, float], *, blocks: int | None = None
    ) -> Decision[R]:
        _check(replicas)
        if self.guard is not None and self.guard.unbalanced(loads.get(r, 0.0) for r in replicas):
            r = _least_loaded(replicas, loads, self._turns)
            return Decision(r, matched.get(r, 0), "load")
        best = max(matched.get(r, 0) for r in replicas)
        if best == 0:
            return Decision(_least_loaded(replicas, loads, self._turns), 0, "cold")  # nothing held to settle ties
        if blocks is not None and best < self.min_match * blocks:
            r = self._near_tie(replicas, matched, loads)
            return Decision(r, matched.get(r, 0), "short")
        holders = [r for r in replicas if matched.get(r, 0) == best]
        return Decision(_least_loaded(holders, loads, self._turns), best, "prefix")


ROUTING_POLICIES: dict[str, Callable[[RoutingConfig], RoutingPolicy]] = {
    "round_robin": lambda config: RoundRobin(),
    "least_loaded": lambda config: LeastLoaded(),
    "prefix": lambda config: PrefixAffinity(),
    "prefix_balanced": lambda config: PrefixAffinity(config.guard, config.min_match, config.near),
}


def make_policy(name: str, config: RoutingConfig | None = None) -> RoutingPolicy:
    """A fresh policy by name (see ``ROUTING_POLICIES``); ``config`` defaults to SGLang's settings."""
    if name not in ROUTING_POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(ROUTING_POLICIES)}")
    return ROUTING_POLICIES[name](config or RoutingConfig())
