"""Making the tier of a wrapped model: the binding (what computed the KV) and the store from the user's options."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
import xxhash

from engine.tier.entry import TierBinding, layers_of
from engine.tier.kv_tier import KVTier
from engine.tier.lmdb_store import LmdbStore, StoreError
from engine.tier.redis_store import RedisStore
from engine.weights import module_tensors
from prefixcache.core.checks import parse_bytes

DEFAULT_DISK_BYTES = 8 << 30  # a disk tier's budget when none is given
WEIGHT_SAMPLES = 64  # elements of each tensor hashed into the binding


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of the model's tensors: names, shapes, dtypes and ``WEIGHT_SAMPLES`` evenly spaced values of
    each (other weights give other KV, so other entries). Changes nothing."""
    h = xxhash.xxh3_128()
    with torch.no_grad():
        for name, t in module_tensors(model, named=True):
            h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
            n = t.numel()
            if n:
                flat = t.detach().reshape(-1)
                k = min(n, WEIGHT_SAMPLES)  # integer steps: a float32 linspace rounds past n - 1 on large tensors
                idx = torch.arange(k, device=flat.device) * (n - 1) // max(1, k - 1)
                h.update(flat[idx].float().cpu().numpy().tobytes())
    return h.hexdigest()


def binding_for(model: Any, fingerprint: str, specs: Any, block_size: int, hash_seed: int) -> TierBinding:
    """The binding of a wrapped model's tier."""
    item = torch.empty((), dtype=model.dtype).element_size()
    return TierBinding(
        fingerprint, weights_digest(model), str(model.dtype), item, block_size, hash_seed, layers_of(specs)
    )


STATE_SHARE = 4  # a hybrid model's disk tier keeps recurrent-state snapshots in 1/STATE_SHARE of its budget


def state_binding(kv: TierBinding, spec: Any) -> TierBinding:
    """The binding of a hybrid model's snapshot entries (``spec``: its ``engine.hybrid.states.StateSpec``): the KV
    binding's model, weights, dtype, block size and hash seed, with the state's tensors."""
    return replace(kv, state=spec.describe(), state_bytes=spec.bytes_per_snapshot)


def open_state_tier(tier: KVTier, binding: TierBinding) -> KVTier:
    """A tier of a hybrid model's recurrent-state snapshots on ``tier``'s store (its entries bound to ``binding``,
    so they never mix with K/V entries), with 1/``STATE_SHARE`` of a disk tier's budget (the KV tier keeps the
    rest). Raises ValueError when that share holds no snapshot."""
    store = tier.store
    capacity = None
    if not store.shared:
        capacity = store.max_bytes // STATE_SHARE // binding.entry_bytes
        if capacity < 1:
            raise ValueError(
                f"max_disk_bytes={store.max_bytes:,}: its share for recurrent-state snapshots "
                f"({store.max_bytes // STATE_SHARE:,} bytes) holds none (one is {binding.entry_bytes:,} bytes); raise it"
            )
        assert tier.index is not None and tier.index.capacity_blocks is not None
        tier.index.capacity_blocks = max(
            1, (store.max_bytes - store.max_bytes // STATE_SHARE) // tier.binding.entry_bytes
        )
    return KVTier(store, binding, capacity, owns_store=False)


def open_tier(
    binding: TierBinding,
    *,
    disk_cache: str | os.PathLike[str] | None = None,
    max_disk_bytes: int | str | None = None,
    shared_cache: str | None = None,
) -> KVTier | None:
    """The tier the options ask for (None when neither ``disk_cache`` nor ``shared_cache`` is given). One store
    per pool: a disk directory or a Redis URL. Raises ValueError / StoreError with what was wrong."""
    if disk_cache is not None and shared_cache is not None:
        raise ValueError("give disk_cache or shared_cache, not both (one tier below the pool)")
    if disk_cache is None and shared_cache is None:
        if max_disk_bytes is not None:
            raise ValueError("max_disk_bytes needs disk_cache (the directory of the disk tier)")
        return None
    if shared_cache is not None:
        return KVTier(RedisStore(shared_cache), binding, None)
    assert disk_cache is not None
    budget = DEFAULT_DISK_BYTES if max_disk_bytes is None else parse_bytes(max_disk_bytes, "max_disk_bytes")
    if budget < binding.entry_bytes:
        raise ValueError(
            f"max_disk_bytes={budget:,} holds no block (one entry is {binding.entry_bytes:,} bytes); raise it"
        )
    store = LmdbStore(os.fspath(disk_cache), budget)
    return KVTier(store, binding, store.max_bytes // binding.entry_bytes)


__all__ = [
    "DEFAULT_DISK_BYTES",
    "StoreError",
    "binding_for",
    "open_state_tier",
    "open_tier",
    "parse_bytes",
    "state_binding",
    "weights_digest",
]
