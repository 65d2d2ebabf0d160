"""HybridStates: the recurrent-state side of a hybrid model's cache, owned by its ``ModelRuntime``.

One ``StatePool`` of ``live + snapshots`` slots: the first ``live`` hold running engine requests' states (taken at
admission, given back when a request ends or is preempted), the rest hold snapshots at block boundaries, indexed
by the boundary block's chained key in a ``SnapshotIndex`` (least recently used first). Which boundaries earn a
snapshot, and the restore rule (a request is served up to the deepest snapshot its KV match reaches), are
``prefixcache.core.snapshots``'. Not thread-safe: the runtime's lock serialises.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from engine.hybrid.states import StatePool, StateSpec
from engine.tier.kv_tier import KVTier, block_tokens, write_rows
from prefixcache.core.cache import MatchResult, PrefixCache
from prefixcache.core.hashing import extend_block_keys
from prefixcache.core.snapshots import SnapshotIndex, snapshot_points


@dataclass(frozen=True)
class Admission:
    """What ``HybridStates.admit`` found: the pinned match (``match.cached_blocks`` <= ``restored``), the pool's KV
    match ``kv`` (blocks), the snapshot it restores (``restored`` blocks, from ``slot``; 0 and None: from scratch),
    and the pool blocks loaded from the tier after the match (committed, in order)."""

    match: MatchResult
    kv: int
    restored: int
    slot: int | None
    loaded: tuple[int, ...]

    @property
    def blocks(self) -> tuple[int, ...]:
        """The pool blocks of the request's cached prefix (the match's, then the tier's)."""
        return (*self.match.block_ids, *self.loaded)


