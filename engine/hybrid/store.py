"""HybridStates: the recurrent-state side of a hybrid model's cache, owned by its ``ModelRuntime``.

One ``StatePool`` of ``live + snapshots`` slots: the first ``live`` hold running engine requests' states (taken at
admission, given back when a request ends or is preempted), the rest hold snapshots at block boundaries, indexed
by the boundary block's chained key in a ``SnapshotIndex`` (least recently used first). Which boundaries earn a
snapshot, and the restore rule (a request is served up to the deepest snapshot its KV match reaches), are
``prefixcache.core.snapshots``'. Not thread-safe: the runtime's lock serialises.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from engine.hybrid.states import StatePool, StateSpec
from prefixcache.core.hashing import extend_block_keys
from prefixcache.core.snapshots import SnapshotIndex, snapshot_points


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
        self._free_live = list(range(live - 1, -1, -1))

    # ---- keys and the policy ----------------------------------------------------------------------------------
    def keys(self, keys: list[bytes], tokens: Any, namespace: str, upto: int) -> list[bytes]:
        """``keys`` (a request's chained block keys so far) extended to ``upto`` blocks. Changes ``keys``."""
        return extend_block_keys(keys, tokens, namespace, self.block_size, self.hash_seed, upto)

    def restore_point(self, keys: list[bytes], tokens: Any, namespace: str, matched: int) -> tuple[int, int | None]:
        """The deepest snapshot among a request's first ``matched`` blocks (its KV match): ``(blocks, slot)``, or
        ``(0, None)``. Refreshes it."""
        if matched <= 0:
            return 0, None
        self.keys(keys, tokens, namespace, matched)
        return self.index.deepest(keys, matched)

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
    def publish_slot(self, key: bytes, src: int) -> int:
        """Keep the state in slot ``src`` as the snapshot named ``key`` (a copy); returns its slot."""
        slot, fresh = self.index.put(key)
        if fresh:
            self.pool.copy(slot, src)
        return slot

    def publish_cache(self, key: bytes, cache: DynamicCache, row: int) -> int:
        """Keep batch row ``row`` of ``cache``'s recurrent state as the snapshot named ``key``; returns its slot."""
        slot, fresh = self.index.put(key)
        if fresh:
            self.pool.save_cache(cache, row, slot)
        return slot

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
