"""PrefixCachedModel: a drop-in wrapper whose ``generate`` serves prompt prefixes from a KV block cache.

One call: every row's tokens (left padding stripped) -> ``PrefixCache.match`` (namespace = model fingerprint +
the caller's namespace) -> its cached blocks gathered from the ``KVPool`` into row r of a batch buffer, at its
padded position -> (batches) each row's uncached suffix prefilled on its own into the same buffer -> ONE
``model.generate`` on the original ids over a cache of those buffers, so the prompts' last tokens and all
decoding run batched, exactly as on the bare model, with new tokens written into the buffers' room instead of
concatenated -> ``commit`` each output row's full blocks (prompt + generated up to its first EOS) and scatter
their K/V into the pool -> ``release`` (always, in a ``finally``).

Anything that cannot be served exactly from a cached prefix runs uncached (plain ``model.generate``): beam
search and other non greedy/sampling modes, ``use_cache=False``, ``inputs_embeds``, ``output_attentions`` /
``output_hidden_states`` (their prompt step would cover only the suffix), static/quantized cache
implementations, right padding, missing ``attention_mask`` with pad tokens in the ids, non-integer or empty
ids. A cache passed by the caller (``cache=`` / ``past_key_values=``) is refused.

Cached KV is only valid for the weights that computed it: before every cached call the wrapper compares a
snapshot of the model's parameters and buffers (``engine.weights``) with the previous call's and, when any
changed, drops the cache with a ``StaleCacheWarning``.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import os
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from engine import hf_cache
from engine.batching import offline
from engine.batching.attach import EngineSlot
from engine.batching.engine import Engine
from engine.batching.scheduler import SchedulerConfig
from engine.kv_pool import KVPool, bytes_per_token
from engine.models import context_length
from engine.tier import KVTier, TierBinding, open_tier
from engine.tier.kv_tier import block_tokens, extend_keys, write_rows
from engine.tier.open import binding_for
from engine.weights import WeightsSnapshot, describe_change
from prefixcache import CacheConfig, PrefixCache
from prefixcache.core import MatchResult
from prefixcache.core.hashing import BlockHasher, as_token_array
from prefixcache.sim.causes import Fork, LiveCauses, LiveRequest
from prefixcache.sim.results import CAUSE_FIELDS

DEFAULT_MAX_CACHED_TOKENS = 32_768
HISTORY_FACTOR = 4  # the miss-cause history remembers this many pools' worth of committed tokens
_ALLOWED_MODES = ("greedy_search", "sample")
_BATCH_SHAPED_KWARGS = ("position_ids", "token_type_ids", "cache_position", "decoder_input_ids")


@dataclass(frozen=True)
class RowStats:
    """One batch row of the last ``generate`` call: prompt length, tokens served from cache (pool and tier), blocks
    added (the tier's loaded ones included), and
    why the other prompt tokens missed (``prefixcache.sim.causes``; they sum to prompt - cached): the wrapper
    remembers what it committed, up to ``HISTORY_FACTOR`` times its pool in tokens unless ``miss_history_tokens``
    says otherwise (older content counts as cold); ``shared_tokens``/``shared_with``: the longest prefix it shares with an earlier row (numbered from
    0 since construction or ``reset_cache``) and which row that was."""

    prompt_tokens: int
    cached_tokens: int
    inserted_blocks: int
    cold_tokens: int | None = None
    evicted_tokens: int | None = None
    diverged_tokens: int | None = None
    partial_block_tokens: int | None = None
    namespace_tokens: int | None = None
    not_cached_tokens: int | None = None
    shared_tokens: int | None = None
    shared_with: int | None = None
    divergence: Fork | None = None  # with diverged tokens: the tokens each side of where it departs
    tier_tokens: int = 0  # of ``cached_tokens``, served by the second tier (disk or shared)


@dataclass(frozen=True)
class Explanation:
    """What ``explain`` found for one prompt (nothing changed): ``cached_tokens`` a ``generate`` would serve now;
    ``common_tokens`` the longest common prefix with anything cached (may end inside a block); the prompt's
    next tokens there and the nearest cached path's (``prompt_next`` / ``cached_next``, as ``*_text`` when the
    wrapper has a tokenizer); ``causes``: why its other tokens would miss now (cause -> tokens)."""

    prompt_tokens: int
    cached_tokens: int
    common_tokens: int
    prompt_next: tuple[int, ...]
    cached_next: tuple[int, ...]
    prompt_text: str | None
    cached_text: str | None
    causes: dict[str, int]


class UncachedCallWarning(UserWarning):
    """A generate call ran without the prefix cache (its reason is in the message and last_uncached_reason)."""


class StaleCacheWarning(UserWarning):
    """The wrapped model's weights changed since the cache was filled; the cached KV was dropped."""


class UnverifiedCacheWarning(UserWarning):
    """``verify_tokens=False``: a block-hash collision would serve another prompt's KV (wrong outputs)."""


class EngineFallbackWarning(UserWarning):
    """A batch API call could not run on the paged engine (the reason is in the message) and ran another way."""


class UnsupportedModelError(ValueError):
    """The model's cache cannot be served from a prefix cache (recurrent state, encoder-decoder, ...)."""


