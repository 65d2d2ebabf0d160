"""PrefixCachedModel: a drop-in wrapper whose ``generate`` serves prompt prefixes from a KV block cache.

One row's life: tokens -> ``PrefixCache.match`` (namespace = model fingerprint + the caller's namespace) ->
gather the matched blocks from the ``KVPool`` into a FRESH cache -> ``model.generate`` on the full ids with that
cache (only the unmatched suffix is prefilled) -> ``commit`` the full blocks of prompt + generated tokens and
scatter their K/V into the pool -> ``release`` (always, in a ``finally``).

Batches: every row is run on its own (left padding stripped, each row served from its own cached prefix) and the
outputs are re-assembled as batched ``generate`` lays them out: the row's left padding, then its tokens, then
``pad_token_id`` after a row finished. ``scores``/``logits`` of a row at steps after it finished (batched
``generate`` computes throwaway values there) are ``-inf`` except 0 at ``pad_token_id``.

Anything that cannot be served exactly from a cached prefix runs uncached (plain ``model.generate``): beam
search and other non greedy/sampling modes, ``use_cache=False``, ``inputs_embeds``, ``output_attentions`` /
``output_hidden_states`` (their prompt step would cover only the suffix), static/quantized cache
implementations, right padding, missing ``attention_mask`` with pad tokens in the ids, non-integer or empty
ids. A cache passed by the caller (``cache=`` / ``past_key_values=``) is refused.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, fields
from typing import Any

import torch
import xxhash

from engine import hf_cache
from engine.kv_pool import KVPool, bytes_per_token
from prefixcache import CacheConfig, PrefixCache

DEFAULT_MAX_CACHED_TOKENS = 32_768
_ALLOWED_MODES = ("greedy_search", "sample")
_BATCH_SHAPED_KWARGS = ("position_ids", "token_type_ids", "cache_position", "decoder_input_ids")


@dataclass(frozen=True)
class RowStats:
    """One batch row of the last ``generate`` call: prompt length, tokens served from cache, blocks added."""

    prompt_tokens: int
    cached_tokens: int
    inserted_blocks: int


class UnsupportedModelError(ValueError):
    """The model's cache cannot be served from a prefix cache (recurrent state, encoder-decoder, ...)."""