class HybridStates:
    """The state pool and snapshot index of one hybrid model (see the module docstring). ``interval``: also keep a
    snapshot every so many blocks of a prompt (0: none); ``tokenwise``: the recurrent modules that must take
    several tokens over a state one at a time (``engine.hybrid.probe``)."""

    def __init__(
        self,
        spec: StateSpec,
        *,
        live: int,
        snapshots: int,
        device: torch.device | str,
        block_size: int,
        hash_seed: int,
        interval: int = 0,
        tokenwise: bool = False,
        check_memory: bool = True,
    ) -> None:
        if snapshots < 1:
            raise ValueError(f"max_cached_states must be >= 1 (a snapshot holds one prefix's state), got {snapshots}")
        self.spec = spec
        self.live = live
        self.pool = StatePool(spec, live + snapshots, device, check_memory=check_memory)
        self.index = SnapshotIndex(snapshots, first_slot=live)
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.interval = interval
        self.tokenwise = tokenwise
        self.tier: KVTier | None = None  # the second tier's snapshot entries (set by the runtime), or None
        self.kv_tier: KVTier | None = None  # the second tier's K/V entries, and the pool they load into
        self.kv_pool: Any = None
        self._free_live = list(range(live - 1, -1, -1))

    # ---- keys and the policy ----------------------------------------------------------------------------------
    def keys(self, keys: list[bytes], tokens: Any, namespace: str, upto: int) -> list[bytes]:
        """``keys`` (a request's chained block keys so far) extended to ``upto`` blocks. Changes ``keys``."""
        return extend_block_keys(keys, tokens, namespace, self.block_size, self.hash_seed, upto)

    def restore_point(self, keys: list[bytes], tokens: Any, namespace: str, matched: int) -> tuple[int, int | None]:
        """The deepest snapshot among a request's first ``matched`` blocks (its KV match, the tier's included):
        ``(blocks, slot)``, or ``(0, None)``; one the tier holds deeper than any in the pool is loaded into a
        snapshot slot (a torn or foreign entry is a miss). Refreshes it."""
        if matched <= 0:
            return 0, None
        self.keys(keys, tokens, namespace, matched)
        b, slot = self.index.deepest(keys, matched)
        tier = self.tier
        if tier is None or b >= matched:
            return b, slot
        held = tier.holds(keys[b:matched])
        for deeper in range(matched, b, -1):
            if not held[deeper - b - 1]:
                continue
            rows = tier.fetch([keys[deeper - 1]], block_tokens(tokens, self.block_size, deeper - 1, deeper))
            if len(rows) == 0:
                continue
            loaded, _ = self.index.put(keys[deeper - 1])
            write_rows(self.pool, rows, [loaded], tier.binding)
            tier.counters.served_blocks += 1
            return deeper, loaded
        return b, slot

    def admit(self, cache: PrefixCache, tokens: Any, namespace: str, keys: list[bytes], limit: int) -> Admission:
        """Match a request's prompt ``tokens[:limit]`` and pin it up to the deepest snapshot its KV reaches, the
        second tier's K/V and snapshots included (the K/V blocks it serves from the tier are loaded into the pool
        and committed; a torn entry stops the load, and the request is served from a shallower snapshot). Changes
        the cache (pins, counts) and, when the tier serves, the pool and the snapshot pool."""
        bs = self.block_size
        kv = cache.probe(tokens[:limit], namespace) // bs
        tier = self.kv_tier
        extra = 0
        if tier is not None and (limit - 1) // bs > kv:
            self.keys(keys, tokens, namespace, (limit - 1) // bs)
            extra = tier.lookup(keys, kv, (limit - 1) // bs)
        restored, slot = self.restore_point(keys, tokens, namespace, kv + extra)
        m = cache.match(tokens[:limit], namespace, max_blocks=min(restored, kv))
        loaded: tuple[int, ...] = ()
        if restored > kv:
            assert tier is not None
            loaded = tier.load_after_match(
                cache, self.kv_pool, m.handle, tokens, keys, m.block_ids, restored, found=restored - kv
            )
            if len(loaded) < restored - kv:  # a torn or lost K/V entry: serve a snapshot within what loaded
                restored, slot = self.index.deepest(keys, kv + len(loaded))
        return Admission(m, kv, restored, slot, loaded)

    def points(
        self, *, restored: int, matched: int, limit: int, prompt_tokens: int, hints: Iterable[int] = ()
    ) -> list[int]:
        """The block boundaries a request keeps snapshots at while it prefills (``snapshot_points``)."""
        return snapshot_points(
            block_size=self.block_size,
            restored=restored,
            matched=matched,
            limit=limit,
            prompt_blocks=prompt_tokens // self.block_size,
            hints=hints,
            interval=self.interval,
        )

    # ---- snapshots ---------------------------------------------------------------------------------------------
    def publish_slot(self, keys: list[bytes], b: int, tokens: Any, src: int) -> int:
        """Keep the state in slot ``src`` (after ``tokens``' first ``b`` blocks, whose keys ``keys`` holds) as a
        snapshot (a copy; written through to the tier); returns its slot."""
        slot, fresh = self.index.put(keys[b - 1])
        if fresh:
            self.pool.copy(slot, src)
            self._write_through(keys, b, tokens, slot)
        return slot

    def publish_cache(self, keys: list[bytes], b: int, tokens: Any, cache: DynamicCache, row: int) -> int:
        """Keep batch row ``row`` of ``cache``'s recurrent state (after ``tokens``' first ``b`` blocks) as a snapshot
        (written through to the tier); returns its slot."""
        slot, fresh = self.index.put(keys[b - 1])
        if fresh:
            self.pool.save_cache(cache, row, slot)
            self._write_through(keys, b, tokens, slot)
        return slot

    def publish_tensors(self, keys: list[bytes], b: int, tokens: Any, state: dict[Any, torch.Tensor]) -> int:
        """Keep ``state`` (a copy of one sequence's tensors, by pool key) as the snapshot after ``tokens``' first
        ``b`` blocks (written through to the tier); returns its slot."""
        slot, fresh = self.index.put(keys[b - 1])
        if fresh:
            for key, t in state.items():
                self.pool.tensors[key][slot].copy_(t)
            self._write_through(keys, b, tokens, slot)
        return slot

    def _write_through(self, keys: list[bytes], b: int, tokens: Any, slot: int) -> None:
        """Queue the snapshot in ``slot`` (named ``keys[b - 1]``) for the tier: one entry, not a path (a snapshot
        stands alone; the tier must not think it holds the boundaries before it)."""
        tier = self.tier
        if tier is None:
            return
        try:
            tier.save(self.pool, [keys[b - 1]], 0, block_tokens(tokens, self.block_size, b - 1, b), [slot])
        except Exception as exc:  # best effort, as for K/V: the snapshot stays in the pool
            tier.counters.write_errors += 1
            tier._failed(exc, "queueing a snapshot")

    def drop(self, key: bytes) -> None:
        """Forget the snapshot named ``key`` (a request's superseded latest boundary)."""
        self.index.drop(key)

    # ---- live slots (the engine's running requests) --------------------------------------------------------------
    def take_live(self) -> int | None:
        """A live slot for a request starting to run, or None when every one is taken."""
        return self._free_live.pop() if self._free_live else None

    def give_back(self, slot: int) -> None:
        """Return a live slot."""
        assert 0 <= slot < self.live and slot not in self._free_live, f"live slot {slot} given back twice"
        self._free_live.append(slot)

    @property
    def free_live(self) -> int:
        return len(self._free_live)

    def reset(self) -> None:
        """Forget every snapshot (live slots stay with their requests)."""
        self.index.clear()

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy. Changes nothing."""
        d: dict[str, Any] = {f"state_{k}": v for k, v in self.index.stats.as_dict().items()}
        d.update(
            state_snapshots=len(self.index),
            state_capacity=self.index.capacity,
            state_bytes_per_snapshot=self.spec.bytes_per_snapshot,
            state_pool_bytes=self.pool.nbytes,
        )
        return d

    def check_integrity(self) -> None:
        """Raise AssertionError when slots leaked. Changes nothing."""
        self.index.check_integrity()
        assert len(set(self._free_live)) == len(self._free_live), "a live slot is free twice"