class PrefixCachedModel:
    """Wraps a causal LM; ``generate`` returns what ``model.generate`` returns, reusing cached prefix KV.

    Size the pool by ``max_cached_tokens`` or ``max_cached_bytes`` (one of them; default 32,768 tokens);
    sizes and ``block_size`` are ints > 0 (numpy integers too). The pool costs bytes per token (K+V of every
    layer: 2 x layers x KV heads x head dim x dtype size) x tokens, allocated at once on the model's device:
    ``check_memory`` (default True) refuses one above 90% of the device's available memory
    (``engine.memory.PoolTooLargeError``, naming both) and warns above 50% (``PoolSizeWarning``).
    ``miss_history_tokens``: how much committed content the miss-cause history remembers (``RowStats``' causes;
    default None: 4 pools' worth; past it, content seen only before counts as cold); ``"unlimited"`` keeps it
    all, as ``prefixcache replay`` does so that its causes do not depend on the pool's size.
    ``on_unsupported``: "error" (default) raises ``UnsupportedModelError`` for models that cannot be cached
    exactly; "passthrough" wraps them anyway and runs every call uncached. Thread-safe (one lock).
    Attributes not defined here fall through to the wrapped model.

    ``verify_tokens`` (default True) keeps every cached block's token ids and checks each match against them.
    Turning it off saves that memory and compare, but then a collision of the 128-bit block hashes serves
    another prompt's KV for this one: silently wrong outputs. Turning it off warns (``UnverifiedCacheWarning``).
    ``hasher`` replaces the block hash (a test seam for forced collisions, as in ``PrefixCache``; leave it None).

    A second tier below the pool (``engine.tier``, docs/tiers.md): ``disk_cache=DIR`` keeps every block the pool
    caches in an LMDB store there too (written through, off the request's path), with ``max_disk_bytes`` (an int
    or "50G"; default 8 GiB) and its own LRU; ``shared_cache="redis://host:port"`` keeps them on a Redis server
    that several processes share. A match that stops in the pool continues in the tier; the blocks found there
    are loaded into the pool. ``cache_stats()`` reports ``tier_*`` counters; ``close()`` finishes the writes.

    Weights: changing the model's parameters or buffers in place (an optimizer step, ``load_state_dict``, a
    LoRA merge, ``param.data.copy_``) or replacing one makes the cached KV stale; the next cached call notices
    (``engine.weights``: version counters, storage pointers and a few sampled values of every tensor) and drops
    the cache, keeping the counters, with a ``StaleCacheWarning`` naming a changed tensor. A write through
    ``.data`` confined to a few elements (one edited embedding row) can go unnoticed: call ``reset_cache()``.
    """

    tokenizer: Any  # set by from_pretrained

    def __init__(
        self,
        model,
        *,
        max_cached_tokens: int | None = None,
        max_cached_bytes: int | None = None,
        block_size: int = 16,
        eviction: str = "lru",
        hash_seed: int = 0,
        verify_tokens: bool = True,
        on_unsupported: str = "error",
        hasher: BlockHasher | None = None,
        engine_config: SchedulerConfig | None = None,
        fast_linear: bool | None = None,
        disk_cache: str | os.PathLike | None = None,
        max_disk_bytes: int | str | None = None,
        shared_cache: str | None = None,
        check_memory: bool = True,
        miss_history_tokens: int | str | None = None,
    ) -> None:
        if on_unsupported not in ("error", "passthrough"):
            raise ValueError(f"on_unsupported must be 'error' or 'passthrough', got {on_unsupported!r}")
        if max_cached_tokens is not None and max_cached_bytes is not None:
            raise ValueError("give max_cached_tokens or max_cached_bytes, not both")
        block_size = _positive_int("block_size", block_size)
        if max_cached_tokens is not None:
            max_cached_tokens = _positive_int("max_cached_tokens", max_cached_tokens)
        if max_cached_bytes is not None:
            max_cached_bytes = _positive_int("max_cached_bytes", max_cached_bytes)
        if isinstance(miss_history_tokens, str) and miss_history_tokens != "unlimited":
            raise ValueError(
                f"PrefixCachedModel: miss_history_tokens must be an int > 0, 'unlimited' or None, "
                f"got {miss_history_tokens!r}"
            )
        if miss_history_tokens is not None and miss_history_tokens != "unlimited":
            miss_history_tokens = _positive_int("miss_history_tokens", miss_history_tokens)
        object.__setattr__(self, "model", model)
        self._lock = threading.RLock()
        self._warned: set[str] = set()
        self._active = 0  # cached generate calls in progress (a nested one, from a callback, runs uncached)
        self._epoch = 0  # bumped whenever the cache is dropped: a call that outlives its cache commits nothing
        self.block_size = block_size
        self.last_request_stats: tuple[RowStats, ...] = ()
        self.last_uncached_reason: str | None = None
        self.uncached_calls = 0
        self.tier: KVTier | None = None
        self._check_memory = bool(check_memory)
        self._slot = EngineSlot(engine_config, fast_linear)
        self.unsupported_reason = hf_cache.unsupported_reason(model)
        if self.unsupported_reason is not None and on_unsupported == "error":
            raise UnsupportedModelError(
                f"PrefixCachedModel cannot cache {type(model).__name__}: {self.unsupported_reason}. "
                "Pass on_unsupported='passthrough' to run it uncached."
            )
        self.fingerprint = _fingerprint(model)
        self._cache_kwarg = hf_cache.cache_kwarg(model)
        self._logits_kwargs = hf_cache.last_logits_only(model)
        if self.unsupported_reason is not None:  # passthrough: a 1-block core keeps the API usable
            self.pool = None
            self.cache = PrefixCache(CacheConfig(num_blocks=1, block_size=block_size, eviction=eviction))
            self._causes = LiveCauses(block_size, _history_bound(miss_history_tokens, block_size))
            return
        specs = hf_cache.probe_specs(model)
        per_block = bytes_per_token(specs, model.dtype) * block_size
        if max_cached_bytes is not None:
            num_blocks = max_cached_bytes // per_block
            what = f"max_cached_bytes={max_cached_bytes} ({per_block} bytes per block)"
        else:
            tokens = DEFAULT_MAX_CACHED_TOKENS if max_cached_tokens is None else max_cached_tokens
            num_blocks = tokens // block_size
            what = f"max_cached_tokens={tokens} (block_size={block_size})"
        if num_blocks < 1:
            raise ValueError(f"{what} holds no block; raise it")
        self.cache = PrefixCache(
            CacheConfig(
                num_blocks=num_blocks,
                block_size=block_size,
                eviction=eviction,
                hash_seed=hash_seed,
                verify_tokens=verify_tokens,
            ),
            hasher=hasher,
        )
        if not verify_tokens:
            warnings.warn(
                "PrefixCachedModel(verify_tokens=False): matches are not checked against the cached tokens, so a "
                "block-hash collision would serve another prompt's KV (wrong outputs, no error)",
                UnverifiedCacheWarning,
                stacklevel=2,
            )
        self.pool = KVPool(
            specs, num_blocks, block_size, dtype=model.dtype, device=model.device, check_memory=self._check_memory
        )
        self._specs = specs
        if disk_cache is not None or shared_cache is not None or max_disk_bytes is not None:
            self.tier = open_tier(
                self._binding(), disk_cache=disk_cache, max_disk_bytes=max_disk_bytes, shared_cache=shared_cache
            )
            self._slot.tier = self.tier
        self._causes = LiveCauses(block_size, _history_bound(miss_history_tokens, num_blocks * block_size))
        self._weights = WeightsSnapshot.take(model)

    # ---- construction helpers ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, name_or_path: str, *, dtype: Any = None, device: Any = None, seed: int = 0, **kwargs
    ) -> PrefixCachedModel:
        """Load a preset or a local HF model dir (see ``engine.models.load_model``) and wrap it.

        The tokenizer is kept as ``.tokenizer``.
        """
        from engine.models import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device, seed=seed)
        pcm = cls(model, **kwargs)
        pcm.tokenizer = tokenizer
        return pcm

    # ---- attribute fall-through ----------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("model")
        if model is None:
            raise AttributeError(name)
        return getattr(model, name)

    def __call__(self, *args, **kwargs):
        """A plain (uncached) forward of the wrapped model."""
        return self.model(*args, **kwargs)

    def to(self, *args, **kwargs) -> PrefixCachedModel:
        """Move/cast the wrapped model (like ``nn.Module.to``) and return the WRAPPER; the pool follows on the
        next call (cached blocks are dropped then)."""
        self.model.to(*args, **kwargs)
        return self

    def cuda(self, *args, **kwargs) -> PrefixCachedModel:
        self.model.cuda(*args, **kwargs)
        return self

    def cpu(self) -> PrefixCachedModel:
        self.model.cpu()
        return self

    def half(self) -> PrefixCachedModel:
        self.model.half()
        return self

    def float(self) -> PrefixCachedModel:
        self.model.float()
        return self

    def bfloat16(self) -> PrefixCachedModel:
        self.model.bfloat16()
        return self

    def _follow_model(self) -> None:
        """If the model moved or changed dtype since the pool was made, remake the pool there (dropping
        cached blocks, keeping the counters): KV of another dtype or device must never be served."""
        model, pool = self.model, self.pool
        if pool is None or (model.dtype == pool.dtype and torch.device(model.device) == pool.device):
            return
        self.pool = KVPool(
            self._specs,
            pool.num_blocks,
            pool.block_size,
            dtype=model.dtype,
            device=model.device,
            check_memory=self._check_memory,
        )
        self._drop_cache()
        self._slot.reset()
        self._weights = WeightsSnapshot.take(model)  # the cast made new tensors: no weight change to warn about
        self.fingerprint = _fingerprint(model)
        if self.tier is not None:
            self.tier.rebind(self._binding())

    def _follow_weights(self) -> None:
        """Drop the cache (keeping the counters) with a StaleCacheWarning when the model's parameters or buffers
        changed since the last cached call: KV computed with other weights must never be served."""
        now = WeightsSnapshot.take(self.model)
        what = describe_change(self.model, self._weights, now)
        self._weights = now
        if what is None:
            return
        blocks = self.cache.num_cached_blocks
        self._drop_cache()
        if self.tier is not None:
            self.tier.rebind(self._binding())
        if blocks:
            warnings.warn(
                f"PrefixCachedModel: the model's weights changed since the cache was filled ({what}); "
                f"dropped {blocks} cached blocks",
                StaleCacheWarning,
                stacklevel=4,
            )

    def _drop_cache(self, *, keep_stats: bool = True) -> None:
        """Forget every cached block (and the miss-cause history); calls in progress will commit nothing (see
        ``_epoch``); the engine's requests fail (their blocks are gone) and its packed weights are remade."""
        if self._slot.engine is not None and self._slot.engine.has_work():
            self._slot.reset(RuntimeError("the prefix cache was dropped (weights, dtype or device changed)"))
        else:
            self._slot.reset()
        self.cache.reset(keep_stats=keep_stats)
        self._causes.reset()
        self._epoch += 1

    def _binding(self) -> TierBinding:
        """What this wrapper's tier entries are bound to (model, weights, dtype, block size, hash seed)."""
        return binding_for(self.model, self.fingerprint, self._specs, self.block_size, self.cache.config.hash_seed)

    def close(self) -> None:
        """Finish the tier's queued writes and close its store (the pool stays usable; the tier is gone)."""
        with self._lock:
            tier, self.tier = self.tier, None
            self._slot.tier = None
            self._slot.reset()
        if tier is not None:
            tier.close()

    def _tier_extend(self, m: MatchResult, ids: Any, namespace: str) -> tuple[MatchResult, int]:
        """Continue ``m`` (a pinned match of the prompt ``ids``) along its chained block keys in the tier: the
        blocks found there are committed to the pool and their K/V written into it (``prefixcache.core.tier``'s
        protocol). Returns the extended match and the blocks the tier served."""
        tier, bs = self.tier, self.block_size
        assert tier is not None
        p, limit = m.cached_blocks, (len(ids) - 1) // bs
        keys: list[bytes] = []
        extend_keys(keys, ids, namespace, bs, self.cache.config.hash_seed, limit)
        t = tier.lookup(keys, p, limit)
        if t == 0:
            return m, 0
        rows = tier.fetch(keys[p : p + t], block_tokens(ids, bs, p, p + t))
        if len(rows) == 0:
            return m, 0
        res = self.cache.commit(m.handle, ids[: (p + len(rows)) * bs])
        got = len(res.block_ids)
        write_rows(self._pool, rows[:got], res.block_ids, tier.binding)
        return MatchResult(m.handle, (p + got) * bs, p + got, (*m._runs, res._new)), got

    @property
    def _pool(self) -> KVPool:
        """The pool of a cached call (a passthrough wrapper has none and never makes one)."""
        assert self.pool is not None, "a passthrough PrefixCachedModel has no KV pool"
        return self.pool

    def __repr__(self) -> str:
        return (
            f"PrefixCachedModel({type(self.model).__name__}, blocks={self.cache.num_blocks}, "
            f"block_size={self.block_size})"
        )

    # ---- cache management ----------------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Drop every cached block and zero the counters (the pool memory stays allocated). From inside a
        running ``generate`` (a callback), that call still returns its output but caches nothing."""
        with self._lock:
            self._drop_cache(keep_stats=False)
            self.uncached_calls = 0
            self.last_request_stats = ()

    def cache_stats(self) -> dict:
        """Counters since construction or ``reset_cache``, plus pool occupancy. Changes nothing."""
        with self._lock:
            d = self.cache.stats.as_dict()
            d.update(
                blocks_used=self.cache.num_cached_blocks,
                blocks_capacity=self.cache.num_blocks,
                block_size=self.block_size,
                pool_bytes=self.pool.nbytes if self.pool is not None else 0,
                uncached_calls=self.uncached_calls,
                active_requests=self.cache.num_active_requests,
            )
            if self.tier is not None:
                d.update(self.tier.stats())
                d["tier_cached_tokens"] = d.get("tier_hit_blocks", 0) * self.block_size
            return d

    def probe(self, tokens: Any, namespace: str = "default") -> int:
        """Leading tokens of ``tokens`` (1-D ids) a ``generate`` in ``namespace`` would serve from cache now
        (0 when the model's weights, dtype or device changed since: that call would drop the cache first).

        Changes nothing."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu()
        with self._lock:
            pool, model = self.pool, self.model
            if pool is not None and (
                model.dtype != pool.dtype
                or torch.device(model.device) != pool.device
                or describe_change(model, self._weights, WeightsSnapshot.take(model)) is not None
            ):
                return 0
            return self.cache.probe(tokens, f"{self.fingerprint}:{namespace}")

    def explain(self, input_ids: Any, namespace: str = "default", *, context: int = 16) -> Explanation:
        """Why ``input_ids`` (one prompt: 1-D ids, or a batch of one) would miss in ``namespace`` now: the
        longest cached prefix, where it departs from the nearest cached path and what differs there (up to
        ``context`` tokens each side), and its uncached tokens by cause. Changes nothing."""
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.detach().cpu()
            if input_ids.ndim == 2 and input_ids.shape[0] == 1:
                input_ids = input_ids[0]
        ids = as_token_array(input_ids, "input_ids")
        if len(ids) == 0:
            raise ValueError("input_ids is empty: explain needs a prompt of at least one token")
        ns = f"{self.fingerprint}:{namespace}"
        with self._lock:
            d = self.cache.divergence(ids, ns, context=context)
            why = self._causes.request(ids, ns, d.cached_tokens, count=False).causes
        prompt_next = tuple(ids[d.common_tokens : d.common_tokens + context].tolist())
        decode = getattr(self.__dict__.get("tokenizer"), "decode", None)
        return Explanation(
            len(ids),
            d.cached_tokens,
            d.common_tokens,
            prompt_next,
            d.cached_next,
            None if decode is None else decode(list(prompt_next)),
            None if decode is None else decode(list(d.cached_next)),
            {c: getattr(why, c) for c in CAUSE_FIELDS},
        )

    # ---- generate ------------------------------------------------------------------------------------
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        namespace: str | Sequence[str] = "default",
        **kwargs,
    ) -> Any:
        """``model.generate`` with prefix caching; same arguments, same return value.

        ``namespace`` (tenant, adapter, ...) separates caches: requests never share blocks across namespaces.
        A sequence gives one namespace per batch row (a server batch mixes tenants).
        Changes the cache: matched blocks are refreshed, new full blocks of prompt + output are inserted.
        """
        if input_ids is None and "inputs" in kwargs:
            input_ids = kwargs.pop("inputs")
        for key in ("cache", "past_key_values"):
            if kwargs.get(key) is not None:
                raise ValueError(
                    f"PrefixCachedModel.generate: a caller-supplied {key}= cannot be combined with the prefix cache "
                    "(it supplies the cache itself); call the wrapped model's generate (pcm.model.generate) instead"
                )
        namespaces = _row_namespaces(namespace, input_ids)
        with self._lock:
            gc = None
            reason = "nested call (from inside another generate of this wrapper)" if self._active else None
            if reason is None:
                reason = self._uncached_reason(input_ids, attention_mask, kwargs)
            if reason is None:
                gc, reason = self._merged_config(kwargs)
            if reason is not None:
                if input_ids is not None:
                    kwargs["input_ids"] = input_ids
                if attention_mask is not None:
                    kwargs["attention_mask"] = attention_mask
                return self._run_uncached(reason, kwargs)
            self.last_uncached_reason = None
            self._follow_model()
            self._follow_weights()
            self._active += 1
            assert input_ids is not None  # _uncached_reason saw to it
            try:
                spaces = [f"{self.fingerprint}:{ns}" for ns in namespaces]
                return self._generate_cached(input_ids, attention_mask, gc, spaces, kwargs)
            finally:
                self._active -= 1

    # ---- the paged engine: batches -------------------------------------------------------------------
    def engine(self) -> Engine | None:
        """The continuous-batching engine over this wrapper's cache and pool (made on first use; see
        ``engine.batching``), or None when the model cannot run on it (``engine_unsupported_reason`` says why).
        Hold the wrapper's lock (``with pcm.lock:``) around anything that steps it."""
        with self._lock:
            if self.pool is not None:
                self._follow_model()
                self._follow_weights()
            return self._slot.get(self)

    @property
    def engine_unsupported_reason(self) -> str | None:
        """Why ``engine()`` is None (None when it is not, or was not asked for yet)."""
        return self._slot.reason

    @property
    def lock(self) -> threading.RLock:
        """The lock every cached call holds (a serving loop holds it around each engine step)."""
        return self._lock

    def generate_batch(
        self,
        inputs: Sequence[Any],
        generation_config: Any = None,
        *,
        namespace: str = "default",
        progress_bar: bool = False,
        seed: int | None = None,
        **kwargs,
    ) -> dict[str, offline.BatchOutput]:
        """Generate for every prompt of ``inputs`` (lists of token ids, no padding) on the engine: continuous
        batching, each prompt served from its longest cached prefix, prompts sharing an uncached prefix computing
        it once. Returns ``{"req_0": BatchOutput, ...}`` in input order (``req_i_j`` with
        ``num_return_sequences``), as transformers' ``generate_batch`` does. Settings come from
        ``generation_config`` (default the model's) updated by ``kwargs``: greedy or sampling with temperature,
        top_k, top_p; ``seed`` seeds request k's sampler with ``seed + k``. Other settings raise ValueError.
        Changes the cache like ``generate``.
        """
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        prompts = [offline.token_list(p, f"inputs[{i}]") for i, p in enumerate(inputs)]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"inputs[{i}] is empty: a prompt needs at least one token")
        base = generation_config or self.model.generation_config
        copies = int(kwargs.pop("num_return_sequences", None) or getattr(base, "num_return_sequences", 1) or 1)
        params = [offline.sampling_params(base, dict(kwargs), len(p)) for p in prompts]
        if copies > 1 and params and params[0].greedy:
            raise ValueError("num_return_sequences > 1 needs sampling (do_sample=True): greedy copies are identical")
        with self._lock:
            engine = self.engine()
            if engine is None:
                return self._generate_batch_fallback(prompts, base, kwargs, namespace, copies)
            reqs = offline.generate_requests(prompts, params, f"{self.fingerprint}:{namespace}", copies)
            if seed is not None:
                for k, (_, r) in enumerate(reqs):
                    assert r.params is not None
                    r.params = dataclasses.replace(r.params, seed=seed + k)
            order = offline.lexicographic([r.tokens for _, r in reqs])
            with offline.progress_bar(len(reqs), "generate_batch", progress_bar) as progress:
                offline.run(engine, [reqs[i][1] for i in order], window=self._window(engine), progress=progress)
            self.last_request_stats = ()
            return offline.collect_outputs(reqs)

    def score(
        self,
        requests: Sequence[tuple[Any, Any]],
        *,
        namespace: str = "default",
        token_logprobs: bool = False,
        max_length: int | None = None,
        commit_continuations: bool = False,
        reorder: bool = True,
        progress_bar: bool = False,
    ) -> list[offline.ScoreResult]:
        """Log-likelihood of each continuation given its context (``requests``: (context ids, continuation ids)
        pairs), served from cached prefixes: a list of ``ScoreResult`` (summed log-probability, whether it is the
        greedy continuation, per-token log-probs with ``token_logprobs``) in the caller's order, equal to the bare
        model's forward within float tolerance. At most ``len(context) - 1`` tokens of each come from cache.
        Requests run in token-sequence order (``reorder``), so an item's choices and requests that share
        exemplars run while their prefix is cached. Sequences longer than ``max_length + 1`` (default: the
        model's context length) lose tokens from the left, as lm-evaluation-harness does. Contexts are cached;
        continuations too with ``commit_continuations``. Changes the cache."""
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        limit = (
            max_length if max_length is not None else context_length(self.model.config.get_text_config(decoder=True))
        )
        if limit is not None:
            limit = _positive_int("max_length", limit)
        with self._lock:
            reqs, cut = offline.score_requests(
                list(requests), f"{self.fingerprint}:{namespace}", max_length=limit, commit=commit_continuations, top=0
            )
            engine = self.engine()
            if engine is None:
                self._warn_fallback(f"score: {self._slot.reason}; scoring with plain uncached forwards")
                return offline.score_uncached(self.model, reqs, cut, token_logprobs)
            order = offline.lexicographic([r.tokens for r in reqs]) if reorder else list(range(len(reqs)))
            with offline.progress_bar(len(reqs), "score", progress_bar) as progress:
                offline.run(engine, [reqs[i] for i in order], window=self._window(engine), progress=progress)
            self.last_request_stats = ()
            return offline.score_results(reqs, cut, token_logprobs)

    def _window(self, engine: Engine) -> int:
        """Requests kept waiting in the engine by a batch call: enough to fill every step."""
        return max(2 * engine.config.max_running, 8)

    def _generate_batch_fallback(self, prompts, base, kwargs: dict, namespace: str, copies: int):
        """``generate_batch`` through ``generate`` (prompt by prompt) for a model the engine cannot run."""
        self._warn_fallback(f"generate_batch: {self._slot.reason}; running each prompt through generate()")
        out = {}
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], dtype=torch.long, device=self.model.device)
            for j in range(copies):
                rid = f"req_{i}" if copies == 1 else f"req_{i}_{j}"
                seq = self.generate(ids, generation_config=base, namespace=namespace, **kwargs)
                seq = seq if isinstance(seq, torch.Tensor) else seq.sequences
                cached = self.last_request_stats[0].cached_tokens if self.last_request_stats else 0
                gen = seq[0, len(p) :].tolist()
                eos = _eos_ids(base, "cpu")
                stop = eos is not None and bool(gen) and gen[-1] in eos.tolist()
                out[rid] = offline.BatchOutput(rid, p, gen, "stop" if stop else "length", cached)
        return out

    def _warn_fallback(self, reason: str) -> None:
        if reason not in self._warned and len(self._warned) < 64:
            self._warned.add(reason)
            warnings.warn(f"PrefixCachedModel: {reason}", EngineFallbackWarning, stacklevel=4)

    def _run_uncached(self, reason: str, kwargs: dict):
        """The bare model's generate, counted in ``uncached_calls``; warns once per distinct reason."""
        self.uncached_calls += 1
        self.last_uncached_reason = reason
        self.last_request_stats = ()
        if reason not in self._warned and len(self._warned) < 64:
            self._warned.add(reason)
            warnings.warn(
                f"PrefixCachedModel: running this call without the prefix cache: {reason}",
                UncachedCallWarning,
                stacklevel=4,
            )
        return self.model.generate(**kwargs)

    def _uncached_reason(self, input_ids, attention_mask, kwargs: dict) -> str | None:
        """Why this call must run uncached, or None. Changes nothing."""
        if self.unsupported_reason is not None:
            return f"model not cacheable: {self.unsupported_reason}"
        if input_ids is None:
            return "no input_ids (inputs_embeds or no prompt)"
        if kwargs.get("inputs_embeds") is not None:
            return "inputs_embeds given"
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            return "input_ids is not a 2-D tensor"
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            return f"input_ids has dtype {input_ids.dtype}, not integer"
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            return f"input_ids is empty (shape {tuple(input_ids.shape)})"
        if bool((input_ids < 0).any()):
            return "input_ids holds negative ids"
        for key in _BATCH_SHAPED_KWARGS:
            if kwargs.get(key) is not None:
                return f"{key} given"
        if kwargs.get("custom_generate") is not None or kwargs.get("assistant_model") is not None:
            return "custom_generate / assistant_model given"
        if kwargs.get("streamer") is not None and input_ids.shape[0] > 1:
            return "streamer with a batch (the model decides)"
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
                return "attention_mask is not a tensor shaped like input_ids"
            mask = attention_mask.to(torch.bool)
            # left padding only: each row is 0...0 1...1 with at least one 1
            if not bool(mask[:, -1].all()) or bool((mask[:, 1:].int() < mask[:, :-1].int()).any()):
                return "attention_mask is not left padding"
        return None

    def _merged_config(self, kwargs: dict):
        """The generation config ``generate`` will use, or a reason to run uncached."""
        base = kwargs.get("generation_config") or self.model.generation_config
        gc = copy.deepcopy(base)
        try:
            gc.update(**{k: v for k, v in kwargs.items() if k != "generation_config"})
        except Exception as exc:  # invalid settings: let the model raise its own error
            return None, f"invalid generation settings ({exc})"
        if gc.use_cache is False:
            return None, "use_cache=False"
        mode = str(getattr(gc.get_generation_mode(), "value", gc.get_generation_mode()))
        if mode not in _ALLOWED_MODES:
            return None, f"generation mode {mode} (only greedy search and sampling use the prefix cache)"
        if (gc.num_return_sequences or 1) > 1 and not gc.do_sample:
            return None, "num_return_sequences > 1 without sampling (the model decides what that means)"
        if getattr(gc, "cache_implementation", None) is not None:
            return None, f"cache_implementation={gc.cache_implementation!r}"
        if getattr(gc, "output_attentions", False) or getattr(gc, "output_hidden_states", False):
            return None, "output_attentions / output_hidden_states (the prompt step would cover only the suffix)"
        if getattr(gc, "prompt_lookup_num_tokens", None) is not None:
            return None, "prompt lookup decoding"
        if (getattr(gc, "guidance_scale", None) or 1.0) != 1.0:
            return None, "classifier-free guidance"
        if getattr(gc, "prefill_chunk_size", None) is not None:
            return None, "prefill_chunk_size"
        return gc, None

    def _generate_cached(self, input_ids: torch.Tensor, attention_mask, gc, namespaces: list[str], kwargs: dict):
        """One batched ``model.generate`` over a cache in which every row's prompt but its last token is ready.

        Each row (left padding stripped) gets its own cached prefix, gathered into row r of a batch buffer at
        its padded position; a batch of one lets ``generate`` prefill the rest, a larger batch prefills each
        row's uncached suffix separately first (rows hit different lengths), so that ``generate`` runs the
        prompts' last tokens and all decoding batched, exactly as on the bare model.
        """
        batch, width = input_ids.shape
        if attention_mask is None:
            pad_id = gc.pad_token_id
            if pad_id is not None and bool((input_ids == pad_id).any()):
                return self._run_uncached(
                    "pad tokens in input_ids without attention_mask", {"input_ids": input_ids, **kwargs}
                )
            pads = [0] * batch
        else:
            pads = (width - attention_mask.to(torch.long).sum(dim=1)).tolist()
        rows = [input_ids[r, pads[r] :] for r in range(batch)]
        copies = int(gc.num_return_sequences or 1)  # sampling n per prompt: generate's own expansion, done here
        if copies > 1:
            input_ids = input_ids.repeat_interleave(copies, dim=0)
            if attention_mask is not None:
                attention_mask = attention_mask.repeat_interleave(copies, dim=0)
            kwargs = {**kwargs, "num_return_sequences": 1}
        handles = []
        epoch = self._epoch
        try:
            matches, live, tiered = [], [], []
            for row, namespace in zip(rows, namespaces):
                ids = as_token_array(row.detach().cpu())
                matches.append(self.cache.match(ids, namespace))
                handles.append(matches[-1].handle)
                tiered.append(0)
                if self.tier is not None:
                    matches[-1], tiered[-1] = self._tier_extend(matches[-1], ids, namespace)
                live.append(self._causes.request(ids, namespace, matches[-1].cached_tokens))
            ready = matches[0].cached_tokens if batch == 1 else width - 1
            bufs = self._pool.buffers(batch * copies, width + self._new_tokens_bound(gc, kwargs, width))
            for r, m in enumerate(matches):
                self._prepare_row(bufs, r * copies, pads[r], rows[r], m, ready)
                for kv in bufs if copies > 1 else ():
                    if kv is not None:
                        for side in kv:
                            side[r * copies + 1 : (r + 1) * copies, :, :ready] = side[r * copies, :, :ready]
            cache = hf_cache.buffer_cache(self.model, bufs, ready)
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, **{self._cache_kwarg: cache}, **kwargs)
            if not isinstance(out, torch.Tensor) and any(v is cache for v in out.values()):
                self._pool.surrender_buffers()  # the caller now holds the cache, which lives in them
            inserted = [0] * batch
            if self._epoch == epoch:  # else a callback reset the cache: these handles and blocks are gone
                inserted = self._commit_or_drop(out, cache, matches, pads, width, gc, live)
            self.last_request_stats = tuple(
                RowStats(len(row), m.cached_tokens, n + t, *lr.causes[:6], *lr.causes[7:], lr.fork, t * self.block_size)
                for row, m, n, lr, t in zip(rows, matches, inserted, live, tiered)
            )
            return out
        finally:
            if self._epoch == epoch:
                self._release_all(handles)

    def _commit_or_drop(self, out, cache, matches, pads: list[int], width: int, gc, live=None) -> list[int]:
        """``_commit_outputs``; if that fails, drop the cache (blocks may be in the tree without their KV: never
        serve them) and take this call's blocks out of the counters again, then re-raise."""
        stats = self.cache.stats
        counted = stats.blocks_inserted, stats.blocks_not_cached
        try:
            return self._commit_outputs(out, cache, matches, pads, width, gc, live)
        except BaseException:
            self._drop_cache()
            stats.blocks_inserted, stats.blocks_not_cached = counted
            raise

    def _release_all(self, handles: list) -> None:
        """Release every handle. An exception (a Ctrl-C) inside one release does not stop the others: that handle
        is retried once, the rest are released, then the first exception is raised."""
        error: BaseException | None = None
        for h in handles:
            for _attempt in range(2):
                try:
                    if not h.released:
                        self.cache.release(h)
                    break
                except BaseException as exc:
                    error = error or exc
        if error is not None:
            raise error

    def _prepare_row(self, bufs, r: int, pad: int, tokens: torch.Tensor, m, ready: int) -> None:
        """Fill row ``r`` of the batch buffers up to padded position ``ready``: zeros over the padding, the
        cached prefix gathered from the pool, then (batches) the uncached suffix computed by the model."""
        cached = m.cached_tokens
        for kv in bufs:
            if kv is not None:
                kv[0][r, :, :pad].zero_()  # masked out, but must be finite
                kv[1][r, :, :pad].zero_()
        if cached:
            self._pool.gather_into(
                m.block_ids,
                [
                    None if kv is None else (kv[0][r, :, pad : pad + cached], kv[1][r, :, pad : pad + cached])
                    for kv in bufs
                ],
            )
        todo = ready - pad - cached
        if todo <= 0:
            return
        row_bufs = [None if kv is None else (kv[0][r : r + 1, :, pad:], kv[1][r : r + 1, :, pad:]) for kv in bufs]
        row_cache = hf_cache.buffer_cache(self.model, row_bufs, cached)
        ids = tokens[cached : cached + todo].unsqueeze(0)
        with torch.no_grad():
            self.model(
                input_ids=ids,
                attention_mask=torch.ones((1, cached + todo), dtype=torch.long, device=ids.device),
                use_cache=True,
                **{self._cache_kwarg: row_cache},
                **self._logits_kwargs,
            )
        hf_cache.settle(row_cache, row_bufs, cached + todo)

    def _commit_outputs(
        self, out, cache, matches, pads: list[int], width: int, gc, live: list[LiveRequest] | None = None
    ) -> list[int]:
        """Commit every output row's full blocks (prompt + generated up to its first EOS) and scatter their
        K/V; returns the blocks inserted per input row. ``live``: each input row's miss-cause record, told what
        was committed."""
        seqs = out if isinstance(out, torch.Tensor) else out.sequences
        kv_len = hf_cache.seq_length(cache)  # the last generated token has no KV yet
        per_input = seqs.shape[0] // len(matches)  # num_return_sequences rows follow their input row
        eos = _eos_ids(gc, seqs.device)
        inserted = [0] * len(matches)
        for i in range(seqs.shape[0]):
            r = i // per_input
            stop = kv_len
            if eos is not None and kv_len > width:
                hit = torch.isin(seqs[i, width:kv_len], eos).nonzero()
                if len(hit):
                    stop = width + int(hit[0]) + 1
            committed = as_token_array(seqs[i, pads[r] : stop].detach().cpu())
            res = self.cache.commit(matches[r].handle, committed)
            if live is not None:
                self._causes.committed(live[r], committed, res)
            if res.block_ids:
                start = pads[r] + res.first_block * self.block_size
                end = start + len(res.block_ids) * self.block_size
                self._pool.scatter(res.block_ids, hf_cache.read_kv(cache, start, end, row=i))
                inserted[r] += len(res.block_ids)
            if self.tier is not None:  # also when nothing is new: the path's recency moves
                self._tier_save(matches[r].handle.namespace, committed, res.first_block, res.block_ids)
        return inserted

    def _tier_save(self, namespace: str, tokens: Any, first: int, block_ids: Sequence[int]) -> None:
        """Write through: hand the path the pool holds for ``tokens`` to the tier, its blocks ``first..`` just
        committed to pool ``block_ids`` (``prefixcache.core.tier``'s step 4)."""
        assert self.tier is not None
        bs, stop = self.block_size, first + len(block_ids)
        keys: list[bytes] = []
        extend_keys(keys, tokens, namespace, bs, self.cache.config.hash_seed, stop)
        self.tier.save(self._pool, keys, first, block_tokens(tokens, bs, first, stop), block_ids)

    def _new_tokens_bound(self, gc, kwargs: dict, prompt_len: int) -> int:
        """Tokens generate may append after the prompt, as far as worth reserving room for."""
        if gc.max_new_tokens is not None:
            new = gc.max_new_tokens
        else:
            new = (kwargs.get("max_length") or gc.max_length or 0) - prompt_len
        limit = getattr(self.model.config, "max_position_embeddings", None) or 8192
        return max(0, min(int(new), int(limit)))