class PrefixCachedModel:
    """Wraps a causal LM; ``generate`` returns what ``model.generate`` returns, reusing cached prefix KV.

    Size the pool by ``max_cached_tokens`` or ``max_cached_bytes`` (one of them; default 32,768 tokens).
    ``on_unsupported``: "error" (default) raises ``UnsupportedModelError`` for models that cannot be cached
    exactly; "passthrough" wraps them anyway and runs every call uncached. Thread-safe (one lock).
    Attributes not defined here fall through to the wrapped model.
    """

    def __init__(
        self, model, *, max_cached_tokens: int | None = None, max_cached_bytes: int | None = None,
        block_size: int = 16, eviction: str = "lru", hash_seed: int = 0, verify_tokens: bool = True,
        on_unsupported: str = "error",
    ) -> None:
        if on_unsupported not in ("error", "passthrough"):
            raise ValueError(f"on_unsupported must be 'error' or 'passthrough', got {on_unsupported!r}")
        if max_cached_tokens is not None and max_cached_bytes is not None:
            raise ValueError("give max_cached_tokens or max_cached_bytes, not both")
        object.__setattr__(self, "model", model)
        self._lock = threading.RLock()
        self.block_size = block_size
        self.last_request_stats: tuple[RowStats, ...] = ()
        self.last_uncached_reason: str | None = None
        self.uncached_calls = 0
        self.unsupported_reason = hf_cache.unsupported_reason(model)
        if self.unsupported_reason is not None and on_unsupported == "error":
            raise UnsupportedModelError(
                f"PrefixCachedModel cannot cache {type(model).__name__}: {self.unsupported_reason}. "
                "Pass on_unsupported='passthrough' to run it uncached."
            )
        self.fingerprint = _fingerprint(model)
        self._cache_kwarg = hf_cache.cache_kwarg(model)
        if self.unsupported_reason is not None:  # passthrough: a 1-block core keeps the API usable
            self.pool = None
            self.cache = PrefixCache(CacheConfig(num_blocks=1, block_size=block_size, eviction=eviction))
            return
        specs = hf_cache.probe_specs(model)
        per_block = bytes_per_token(specs, model.dtype) * block_size
        if max_cached_bytes is not None:
            num_blocks = int(max_cached_bytes) // per_block
            what = f"max_cached_bytes={max_cached_bytes} ({per_block} bytes per block)"
        else:
            tokens = DEFAULT_MAX_CACHED_TOKENS if max_cached_tokens is None else int(max_cached_tokens)
            num_blocks = tokens // block_size
            what = f"max_cached_tokens={tokens} (block_size={block_size})"
        if num_blocks < 1:
            raise ValueError(f"{what} holds no block; raise it")
        self.cache = PrefixCache(CacheConfig(num_blocks=num_blocks, block_size=block_size, eviction=eviction,
                                             hash_seed=hash_seed, verify_tokens=verify_tokens))
        self.pool = KVPool(specs, num_blocks, block_size, dtype=model.dtype, device=model.device)

    # ---- construction helpers ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str, *, dtype: Any = None, device: Any = None, seed: int = 0,
                        **kwargs) -> "PrefixCachedModel":
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

    def __repr__(self) -> str:
        return (f"PrefixCachedModel({type(self.model).__name__}, blocks={self.cache.num_blocks}, "
                f"block_size={self.block_size})")

    # ---- cache management ----------------------------------------------------------------------------
    def reset_cache(self) -> None:
        """Drop every cached block and zero the counters (the pool memory stays allocated)."""
        with self._lock:
            self.cache.reset()
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
            return d

    def probe(self, tokens: Any, namespace: str = "default") -> int:
        """Leading tokens of ``tokens`` (1-D ids) a ``generate`` in ``namespace`` would serve from cache now.

        Changes nothing."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu()
        with self._lock:
            return self.cache.probe(tokens, f"{self.fingerprint}:{namespace}")

    # ---- generate ------------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, *,
                 namespace: str = "default", **kwargs) -> Any:
        """``model.generate`` with prefix caching; same arguments, same return value.

        ``namespace`` (tenant, adapter, ...) separates caches: requests never share blocks across namespaces.
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
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")
        with self._lock:
            gc = None
            reason = self._uncached_reason(input_ids, attention_mask, kwargs)
            if reason is None:
                gc, reason = self._merged_config(kwargs)
            self.last_uncached_reason = reason
            if reason is not None:
                self.uncached_calls += 1
                self.last_request_stats = ()
                if input_ids is not None:
                    kwargs["input_ids"] = input_ids
                if attention_mask is not None:
                    kwargs["attention_mask"] = attention_mask
                return self.model.generate(**kwargs)
            return self._generate_cached(input_ids, attention_mask, gc, f"{self.fingerprint}:{namespace}", kwargs)

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

    def _generate_cached(self, input_ids: torch.Tensor, attention_mask, gc, namespace: str, kwargs: dict):
        batch, width = input_ids.shape
        pads = [0] * batch
        if attention_mask is None:
            pad_id = gc.pad_token_id
            if pad_id is not None and bool((input_ids == pad_id).any()):
                self.uncached_calls += 1
                self.last_uncached_reason = "pad tokens in input_ids without attention_mask"
                self.last_request_stats = ()
                return self.model.generate(input_ids=input_ids, **kwargs)
        else:
            pads = (attention_mask.shape[1] - attention_mask.to(torch.long).sum(dim=1)).tolist()
        if batch == 1 and pads[0] == 0:  # one unpadded row: the model's own output, as is
            out, stats = self._run_row(input_ids[0], namespace, kwargs, gc)
            self.last_request_stats = (stats,)
            return out
        outs, stats = [], []
        for r in range(batch):
            row_kwargs = dict(kwargs)
            if pads[r]:  # lengths that count the padded prompt
                if gc.max_new_tokens is None and gc.max_length is not None:
                    row_kwargs["max_length"] = gc.max_length - pads[r]
                if gc.min_length:
                    row_kwargs["min_length"] = max(0, gc.min_length - pads[r])
            out, st = self._run_row(input_ids[r, pads[r]:], namespace, row_kwargs, gc)
            outs.append(out)
            stats.append(st)
        self.last_request_stats = tuple(stats)
        return _assemble(outs, input_ids, pads, _pad_id(gc))

    def _run_row(self, tokens: torch.Tensor, namespace: str, kwargs: dict, gc):
        """Generate for one unpadded row, serving its prefix from the cache; commit its new full blocks."""
        m = self.cache.match(tokens.detach().cpu(), namespace)
        alive = True
        try:
            prefix = None
            if m.block_ids:  # gather with room for the suffix and the output: they are appended in place
                reserve = len(tokens) - m.cached_tokens + self._new_tokens_bound(gc, kwargs, len(tokens))
                prefix = self.pool.gather(m.block_ids, reserve=reserve)
            cache = hf_cache.fresh_cache(self.model, prefix, append_in_place=True)
            ids = tokens.unsqueeze(0)
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                      **{self._cache_kwarg: cache}, **kwargs)
            if not isinstance(out, torch.Tensor) and any(v is cache for v in out.values()):
                self.pool.surrender_buffers()  # the caller now holds the cache, which lives in them
            seqs = out if isinstance(out, torch.Tensor) else out.sequences
            kv_len = hf_cache.seq_length(cache)  # the last generated token has no KV yet
            inserted = 0
            try:
                for j in range(seqs.shape[0]):  # num_return_sequences rows share the prompt blocks
                    r = self.cache.commit(m.handle, seqs[j, :kv_len].detach().cpu())
                    if r.block_ids:
                        start = r.first_block * self.block_size
                        stop = start + len(r.block_ids) * self.block_size
                        self.pool.scatter(r.block_ids, hf_cache.read_kv(cache, start, stop, row=j))
                        inserted += len(r.block_ids)
            except BaseException:
                # blocks may be in the tree without their KV: drop everything rather than ever serve them
                alive = False
                self.cache.reset()
                raise
            return out, RowStats(len(tokens), m.cached_tokens, inserted)
        finally:
            if alive:
                self.cache.release(m.handle)


    def _new_tokens_bound(self, gc, kwargs: dict, prompt_len: int) -> int:
        """Tokens generate may append after the prompt, as far as worth reserving room for."""
        if gc.max_new_tokens is not None:
            new = gc.max_new_tokens
        else:
            new = (kwargs.get("max_length") or gc.max_length or 0) - prompt_len
        limit = getattr(self.model.config, "max_position_embeddings", None) or 8192
        return max(0, min(int(new), int(limit)))


