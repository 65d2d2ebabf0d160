"""ModelRuntime: one causal LM and everything its prefix cache is made of.

A runtime owns, for one Hugging Face model: the KV pool on the model's device, the radix tree (``PrefixCache``)
that indexes it, the optional second tier below it (``engine.tier``), the cache namespaces (the model's
fingerprint joined with the caller's name), the watch on the model's weights, dtype and device (KV computed by
other weights is never served), the miss-cause history, the lock every cached call holds, and the
continuous-batching engine (made on first use). ``PrefixCachedModel`` is a transformers-compatible facade over a
runtime; the server's engine loop and batcher and each Ray replica hold one directly.

Thread safety: every method that reads or changes the cache takes ``lock`` (re-entrant); a serving thread holds it
around each engine step.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from engine import hf_cache, path_check
from engine.batching.engine import Engine
from engine.batching.scheduler import SchedulerConfig
from engine.errors import (
    LoadCheckError,
    StaleCacheWarning,
    UncachedCallWarning,
    UnsupportedModelError,
    UnverifiedCacheWarning,
)
from engine.hybrid.setup import open_hybrid
from engine.hybrid.store import HybridStates
from engine.kv_pool import KVPool, LayerSpec, bytes_per_token
from engine.media.encoder_cache import DEFAULT_MAX_ENCODER_CACHE_BYTES, EncoderCache
from engine.media.families import Family, family_for
from engine.media.inputs import MediaCall
from engine.names import cache_namespace
from engine.paged import fused, linear
from engine.paged.runner import (
    OWN_DIFFERENCE_SLACK,
    PROBE_TOLERANCE,
    own_difference,
    paged_unsupported_reason,
    probe_difference,
)
from engine.tier import KVTier, TierBinding, open_tier
from engine.tier.open import binding_for, open_state_tier, state_binding
from engine.versions import label
from engine.weights import WeightsSnapshot, describe_change
from prefixcache import CacheConfig, PrefixCache
from prefixcache.core.checks import check_int
from prefixcache.core.hashing import BlockHasher
from prefixcache.core.windows import DEFAULT_WINDOW_SHARE, WindowRule, WindowSlots
from prefixcache.sim.causes import LiveCauses

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MAX_CACHED_TOKENS = 32_768
HISTORY_FACTOR = 4  # the miss-cause history remembers this many pools' worth of committed tokens
FAST_LINEAR_MAX_BYTES = 4 << 30  # prepacked linears by default when their copies of the weights fit this


@dataclass(frozen=True)
class RuntimeConfig:
    """How a model's cache is built. Sizes are ints > 0 (numpy integers too): the pool holds ``max_cached_tokens``
    (default 32,768) or ``max_cached_bytes`` (one of them) in blocks of ``block_size`` tokens. ``engine``: the
    continuous-batching engine's step budget; ``fast_linear``: prepacked linears in its forwards (oneDNN's, and a
    small-row kernel's for steps of a few rows; None: on the CPU when they fit ``FAST_LINEAR_MAX_BYTES``);
    ``fused_ops``: Llama-style RMSNorm and rotary embedding in one C pass each there (``engine.paged.fused``: on the
    CPU, for the module sources it knows). The tier: ``disk_cache`` (a directory, budget ``max_disk_bytes``) or
    ``shared_cache`` (a Redis URL). ``check_memory`` refuses a pool above 90% of the device's available memory.
    ``miss_history_tokens``: committed tokens the miss-cause history remembers (None: 4 pools' worth; "unlimited").
    ``verify_tokens`` off trusts 128-bit block hashes without checking the tokens.
    Hybrid models (recurrent layers beside attention, docs/hybrid.md): ``max_cached_states`` recurrent-state
    snapshots are kept (None: 64) beside a live state per running engine request; ``snapshot_interval``: also keep
    one every so many blocks of a prompt (0: only where the policy says). Images (docs/multimodal.md): the vision
    tower's output of each image is kept by content id up to ``max_encoder_cache_bytes`` (default 256 MiB; 0:
    none). Sliding-window and chunked-attention layers (docs/sliding.md): with ``sliding_windows`` (the default)
    their K/V is kept only within the windows a match can end at, in ``window_share`` slots per block of the full
    layers (the same bytes then hold more cached tokens)."""

    max_cached_tokens: int | None = None
    max_cached_bytes: int | None = None
    block_size: int = 16
    eviction: str = "lru"
    hash_seed: int = 0
    verify_tokens: bool = True
    engine: SchedulerConfig | None = None  # None: SchedulerConfig's defaults
    fast_linear: bool | None = None
    fused_ops: bool = True
    disk_cache: str | os.PathLike[str] | None = None
    max_disk_bytes: int | str | None = None
    shared_cache: str | None = None
    check_memory: bool = True
    miss_history_tokens: int | str | None = None
    max_cached_states: int | None = None
    snapshot_interval: int = 0
    max_encoder_cache_bytes: int = DEFAULT_MAX_ENCODER_CACHE_BYTES
    sliding_windows: bool = True
    window_share: float = DEFAULT_WINDOW_SHARE

    def __post_init__(self) -> None:
        if self.max_cached_tokens is not None and self.max_cached_bytes is not None:
            raise ValueError("give max_cached_tokens or max_cached_bytes, not both")
        object.__setattr__(self, "block_size", _positive("block_size", self.block_size))
        for name in ("max_cached_tokens", "max_cached_bytes"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _positive(name, getattr(self, name)))
        history = self.miss_history_tokens
        if isinstance(history, str) and history != "unlimited":
            raise ValueError(
                f"PrefixCachedModel: miss_history_tokens must be an int > 0, 'unlimited' or None, got {history!r}"
            )
        if history is not None and history != "unlimited":
            object.__setattr__(self, "miss_history_tokens", _positive("miss_history_tokens", history))
        if self.max_cached_states is not None:
            object.__setattr__(self, "max_cached_states", _positive("max_cached_states", self.max_cached_states))
        interval = check_int(self.snapshot_interval, "PrefixCachedModel: snapshot_interval", minimum=0)
        object.__setattr__(self, "snapshot_interval", interval)
        enc = check_int(self.max_encoder_cache_bytes, "PrefixCachedModel: max_encoder_cache_bytes", minimum=0)
        object.__setattr__(self, "max_encoder_cache_bytes", enc)
        if not isinstance(self.sliding_windows, bool):
            raise TypeError(f"PrefixCachedModel: sliding_windows must be a bool, got {self.sliding_windows!r}")
        share = self.window_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"PrefixCachedModel: window_share must be a number in (0, 1], got {share!r}")

    def history_bound(self, pool_tokens: int) -> int | None:
        """The miss-cause history's bound in tokens (None: unbounded)."""
        if self.miss_history_tokens is None:
            return HISTORY_FACTOR * pool_tokens
        return None if self.miss_history_tokens == "unlimited" else int(self.miss_history_tokens)


