"""PrefixCachedModel: a drop-in wrapper whose ``generate`` serves prompt prefixes from a KV block cache.

A transformers-compatible facade over an ``engine.runtime.ModelRuntime`` (the pool, the tree, the tier, the
weights watch, the lock and the engine): ``generate`` checks what it was asked (``engine.generate_checks``) and
runs the contiguous cached path (``engine.contiguous``) or, for what cannot be served exactly from a cached
prefix, the bare model's ``generate`` with an ``UncachedCallWarning``. ``generate_batch`` and ``score`` run on the
continuous-batching engine (``engine.batching.offline``). A cache passed by the caller (``cache=`` /
``past_key_values=``) is refused.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from engine import contiguous, explain
from engine.batching import offline
from engine.batching.engine import Engine
from engine.batching.scheduler import SchedulerConfig
from engine.contiguous import RowStats
from engine.errors import (
    EngineFallbackWarning,
    StaleCacheWarning,
    UncachedCallWarning,
    UnsupportedModelError,
    UnverifiedCacheWarning,
)
from engine.explain import Explanation
from engine.generate_checks import merged_config, row_hints, row_names, uncached_reason, unmasked_pads_reason
from engine.kv_pool import KVPool
from engine.media.encoder_cache import DEFAULT_MAX_ENCODER_CACHE_BYTES
from engine.media.inputs import ends_in_image, prepare
from engine.media.requests import media_prompt
from engine.models import context_length
from engine.runtime import (
    DEFAULT_MAX_CACHED_TOKENS,
    HISTORY_FACTOR,
    ModelRuntime,
    RuntimeConfig,
    eos_ids,
)
from engine.tier import KVTier
from prefixcache import PrefixCache
from prefixcache.core.checks import check_int
from prefixcache.core.hashing import BlockHasher
from prefixcache.core.windows import DEFAULT_WINDOW_SHARE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["DEFAULT_MAX_CACHED_TOKENS", "HISTORY_FACTOR", "EngineFallbackWarning", "Explanation", "PrefixCachedModel"]
__all__ += ["RowStats", "StaleCacheWarning", "UncachedCallWarning", "UnsupportedModelError", "UnverifiedCacheWarning"]


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

    Images (docs/multimodal.md): on the families ``engine.media.families`` lists, ``generate`` takes what the
    processor gives (``pixel_values``, ``image_grid_thw``, ...); each image's content is in the keys of the blocks
    its placeholders fall in, so another image behind the same placeholder ids never hits, and the vision tower's
    output is kept by content id up to ``max_encoder_cache_bytes``. Other families run such calls uncached.

    Sliding-window and chunked-attention layers (docs/sliding.md): ``sliding_windows`` (on by default) keeps their
    K/V only within the windows of the points a match can end at (and of other blocks while slots are spare), in
    ``window_share`` slots per cached block, so the same memory holds several times the cached prefix on Gemma-,
    gpt-oss- or Olmo-shaped models; a match is served only as deep as every group is complete, and the engine's
    running requests hold slots only within their windows.
    """

    def __init__(
        self,
        model: Any,
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
        fused_ops: bool = True,
        disk_cache: str | os.PathLike[str] | None = None,
        max_disk_bytes: int | str | None = None,
        shared_cache: str | None = None,
        check_memory: bool = True,
        miss_history_tokens: int | str | None = None,
        max_cached_states: int | None = None,
        snapshot_interval: int = 0,
        max_encoder_cache_bytes: int = DEFAULT_MAX_ENCODER_CACHE_BYTES,
        sliding_windows: bool = True,
        window_share: float = DEFAULT_WINDOW_SHARE,
    ) -> None:
        config = RuntimeConfig(
            max_cached_tokens=max_cached_tokens,
            max_cached_bytes=max_cached_bytes,
            block_size=block_size,
            eviction=eviction,
            hash_seed=hash_seed,
            verify_tokens=verify_tokens,
            engine=engine_config or SchedulerConfig(),
            fast_linear=fast_linear,
            fused_ops=fused_ops,
            disk_cache=disk_cache,
            max_disk_bytes=max_disk_bytes,
            shared_cache=shared_cache,
            check_memory=check_memory,
            miss_history_tokens=miss_history_tokens,
            max_cached_states=max_cached_states,
            snapshot_interval=snapshot_interval,
            max_encoder_cache_bytes=max_encoder_cache_bytes,
            sliding_windows=sliding_windows,
            window_share=window_share,
        )
        self._init(ModelRuntime(model, config, on_unsupported=on_unsupported, hasher=hasher))

    def _init(self, runtime: ModelRuntime) -> None:
        object.__setattr__(self, "runtime", runtime)
        self._active = 0  # cached generate calls in progress (a nested one, from a callback, runs uncached)
        self.last_request_stats: tuple[RowStats, ...] = ()
        self.last_uncached_reason: str | None = None
        self.uncached_calls = 0

    @classmethod
    def over(cls, runtime: ModelRuntime) -> PrefixCachedModel:
        """The facade over an existing runtime (e.g. a server's, to call ``generate`` on its cache)."""
        pcm = cls.__new__(cls)
        pcm._init(runtime)
        return pcm

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, *, dtype: Any = None, device: Any = None, seed: int = 0, **kwargs: Any
    ) -> PrefixCachedModel:
        """Load a preset or a local HF model dir (see ``engine.models.load_model``) and wrap it; the tokenizer is
        kept as ``.tokenizer``."""
        from engine.models import load_model

        model, tokenizer = load_model(name_or_path, dtype=dtype, device=device, seed=seed)
        pcm = cls(model, **kwargs)
        pcm.tokenizer = tokenizer
        return pcm

    # ---- what the runtime owns ---------------------------------------------------------------------------
    runtime: ModelRuntime

    @property
    def model(self) -> Any:
        return self.runtime.model

    @property
    def cache(self) -> PrefixCache:
        return self.runtime.cache

    @property
    def pool(self) -> KVPool | None:
        return self.runtime.pool

    @property
    def tier(self) -> KVTier | None:
        return self.runtime.tier

    @property
    def fingerprint(self) -> str:
        return self.runtime.fingerprint

    @property
    def block_size(self) -> int:
        return self.runtime.block_size

    @property
    def unsupported_reason(self) -> str | None:
        return self.runtime.unsupported_reason

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self.runtime.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.runtime.tokenizer = tokenizer

    @property
    def lock(self) -> threading.RLock:
        """The lock every cached call holds (a serving loop holds it around each engine step)."""
        return self.runtime.lock

    @property
    def engine_unsupported_reason(self) -> str | None:
        """Why ``engine()`` is None (None when it is not, or was not asked for yet)."""
        return self.runtime.engine_unsupported_reason

    def engine(self) -> Engine | None:
        """The continuous-batching engine over this wrapper's cache and pool (made on first use; see
        ``engine.batching``), or None when the model cannot run on it (``engine_unsupported_reason`` says why).
        Hold the wrapper's lock (``with pcm.lock:``) around anything that steps it."""
        return self.runtime.engine()

    # ---- the wrapped module --------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        runtime = self.__dict__.get("runtime")
        if runtime is None:
            raise AttributeError(name)
        return getattr(runtime.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A plain (uncached) forward of the wrapped model."""
        return self.model(*args, **kwargs)

    def to(self, *args: Any, **kwargs: Any) -> PrefixCachedModel:
        """Move/cast the wrapped model (like ``nn.Module.to``) and return the WRAPPER; the pool follows on the
        next call (cached blocks are dropped then)."""
        self.model.to(*args, **kwargs)
        return self

    def cuda(self, *args: Any, **kwargs: Any) -> PrefixCachedModel:
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

    def __repr__(self) -> str:
        return (
            f"PrefixCachedModel({type(self.model).__name__}, blocks={self.cache.num_blocks}, "
            f"block_size={self.block_size})"
        )

    # ---- cache management ----------------------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Drop every cached block and zero the counters (the pool memory stays allocated). From inside a
        running ``generate`` (a callback), that call still returns its output but caches nothing."""
        with self.lock:
            self.runtime.drop(keep_stats=False)
            self.uncached_calls = 0
            self.last_request_stats = ()

    def close(self) -> None:
        """Finish the tier's queued writes and close its store (the pool stays usable; the tier is gone)."""
        self.runtime.close()

    def cache_stats(self) -> dict[str, Any]:
        """Counters since construction or ``reset_cache``, plus pool occupancy (``ModelRuntime.cache_stats``:
        ``cached_tokens`` counts the pool's and the tier's hits, ``pool_cached_tokens`` / ``tier_cached_tokens``
        split them). Changes nothing."""
        with self.lock:
            return {**self.runtime.cache_stats(), "uncached_calls": self.uncached_calls}

    def probe(self, tokens: Any, namespace: str = "default") -> int:
        """Leading tokens of ``tokens`` (1-D ids) a ``generate`` in ``namespace`` would serve from cache now (0
        when the model's weights, dtype or device changed since: that call would drop the cache first).

        Changes nothing."""
        return explain.probe(self.runtime, tokens, namespace)

    def explain(self, input_ids: Any, namespace: str = "default", *, context: int = 16) -> Explanation:
        """Why ``input_ids`` (one prompt: 1-D ids, or a batch of one) would miss in ``namespace`` now: the
        longest cached prefix, where it departs from the nearest cached path and what differs there (up to
        ``context`` tokens each side), and its uncached tokens by cause. Changes nothing."""
        return explain.explain(self.runtime, input_ids, namespace, context=context)

    # ---- generate --------------------------------------------------------------------------------------
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        namespace: str | Sequence[str] = "default",
        snapshot_hints: Sequence[int] | Sequence[Sequence[int]] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``model.generate`` with prefix caching; same arguments, same return value.

        ``namespace`` (tenant, adapter, ...) separates caches: requests never share blocks across namespaces.
        A sequence gives one namespace per batch row (a server batch mixes tenants). ``snapshot_hints`` (hybrid
        models; ignored otherwise): token positions of the prompt (after its padding; one sequence per row, or one
        for every row) where prompts that share its beginning will part, e.g. the end of a system prompt: the cache
        keeps the recurrent state there, so the next such prompt is served up to it (docs/hybrid.md).
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
        names = row_names(namespace, input_ids)
        rt = self.runtime
        with rt.lock:
            gc = None
            reason = "nested call (from inside another generate of this wrapper)" if self._active else None
            if reason is None and rt.unsupported_reason is not None:
                reason = f"model not cacheable: {rt.unsupported_reason}"
            fam = rt.image_family or rt.media_family  # images off after a failed check: its per-token kwargs only
            keyed = () if fam is None else (*fam.inputs, *fam.optional) if rt.image_family else fam.optional
            why = rt.media_reason or ""
            reason = reason or uncached_reason(input_ids, attention_mask, kwargs, keyed, why)
            if reason is None:
                gc, reason = merged_config(self.model, kwargs)
            if reason is None:
                assert input_ids is not None  # uncached_reason saw to it
                reason = unmasked_pads_reason(input_ids, attention_mask, gc)
            if reason is not None:
                return self._run_uncached(reason, input_ids, attention_mask, kwargs)
            assert input_ids is not None
            self.last_uncached_reason = None
            rt.follow()
            if rt.unsupported_reason is not None:  # a dtype or device change failed its check at load just now
                return self._run_uncached(
                    f"model not cacheable: {rt.unsupported_reason}", input_ids, attention_mask, kwargs
                )
            media, rest = prepare(self.model, fam, input_ids, attention_mask, kwargs, rt.block_size, rt.encoder_cache)
            if media is not None and ends_in_image(media, input_ids.shape[1]):
                return self._run_uncached("a prompt ends with an image placeholder", input_ids, attention_mask, kwargs)
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            if media is not None and not rt.check_images(input_ids, mask, media):
                return self._run_uncached(f"images: {rt.media_reason}", input_ids, attention_mask, kwargs)
            self._active += 1
            try:
                hints = row_hints(snapshot_hints, len(names))
                out, self.last_request_stats = contiguous.generate(
                    rt, input_ids, attention_mask, gc, names, rest, hints, media
                )
                return out
            finally:
                self._active -= 1

    def _run_uncached(self, reason: str, input_ids: Any, attention_mask: Any, kwargs: dict[str, Any]) -> Any:
        """The bare model's generate, counted in ``uncached_calls``; warns once per distinct reason."""
        self.uncached_calls += 1
        self.last_uncached_reason = reason
        self.last_request_stats = ()
        self.runtime.warn_once(
            f"PrefixCachedModel: running this call without the prefix cache: {reason}", UncachedCallWarning, 5
        )
        given = {"input_ids": input_ids, "attention_mask": attention_mask}
        return self.model.generate(**{k: v for k, v in given.items() if v is not None}, **kwargs)

    # ---- the paged engine: batches -------------------------------------------------------------------
    def generate_batch(
        self,
        inputs: Sequence[Any],
        generation_config: Any = None,
        *,
        namespace: str = "default",
        progress_bar: bool = False,
        seed: int | None = None,
        **kwargs: Any,
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
        prompts, media = [], {}
        for i, p in enumerate(inputs):
            if isinstance(p, Mapping):  # a prompt with images: a processor's output for one prompt
                ids, media[i] = media_prompt(p, f"inputs[{i}]")
                prompts.append(ids)
            else:
                prompts.append(offline.token_list(p, f"inputs[{i}]"))
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"inputs[{i}] is empty: a prompt needs at least one token")
        base = generation_config or self.model.generation_config
        copies = int(kwargs.pop("num_return_sequences", None) or getattr(base, "num_return_sequences", 1) or 1)
        params = [offline.sampling_params(base, dict(kwargs), len(p)) for p in prompts]
        if copies > 1 and params and params[0].greedy:
            raise ValueError("num_return_sequences > 1 needs sampling (do_sample=True): greedy copies are identical")
        with self.lock:
            engine = self.runtime.engine()
            if engine is None:
                return self._generate_batch_fallback(prompts, base, kwargs, namespace, copies, media)
            self.last_request_stats = ()
            text = [i for i in range(len(prompts)) if i not in media]
            got = offline.generate_batch(
                engine,
                [prompts[i] for i in text],
                [params[i] for i in text],
                self.runtime.namespace(namespace),
                copies,
                seed=seed,
                progress_bar=progress_bar,
            )
            out = offline.renumbered(got, text, copies)
            if media:  # the engine takes no images: those prompts go through generate, one at a time
                out.update(self._generate_batch_fallback(prompts, base, kwargs, namespace, copies, media, only=media))
            return {rid: out[rid] for rid in offline.request_ids(len(prompts), copies)}

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
            limit = check_int(limit, "PrefixCachedModel: max_length", minimum=1)
        pairs = list(requests)
        media = {
            i: p
            for i, p in enumerate(pairs)
            if isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], Mapping)
        }
        if media:  # contexts with images: scored one by one on the contiguous path, beside the others
            return self._score_with_images(
                pairs, media, namespace, token_logprobs, limit, commit_continuations, reorder
            )
        with self.lock:
            reqs, cut = offline.score_requests(
                pairs, self.runtime.namespace(namespace), max_length=limit, commit=commit_continuations, top=0
            )
            engine = self.runtime.engine()
            if engine is None:
                self._warn_fallback(f"score: {self.engine_unsupported_reason}; scoring with plain uncached forwards")
                return offline.score_uncached(self.model, reqs, cut, token_logprobs)
            self.last_request_stats = ()
            return offline.score(engine, reqs, cut, token_logprobs, reorder=reorder, progress_bar=progress_bar)

    def _score_with_images(
        self,
        pairs: list[Any],
        media: dict[int, Any],
        namespace: str,
        token_logprobs: bool,
        limit: int | None,
        commit_continuations: bool,
        reorder: bool,
    ) -> list[offline.ScoreResult]:
        """``score`` of ``pairs`` whose contexts ``media`` (by index) hold images: those run one at a time on the
        contiguous path (exact; the model's uncached forward where its images cannot be keyed), the rest as
        ``score`` runs them."""
        text = [i for i in range(len(pairs)) if i not in media]
        out: dict[int, offline.ScoreResult] = {}
        if text:
            got = self.score(
                [pairs[i] for i in text],
                namespace=namespace,
                token_logprobs=token_logprobs,
                max_length=limit,
                commit_continuations=commit_continuations,
                reorder=reorder,
            )
            out.update(zip(text, got))
        rt = self.runtime
        for i, (ctx, cont) in media.items():
            ctx_ids, images = media_prompt(ctx, f"requests[{i}] context")
            cont_ids = offline.token_list(cont, f"requests[{i}] continuation")
            if not cont_ids:
                raise ValueError(f"requests[{i}] has an empty continuation: nothing to score")
            full = ctx_ids + cont_ids
            if limit is not None and len(full) > limit + 1:
                raise ValueError(
                    f"requests[{i}]: {len(full)} tokens with images, longer than max_length={limit} + 1 (a prompt "
                    "with images is not cut from the left)"
                )
            ids = torch.tensor([full], dtype=torch.long, device=self.model.device)
            images = {k: v.to(self.model.device) for k, v in images.items()}
            for key in ("mm_token_type_ids", "token_type_ids"):  # per token: the continuation's are 0
                if key in images:
                    pad = torch.zeros((1, len(cont_ids)), dtype=images[key].dtype, device=ids.device)
                    images[key] = torch.cat([images[key].reshape(1, -1), pad], dim=1)
            with self.lock:
                rt.follow()
                fam = rt.image_family
                call = None
                if rt.pool is not None and fam is not None and set(images) <= {*fam.inputs, *fam.optional}:
                    call, _ = prepare(self.model, fam, ids, None, images, rt.block_size, rt.encoder_cache)
                if call is not None and rt.hybrid is None and not rt.check_images(ids, torch.ones_like(ids), call):
                    call = None
                if call is None or rt.hybrid is not None:
                    why = rt.unsupported_reason or rt.media_reason or "images on a hybrid model are scored uncached"
                    rt.warn_once(f"PrefixCachedModel: scoring images without the cache: {why}", UncachedCallWarning, 5)
                    with torch.inference_mode():
                        logits = self.model(input_ids=ids, **images).logits[0, len(ctx_ids) - 1 : -1]
                    logp, cached = torch.log_softmax(logits.float(), dim=-1), 0
                else:
                    commit = len(full) if commit_continuations else len(ctx_ids)
                    logp, cached = contiguous.score(rt, ids[0], namespace, call, len(ctx_ids), commit)
            target = torch.tensor(cont_ids, device=logp.device)
            lp = logp.gather(1, target[:, None])[:, 0]
            greedy = bool((logp.argmax(dim=-1) == target).all())
            out[i] = offline.ScoreResult(
                float(lp.sum()), greedy, tuple(lp.tolist()) if token_logprobs else None, cached, 0
            )
        return [out[i] for i in range(len(pairs))]

    def _generate_batch_fallback(
        self,
        prompts: list[list[int]],
        base: Any,
        kwargs: dict[str, Any],
        namespace: str,
        copies: int,
        media: Mapping[int, dict[str, Any]],
        only: Collection[int] | None = None,
    ) -> dict[str, offline.BatchOutput]:
        """``generate_batch`` through ``generate`` (prompt by prompt; ``media[i]``: prompt i's images) for a model
        the engine cannot run, or for the prompts ``only`` (those with images)."""
        if only is None:
            why = f"generate_batch: {self.engine_unsupported_reason}; running each prompt through generate()"
            self._warn_fallback(why)
        out = {}
        eos = eos_ids(base)
        for i, p in enumerate(prompts):
            if only is not None and i not in only:
                continue
            ids = torch.tensor([p], dtype=torch.long, device=self.model.device)
            images = {k: v.to(self.model.device) for k, v in media.get(i, {}).items()}
            for j in range(copies):
                rid = f"req_{i}" if copies == 1 else f"req_{i}_{j}"
                seq = self.generate(ids, generation_config=base, namespace=namespace, **images, **kwargs)
                seq = seq if isinstance(seq, torch.Tensor) else seq.sequences
                cached = self.last_request_stats[0].cached_tokens if self.last_request_stats else 0
                gen = seq[0, len(p) :].tolist()
                stop = bool(gen) and gen[-1] in eos
                out[rid] = offline.BatchOutput(rid, p, gen, "stop" if stop else "length", cached)
        return out

    def _warn_fallback(self, reason: str) -> None:
        self.runtime.warn_once(f"PrefixCachedModel: {reason}", EngineFallbackWarning, 5)