def _positive_int(name: str, value: Any) -> int:
    """``value`` (a Python or numpy integer) as an int > 0; TypeError / ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"PrefixCachedModel: {name} must be an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if value <= 0:
        raise ValueError(f"PrefixCachedModel: {name} must be > 0, got {value}")
    return value


def _history_bound(given: int | str | None, pool_tokens: int) -> int | None:
    """The miss-cause history's bound in tokens (None: unbounded) from ``miss_history_tokens``."""
    if given is None:
        return HISTORY_FACTOR * pool_tokens
    return None if given == "unlimited" else int(given)


def _fingerprint(model) -> str:
    """A short hash of the model's class, config and dtype (caches of different models never mix)."""
    try:
        cfg = model.config.to_json_string(use_diff=False)
    except Exception:  # pragma: no cover
        cfg = repr(model.config)
    return xxhash.xxh3_64_hexdigest(f"{type(model).__name__}|{model.dtype}|{cfg}".encode())


def _row_namespaces(namespace: Any, input_ids: Any) -> list[str]:
    """One namespace per batch row: a str applies to every row, a sequence must give one str per row."""
    rows = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2 else 1
    if isinstance(namespace, str):
        return [namespace] * rows
    if not isinstance(namespace, Sequence):
        raise TypeError(f"namespace must be a str or a sequence of str, got {type(namespace).__name__}")
    spaces = list(namespace)
    for i, ns in enumerate(spaces):
        if not isinstance(ns, str):
            raise TypeError(f"namespace[{i}] must be a str, got {type(ns).__name__}")
    if len(spaces) != rows:
        raise ValueError(f"namespace gives {len(spaces)} namespaces for {rows} batch rows; give one per row")
    return spaces


def _eos_ids(gc, device) -> torch.Tensor | None:
    """The generation config's EOS ids as a tensor on ``device``, or None."""
    eos = gc.eos_token_id
    if eos is None:
        return None
    eos = torch.as_tensor(eos).flatten().to(device)
    return eos if eos.numel() else None