class ModelRuntime:
    """The cache of ``model`` built as ``config`` says. ``on_unsupported``: "error" raises
    ``UnsupportedModelError`` for a model that cannot be cached exactly; "passthrough" keeps it with no pool (a
    one-block tree keeps the counters usable) and ``unsupported_reason`` set. A model that fails the check at load
    (``engine.path_check``: its cached path compared with the bare model on this install's transformers and torch,
    a recurrent cache layer walked whole by ``engine.hybrid.layer_state``) is kept the same way, with an
    ``UncachedCallWarning`` naming the versions and the difference, whatever ``on_unsupported`` says: it depends on
    the install, not on the model. ``hasher``: a test seam for forced block-hash collisions."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: RuntimeConfig | None = None,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        on_unsupported: str = "error",
        hasher: BlockHasher | None = None,
    ) -> None:
        if on_unsupported not in ("error", "passthrough"):
            raise ValueError(f"on_unsupported must be 'error' or 'passthrough', got {on_unsupported!r}")
        config = config or RuntimeConfig()
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.processor: Any = None  # image-text models loaded by name: their processor (``load`` sets it)
        self.lock = threading.RLock()
        self.block_size = config.block_size
        self.epoch = 0  # bumped whenever the cache is dropped: a call that outlives its cache commits nothing
        self.tier: KVTier | None = None
        self._state_tier: KVTier | None = None  # a hybrid model's snapshot entries, on the tier's store
        self.hybrid: HybridStates | None = None
        self.window: tuple[WindowRule, frozenset[int]] | None = None  # the window group (rule, layers), or None
        self.window_slots = 0  # its slots in the pool
        self.pool: KVPool | None = None
        self.specs: list[LayerSpec | None] = []
        self._engine: Engine | None = None
        self._engine_reason: str | None = None
        self._linears: Any = None
        self._warned: set[str] = set()
        self.encoder_cache = EncoderCache(config.max_encoder_cache_bytes)
        # the model's image layout (engine.media), or why prompts with images on it run uncached
        self.media_family: Family | None
        self.media_family, self.media_reason = family_for(model)
        self._images_checked = False  # the image path's check (engine.path_check.image_reason) passed
        self._images_off = False  # ... or failed: images run uncached (text calls still use media_family)
        self._tier_served_base = 0  # the tier's served_blocks at the last counter reset (the tier outlives it)
        self.unsupported_reason = hf_cache.unsupported_reason(model)
        if self.unsupported_reason is not None and on_unsupported == "error":
            raise UnsupportedModelError(
                f"PrefixCachedModel cannot cache {type(model).__name__}: {self.unsupported_reason}. "
                "Pass on_unsupported='passthrough' to run it uncached."
            )
        self.fingerprint = fingerprint(model)
        if self.unsupported_reason is not None:  # passthrough
            self.cache = PrefixCache(CacheConfig(num_blocks=1, block_size=self.block_size, eviction=config.eviction))
            self.causes = LiveCauses(self.block_size, config.history_bound(self.block_size))
            return
        self.load_check_reason: str | None = None  # why the check at load turned caching off, or None
        self.load_check_seconds = 0.0  # what the last check at load (engine.path_check) took
        self._weights = WeightsSnapshot.take(model)
        self.specs = hf_cache.probe_specs(model)
        try:
            self.hybrid = self._open_hybrid()
        except LoadCheckError as exc:
            self._uncached_at_load(str(exc))
            return
        self.window = None if self.hybrid is not None or not config.sliding_windows else hf_cache.window_group(model)
        if self.window is not None and (config.disk_cache or config.shared_cache or config.max_disk_bytes):
            self.window = None  # the tier's entries hold whole blocks: windows stay whole there (docs/sliding.md)
        num_blocks = self._num_blocks()
        self.cache = PrefixCache(
            CacheConfig(
                num_blocks=num_blocks,
                block_size=self.block_size,
                eviction=config.eviction,
                hash_seed=config.hash_seed,
                verify_tokens=config.verify_tokens,
            ),
            hasher=hasher,
        )
        if not config.verify_tokens:
            warnings.warn(
                "PrefixCachedModel(verify_tokens=False): matches are not checked against the cached tokens, so a "
                "block-hash collision would serve another prompt's KV (wrong outputs, no error)",
                UnverifiedCacheWarning,
                stacklevel=3,
            )
        self.pool = self._new_pool(num_blocks)
        self.causes = LiveCauses(self.block_size, config.history_bound(num_blocks * self.block_size))
        if self._check_at_load():  # before the tier opens: the probe's blocks must not reach it
            return
        if config.disk_cache is not None or config.shared_cache is not None or config.max_disk_bytes is not None:
            self.tier = open_tier(
                self.binding(),
                disk_cache=config.disk_cache,
                max_disk_bytes=config.max_disk_bytes,
                shared_cache=config.shared_cache,
            )
        if self.tier is not None and self.hybrid is not None:
            self._state_tier = open_state_tier(self.tier, state_binding(self.binding(), self.hybrid.spec))
        self._link_hybrid()

    def _check_at_load(self) -> bool:
        """Run the check at load (``engine.path_check``), with the tiers detached, and drop what it cached; the
        counters are put back as they were before it. On a failure, turn caching off (``_uncached_at_load``).
        Returns whether it failed. Changes the cache."""
        stats = replace(self.cache.stats)
        index_stats = None if self.hybrid is None else replace(self.hybrid.index.stats)
        t0 = time.perf_counter()
        with self._tiers_detached():
            reason = path_check.contiguous_reason(self)
        self.load_check_seconds = time.perf_counter() - t0
        self.drop()
        self.cache.stats = stats
        if self.hybrid is not None and index_stats is not None:
            self.hybrid.index.stats = index_stats
        if reason is not None:
            self._uncached_at_load(reason)
        return reason is not None

    @property
    def image_family(self) -> Family | None:
        """The family whose images this runtime caches (None: images run uncached, ``media_reason`` says why)."""
        return None if self._images_off else self.media_family

    def check_images(self, input_ids: torch.Tensor, mask: torch.Tensor, media: MediaCall) -> bool:
        """Before the first call with images (and again after a dtype or device change): the image path's check
        (``engine.path_check.image_reason``) on this call's batch, with the tiers detached; the counters are put
        back as they were. On a failure, images run uncached from now on with the reason (``media_reason``,
        warned once). Returns whether images may be cached. Changes the cache (the check's blocks, in its own
        namespace)."""
        if self._images_checked:
            return True
        stats = replace(self.cache.stats)
        index_stats = None if self.hybrid is None else replace(self.hybrid.index.stats)
        enc = self.encoder_cache.hits, self.encoder_cache.misses
        with self._tiers_detached():
            reason = path_check.image_reason(self, input_ids, mask, media)
        self.cache.stats = stats
        if self.hybrid is not None and index_stats is not None:
            self.hybrid.index.stats = index_stats
        self.encoder_cache.hits, self.encoder_cache.misses = enc
        if reason is None:
            self._images_checked = True
            return True
        self.media_reason, self._images_off = reason, True
        self.warn_once(f"PrefixCachedModel: prompts with images run uncached: {reason}", UncachedCallWarning, 4)
        return False

    def _uncached_at_load(self, reason: str) -> None:
        """Keep the model without a pool (as ``on_unsupported="passthrough"`` does) because the check at load found
        ``reason`` (a tier opened before, when a dtype or device change is checked, is closed); warns once. Changes
        everything the cache is made of."""
        self.close()
        self.load_check_reason = self.unsupported_reason = reason
        self.hybrid = None
        self.pool = None
        self.cache = PrefixCache(CacheConfig(num_blocks=1, block_size=self.block_size, eviction=self.config.eviction))
        self.causes = LiveCauses(self.block_size, self.config.history_bound(self.block_size))
        self.warn_once(
            f"PrefixCachedModel: caching is off for {type(self.model).__name__}, every call runs uncached: {reason}",
            UncachedCallWarning,
            4,
        )

    @contextmanager
    def _tiers_detached(self) -> Iterator[None]:
        """Inside: the runtime has no second tier (the check at load writes nothing there)."""
        tiers = self.tier, self._state_tier
        self.tier, self._state_tier = None, None
        self._link_hybrid()
        try:
            yield
        finally:
            self.tier, self._state_tier = tiers
            self._link_hybrid()

    @classmethod
    def load(
        cls,
        name_or_path: str,
        config: RuntimeConfig | None = None,
        *,
        dtype: Any = None,
        device: Any = None,
        seed: int = 0,
    ) -> ModelRuntime:
        """The runtime of a preset ("tiny", "small") or a local Hugging Face model folder (``engine.models``), its
        tokenizer kept as ``tokenizer`` and (image-text models) its processor as ``processor``."""
        from engine.media.processor import load_processor
        from engine.models import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device, seed=seed)
        rt = cls(model, config, tokenizer=tokenizer)
        rt.processor = load_processor(name_or_path, tokenizer)
        return rt

    def _open_hybrid(self) -> HybridStates | None:
        """The recurrent-state side of the cache (None for a model without recurrent layers), probed on the model
        as it is now (its dtype and device)."""
        config = self.config
        return open_hybrid(
            self.model,
            live=self.scheduler_config.max_running + 1,  # each running engine request's state, and the probe's
            snapshots=config.max_cached_states,
            block_size=self.block_size,
            hash_seed=config.hash_seed,
            interval=config.snapshot_interval,
            check_memory=config.check_memory,
        )

    def _link_hybrid(self) -> None:
        """Give the hybrid states the K/V pool and tiers they load from and write to (after any of them changed)."""
        hy = self.hybrid
        if hy is not None:
            hy.kv_pool, hy.kv_tier, hy.tier = self.pool, self.tier, self._state_tier

    def _rebind_tiers(self) -> None:
        """The model's weights, dtype or device changed: the tiers serve entries of the new binding."""
        if self.tier is not None:
            self.tier.rebind(self.binding())
        if self._state_tier is not None and self.hybrid is not None:
            self._state_tier.rebind(state_binding(self.binding(), self.hybrid.spec))

    def _num_blocks(self) -> int:
        """The pool's blocks from the config's size (and, with a window group, ``window_slots``: the same bytes hold
        ``N`` blocks of the full layers and ``window_share * N`` slots of the window layers)."""
        cfg = self.config
        dtype = self.model.dtype
        per_block = bytes_per_token(self.specs, dtype) * self.block_size
        if cfg.max_cached_bytes is not None:
            budget = cfg.max_cached_bytes
            what = f"max_cached_bytes={cfg.max_cached_bytes} ({per_block} bytes per block)"
        else:
            tokens = DEFAULT_MAX_CACHED_TOKENS if cfg.max_cached_tokens is None else cfg.max_cached_tokens
            budget = tokens // self.block_size * per_block
            what = f"max_cached_tokens={tokens} (block_size={self.block_size})"
        num_blocks = budget // per_block
        if self.window is not None and num_blocks >= 1:
            layers = self.window[1]
            full = bytes_per_token([s for i, s in enumerate(self.specs) if i not in layers], dtype) * self.block_size
            win = per_block - full
            num_blocks = max(1, int(budget // (full + cfg.window_share * win)))
            self.window_slots = max(1, int(num_blocks * cfg.window_share))
        if num_blocks < 1:
            raise ValueError(f"{what} holds no block; raise it")
        return num_blocks

    def _new_pool(self, num_blocks: int) -> KVPool:
        model = self.model
        layers = frozenset() if self.window is None else self.window[1]
        pool = KVPool(
            self.specs,
            num_blocks,
            self.block_size,
            dtype=model.dtype,
            device=model.device,
            check_memory=self.config.check_memory,
            window_layers=layers,
            window_slots=self.window_slots if layers else 0,
        )
        if self.window is not None:
            if self.cache.windows is None:
                self.cache.attach_windows(WindowSlots(self.window[0], self.block_size, self.window_slots, num_blocks))
            pool.attach_windows(self.cache.windows)
        return pool

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """The engine's step budget (the config's, else the defaults)."""
        return self.config.engine or SchedulerConfig()

    # ---- names -------------------------------------------------------------------------------------------
    def namespace(self, name: str) -> str:
        """The cache namespace of the caller's ``name`` (tenant, adapter, ...): the model's fingerprint joined with
        it, so caches of different models never mix."""
        return cache_namespace(self.fingerprint, name)

    @property
    def device(self) -> torch.device:
        return torch.device(self.model.device)

    @property
    def kv_pool(self) -> KVPool:
        """The pool of a cacheable model (a passthrough runtime has none)."""
        assert self.pool is not None, "a passthrough runtime has no KV pool"
        return self.pool

    def binding(self) -> TierBinding:
        """What this runtime's tier entries are bound to (model, weights, dtype, block size, hash seed)."""
        return binding_for(self.model, self.fingerprint, self.specs, self.block_size, self.cache.config.hash_seed)

    # ---- the weights, dtype and device watch ------------------------------------------------------------------
    def follow(self) -> None:
        """Before a cached call: if the model moved or changed dtype, remake the pool there; if its weights
        changed, drop the cache with a ``StaleCacheWarning``. KV of other weights, dtype or device is never served.
        Keeps the counters. Changes the cache (only when something changed)."""
        model, pool = self.model, self.pool
        if pool is None:
            return
        if model.dtype != pool.dtype or self.device != pool.device:
            self.pool = self._new_pool(pool.num_blocks)
            self.drop()
            self._weights = WeightsSnapshot.take(model)  # the cast made new tensors: no weight change to warn about
            self.fingerprint = fingerprint(model)
            if self.hybrid is not None:  # states of another dtype or device: a new state pool, probed anew
                try:
                    self.hybrid = self._open_hybrid()
                except LoadCheckError as exc:
                    self._uncached_at_load(str(exc))
                    return
            self._rebind_tiers()
            self._link_hybrid()
            self._check_at_load()  # the other dtype or device is checked as the first one was
            self._images_checked = False  # and so is the image path, at its next call
            return
        now = WeightsSnapshot.take(model)
        what = describe_change(model, self._weights, now)
        self._weights = now
        if what is None:
            return
        blocks = self.cache.num_cached_blocks
        self.drop()
        self._rebind_tiers()
        if blocks:
            warnings.warn(
                f"PrefixCachedModel: the model's weights changed since the cache was filled ({what}); "
                f"dropped {blocks} cached blocks",
                StaleCacheWarning,
                stacklevel=4,
            )

    def is_current(self) -> bool:
        """Whether the cache was filled by the model as it is now (same dtype, device and weights). Changes
        nothing."""
        pool, model = self.pool, self.model
        if pool is None:
            return True
        if model.dtype != pool.dtype or self.device != pool.device:
            return False
        return describe_change(model, self._weights, WeightsSnapshot.take(model)) is None

    def drop(self, *, keep_stats: bool = True) -> None:
        """Forget every cached block and the miss-cause history; calls in progress commit nothing (``epoch``); the
        engine's requests fail (their blocks are gone) and the engine is remade on next use."""
        engine = self._engine
        if engine is not None and engine.has_work():
            engine.abort_all(RuntimeError("the prefix cache was dropped (weights, dtype or device changed)"))
        self._engine = None
        self._engine_reason = None
        self._linears = None
        self.cache.reset(keep_stats=keep_stats)
        self.causes.reset()
        self.encoder_cache.clear(keep_stats=keep_stats)
        if self.hybrid is not None:
            self.hybrid.reset()
        if not keep_stats and self.tier is not None:
            self._tier_served_base = self.tier.counters.served_blocks
        self.epoch += 1

    def close(self) -> None:
        """Finish the tier's queued writes and close its store (the pool stays usable; the tier is gone)."""
        with self.lock:
            tier, self.tier = self.tier, None
            states, self._state_tier = self._state_tier, None
            self._link_hybrid()
            self._engine = None
            self._engine_reason = None
        if states is not None:  # first: it writes into the store the K/V tier closes
            states.close()
        if tier is not None:
            tier.close()

    # ---- the engine --------------------------------------------------------------------------------------------
    def engine(self) -> Engine | None:
        """The continuous-batching engine over this cache and pool (made on first use, after ``follow``), or None
        when the model cannot run on it (``engine_unsupported_reason`` says why). Hold ``lock`` around anything
        that steps it."""
        with self.lock:
            self.follow()
            if self._engine is None and self._engine_reason is None:
                self._engine_reason = self._paged_reason()
                if self._engine_reason is None:
                    self._engine = Engine(
                        self.model,
                        self.cache,
                        self.kv_pool,
                        config=self.scheduler_config,
                        eos_token_ids=eos_ids(self.model.generation_config),
                        linears=self._packed(),
                        fused=self._fused_ops(),
                        tier=self.tier,
                        hybrid=self.hybrid,
                    )
            return self._engine

    @property
    def engine_unsupported_reason(self) -> str | None:
        """Why ``engine()`` is None (None when it is not, or was not asked for yet)."""
        return self._engine_reason

    def _paged_reason(self) -> str | None:
        """Why the model cannot run on the paged engine exactly (a probe forward compared with its own), or None."""
        if self.pool is None:
            return f"model not cacheable: {self.unsupported_reason}"
        reason = paged_unsupported_reason(self.model, self.pool)
        if reason is None:
            hy = self.hybrid
            slot = None if hy is None else hy.take_live()
            try:
                with self.cache.borrowed_blocks(min(4, self.cache.num_blocks)) as blocks:
                    states = None if hy is None else hy.pool
                    ws = self.cache.windows
                    if ws is not None:  # the probe writes its window layers too
                        ws.give(("probe",), blocks)
                    try:
                        diff = probe_difference(self.model, self.pool, blocks, states=states, slot=slot or 0)
                        own = None if diff <= PROBE_TOLERANCE else own_difference(self.model, self.pool, blocks)
                    finally:
                        if ws is not None:
                            ws.drop(("probe",))
            except Exception as exc:  # a paged forward that raises on this install: not used, with what it raised
                return f"its paged probe forward raised {type(exc).__name__}: {exc} ({label()})"
            finally:
                if hy is not None and slot is not None:
                    hy.give_back(slot)
            # the bar: the tolerance, or the model's own moves between the same two chunks and one pass (where a
            # library's results depend on the row count, an uncached run moves as much)
            if diff > max(PROBE_TOLERANCE, OWN_DIFFERENCE_SLACK * (own or 0.0)):
                reason = f"its paged forward's logits differ from its own by {diff:.1e} (relative; {label()})"
                if own:
                    reason += f"; its own forward in the same two chunks differs by {own:.1e}"
        return reason

    def _packed(self) -> Any:
        """The engine's prepacked linears (``engine.paged.linear``), or None."""
        fast = self.config.fast_linear
        if fast is False or linear.available(self.model) is not None:
            return None
        if self._linears is None:
            if fast is None and linear.weight_bytes(self.model) > FAST_LINEAR_MAX_BYTES:
                return None
            # its copy fits too (where oneDNN refuses the dtype, it is the only one)
            small = linear.kernel_only(self.model) or linear.weight_bytes(self.model) <= FAST_LINEAR_MAX_BYTES // 2
            self._linears = linear.PackedLinears(self.model, small_rows=small)
        return self._linears

    def _fused_ops(self) -> Any:
        """The engine's fused element-wise ops (``engine.paged.fused``), or None: off, not on the CPU, or nothing
        of the model's is known to them."""
        if not self.config.fused_ops or torch.device(self.model.device).type != "cpu":
            return None
        ops = fused.FusedOps(self.model)
        return ops if any(ops.counts().values()) else None

    # ---- figures -----------------------------------------------------------------------------------------------
    def cache_stats(self) -> dict[str, Any]:
        """Counters since construction or the last reset, plus occupancy. ``cached_tokens`` (and ``hit_blocks``,
        the hit rates) count every prompt token served from cache, the pool's and the tier's alike (as
        ``RowStats.cached_tokens`` and serve's ``usage`` do); ``pool_cached_tokens`` / ``tier_cached_tokens`` split
        them. Changes nothing."""
        with self.lock:
            d: dict[str, Any] = self.cache.stats.as_dict()
            d.update(
                blocks_used=self.cache.num_cached_blocks,
                blocks_capacity=self.cache.num_blocks,
                block_size=self.block_size,
                pool_bytes=self.pool.nbytes if self.pool is not None else 0,
                active_requests=self.cache.num_active_requests,
            )
            tier_blocks = 0
            if self.tier is not None:
                d.update(self.tier.stats())
                tier_blocks = int(d["tier_served_blocks"]) - self._tier_served_base
            d["pool_cached_tokens"], d["pool_hit_blocks"] = d["cached_tokens"], d["hit_blocks"]
            d["tier_cached_tokens"] = tier_blocks * self.block_size
            d["cached_tokens"] += d["tier_cached_tokens"]
            d["hit_blocks"] += tier_blocks
            d["token_hit_rate"] = d["cached_tokens"] / d["prompt_tokens"] if d["prompt_tokens"] else 0.0
            d["block_hit_rate"] = d["hit_blocks"] / d["lookup_blocks"] if d["lookup_blocks"] else 0.0
            if self.hybrid is not None:
                d.update(self.hybrid.stats())
            ws = self.cache.windows
            if ws is not None:  # the window group (docs/sliding.md)
                d.update(
                    window_slots=ws.capacity,
                    window_slots_held=ws.num_held,
                    window_slots_idle=ws.num_idle,
                    window_points=ws.num_points,
                    **{f"window_{k}": v for k, v in ws.stats.as_dict().items()},
                )
            d.update(self.encoder_cache.stats())
            if self._state_tier is not None:
                st = self._state_tier.counters
                d.update(state_tier_written=st.written_blocks, state_tier_served=st.served_blocks)
            return d

    def warn_once(self, message: str, category: type[Warning], stacklevel: int = 4) -> None:
        """Warn ``message`` the first time it is seen (at most 64 distinct messages are remembered)."""
        if message not in self._warned and len(self._warned) < 64:
            self._warned.add(message)
            warnings.warn(message, category, stacklevel=stacklevel)


def _positive(name: str, value: Any) -> int:
    """``value`` (a Python or numpy integer) as an int > 0; TypeError / ValueError naming ``name`` otherwise."""
    return check_int(value, f"PrefixCachedModel: {name}", minimum=1)


def fingerprint(model: Any) -> str:
    """A short hash of the model's class, config and dtype (caches of different models never mix)."""
    try:
        cfg = model.config.to_json_string(use_diff=False)
    except Exception:  # pragma: no cover
        cfg = repr(model.config)
    return xxhash.xxh3_64_hexdigest(f"{type(model).__name__}|{model.dtype}|{cfg}".encode())


def eos_ids(generation_config: Any) -> tuple[int, ...]:
    """The EOS token ids of a generation config (``eos_token_id``: None, an int, or a list) as a tuple."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, torch.Tensor):
        return tuple(int(t) for t in eos.flatten().tolist())
    return tuple(int(t) for t in eos)