def _fingerprint(model) -> str:
    """A short hash of the model's class, config and dtype (caches of different models never mix)."""
    try:
        cfg = model.config.to_json_string(use_diff=False)
    except Exception:  # pragma: no cover
        cfg = repr(model.config)
    return xxhash.xxh3_64_hexdigest(f"{type(model).__name__}|{model.dtype}|{cfg}".encode())


def _pad_id(gc) -> int:
    if gc.pad_token_id is not None:
        return int(gc.pad_token_id)
    eos = gc.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if isinstance(eos, torch.Tensor):
        eos = eos.flatten()[0].item() if eos.numel() else None
    return int(eos) if eos is not None else 0


def _assemble(outs: list, input_ids: torch.Tensor, pads: list[int], pad_id: int):
    """Lay per-row outputs out as one batched ``generate`` call would."""
    width = input_ids.shape[1]
    seqs = [o if isinstance(o, torch.Tensor) else o.sequences for o in outs]
    gen = [s.shape[1] - (width - p) for s, p in zip(seqs, pads)]
    total = width + max(gen)
    rows = []
    for r, s in enumerate(seqs):
        n = s.shape[0]
        row = torch.full((n, total), pad_id, dtype=s.dtype, device=s.device)
        row[:, : pads[r]] = input_ids[r, : pads[r]]
        row[:, pads[r] : pads[r] + s.shape[1]] = s
        rows.append(row)
    sequences = torch.cat(rows, dim=0)
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return sequences
    values = {"sequences": sequences}
    for name in ("scores", "logits"):
        per_row = [getattr(o, name, None) for o in outs]
        if any(p is None for p in per_row):
            continue
        steps = []
        for t in range(max(gen)):
            parts = []
            for r, p in enumerate(per_row):
                if t < len(p):
                    parts.append(p[t])
                else:
                    like = p[0]
                    filler = torch.full_like(like, float("-inf"))
                    filler[:, pad_id] = 0.0
                    parts.append(filler)
            steps.append(torch.cat(parts, dim=0))
        values[name] = tuple(steps)
    kept = {f.name: getattr(first, f.name) for f in fields(first)}
    for name in kept:
        if name not in values:
            kept[name] = None  # caches, attentions: per-row objects that do not batch
    kept.update(values)
    return type(first)(**kept)
