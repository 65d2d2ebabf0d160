"""The only module that touches transformers' Cache classes.

* ``unsupported_reason(model)``: why a model's cache cannot be served from a prefix cache (recurrent state,
  encoder-decoder, non-attention layers), or ``None`` when it can.
* ``fresh_cache(model, prefix_kv)``: a NEW ``DynamicCache`` of full-length layers holding the prefix K/V.
  Sliding-window layers are replaced by full ``DynamicLayer``s: the attention masks are built from the model
  config's window and the token positions, so positions the window no longer reads may hold anything (the pool's
  window group gives zeros there: ``engine.kv_pool``).
* ``buffer_cache(model, buffers, length)``: the same over preallocated buffers with room to spare
  (``InPlaceLayer``s): new tokens are written into that room instead of concatenated (a full copy of the
  prefix at every forward).
* ``read_kv(cache, start, stop, row)``: per-layer K/V of token positions ``start:stop`` after a generate call.
* ``probe_specs(model)``: per-layer K/V shapes, found by a one-token forward.
* ``window_group(model)``: the layers that read only the last tokens (sliding-window or chunked attention) and
  their rule, or None: the pool keeps their K/V only where a match can still need it (``prefixcache.core.windows``).
* ``cache_kwarg(model)``: the keyword ``generate`` takes a cache under (``cache`` in transformers >= 5.x
  where ``past_key_values`` is deprecated, else ``past_key_values``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from engine.kv_pool import LayerKV, LayerSpec
from prefixcache.core.windows import WindowRule

try:  # shared-KV / attention-free placeholder layers (transformers >= 5.x)
    from transformers.cache_utils import DummyLayer
except ImportError:  # pragma: no cover - older transformers
    DummyLayer = ()  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import CacheLayerMixin

    CacheLayer = CacheLayerMixin | LinearAttentionCacheLayerMixin | DummyLayer  # what ``Cache.layers`` holds

# model types whose recurrent state lives outside transformers' DynamicCache layers (their own cache classes)
OWN_STATE_MODEL_TYPES = frozenset({"rwkv", "xlstm", "minimax", "mamba_ssm"})


def cache_kwarg(model: PreTrainedModel) -> str:
    """Name of the keyword under which ``model.generate`` takes a ready cache."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def last_logits_only(model: PreTrainedModel) -> dict[str, Any]:
    """Keyword arguments that make a forward compute logits for the last position only, if it can."""
    params = inspect.signature(type(model).forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot be prefix-cached exactly, or None. Changes nothing."""
    config = model.config
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        return (
            f"{type(model).__name__} (model_type={model_type!r}) is an encoder-decoder model: its decoder cache "
            "depends on the encoder input, so a decoder-token prefix cannot be reused"
        )
    if model_type in OWN_STATE_MODEL_TYPES:
        return (
            f"{type(model).__name__} (model_type={model_type!r}) keeps its recurrent state in a cache class of its "
            "own, which prefixcache cannot snapshot"
        )
    if not hasattr(model, "generate") or not getattr(model, "can_generate", lambda: True)():
        return f"{type(model).__name__} cannot generate"
    try:
        template = DynamicCache(config=config.get_text_config(decoder=True))
    except Exception as exc:  # pragma: no cover - exotic configs
        return f"cannot build a DynamicCache for {type(model).__name__}: {exc}"
    recurrent = attention = 0
    for i, layer in enumerate(template.layers):
        kind = type(layer).__name__
        if kind == "DynamicIndexedLayer":
            return f"{type(model).__name__} uses indexed (sparse) attention caches, which are not plain KV"
        if isinstance(layer, LinearAttentionCacheLayerMixin) and isinstance(layer, DynamicSlidingWindowLayer):
            return (
                f"{type(model).__name__} layer {i} uses {kind} (a recurrent state and a sliding window in one layer), "
                "which prefixcache does not restore"
            )
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            recurrent += 1
            attention += isinstance(layer, DynamicLayer)  # recurrent and attention in one layer (Falcon-H1)
        elif isinstance(layer, DynamicLayer):
            attention += 1
        elif not isinstance(layer, DummyLayer) or getattr(layer, "is_linear", False):
            return (
                f"{type(model).__name__} layer {i} uses {kind}, neither attention KV nor a recurrent state "
                "prefixcache can restore"
            )
    if recurrent and not attention:
        return (
            f"{type(model).__name__} (model_type={model_type!r}) has recurrent layers only: transformers' cache "
            "cannot hold a prefix of it (no attention layer to count its length)"
        )
    if getattr(model, "_is_stateful", False) and not recurrent:
        return (
            f"{type(model).__name__} (model_type={model_type!r}) keeps recurrent state outside transformers' "
            "cache layers, which prefixcache cannot snapshot"
        )
    return None


WINDOW_KINDS = {"sliding_attention": "sliding", "chunked_attention": "chunked"}  # config.layer_types -> rule kind


def window_group(model: PreTrainedModel) -> tuple[WindowRule, frozenset[int]] | None:
    """The model's window group: the rule and the indices of its layers (the most common window, when a model has
    several; other windowed layers stay full), or None when it has none. A layer counts only when the config's
    ``layer_types`` and transformers' own cache layer (a ``DynamicSlidingWindowLayer`` of that window) agree.
    Changes nothing."""
    config = model.config.get_text_config(decoder=True)
    kinds = list(getattr(config, "layer_types", None) or [])
    try:
        template = DynamicCache(config=config).layers
    except Exception:  # pragma: no cover - unsupported_reason reports it
        return None
    if not kinds:  # transformers infers the types from the window fields: only when one of them is set
        sliding, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
        if (sliding is None) == (chunk is None):
            return None
        kinds = ["sliding_attention" if sliding is not None else "chunked_attention"] * len(template)
    found: dict[WindowRule, set[int]] = {}
    for i, layer in enumerate(template):
        kind = WINDOW_KINDS.get(kinds[i]) if i < len(kinds) else None
        if kind is None or type(layer) is not DynamicSlidingWindowLayer:
            continue
        size = getattr(layer, "sliding_window", None)
        if not isinstance(size, int) or size < 1:
            continue
        found.setdefault(WindowRule(kind, size), set()).add(i)
    if not found:
        return None
    rule = max(found, key=lambda r: (len(found[r]), r.kind == "sliding", -r.tokens))
    return rule, frozenset(found[rule])


def _layers_template(model: PreTrainedModel) -> list[CacheLayer]:
    """Fresh cache layers for ``model``: full ``DynamicLayer`` for every attention layer (sliding ones too)."""
    template = DynamicCache(config=model.config.get_text_config(decoder=True))
    return [
        DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) or type(layer) is DynamicLayer else layer
        for layer in template.layers
    ]


class InPlaceLayer(DynamicLayer):
    """A full-length ``DynamicLayer`` whose K/V are the leading ``length`` positions of larger buffers
    ``[batch, heads, capacity, dim]``: ``update`` writes new tokens into the room after them instead of
    concatenating (which copies the whole prefix at every forward). When the room runs out, or something
    replaced the tensors (beam reorder, batch expansion), it falls back to concatenation: same values.
    """

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped_calls_exclude does not cover super() calls
        self._bufs: tuple[torch.Tensor, torch.Tensor] | None = (key_buffer, value_buffer)
        self.lazy_initialization(key_buffer, value_buffer)
        self._set(length)

    def _set(self, length: int) -> None:
        kb, vb = self._bufs  # type: ignore[misc]
        self.keys, self.values = kb[:, :, :length], vb[:, :, :length]
        self._views = (self.keys, self.values)  # what we handed out; anything else means someone replaced them

    @property
    def in_place(self) -> bool:
        """Whether keys/values still live in the buffers."""
        return self._bufs is not None and self.keys is self._views[0] and self.values is self._views[1]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.in_place:
            assert self._bufs is not None and self.keys is not None and self.values is not None
            kb, vb = self._bufs
            n, m = self.keys.shape[-2], key_states.shape[-2]
            if (
                n + m <= min(kb.shape[2], vb.shape[2])
                and key_states.shape[0] == kb.shape[0]
                and key_states.dtype == kb.dtype
                and value_states.dtype == vb.dtype
            ):
                kb[:, :, n : n + m].copy_(key_states)
                vb[:, :, n : n + m].copy_(value_states)
                self._set(n + m)
                return self.keys, self.values
        self._bufs = None
        return super().update(key_states, value_states, *args, **kwargs)


class InPlaceHybridLayer(LinearAttentionLayer, InPlaceLayer):  # type: ignore[misc,override]  # as transformers' own hybrid layer
    """An ``InPlaceLayer`` that also keeps a recurrent state (Falcon-H1's layers run attention and a Mamba mixer
    side by side on one cache layer): K/V in the buffers, the state as a ``LinearAttentionLayer``'s."""

    def __init__(
        self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int, number_of_states: int
    ) -> None:
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        InPlaceLayer.__init__(self, key_buffer, value_buffer, length)

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        if len(args) == 2 and not kwargs:  # the attention part (K/V), as transformers' hybrid layer dispatches
            DynamicLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return InPlaceLayer.update(self, key_states, value_states, *args, **kwargs)


def buffer_cache(model: PreTrainedModel, buffers: Sequence[LayerKV | None], length: int) -> DynamicCache:
    """A NEW DynamicCache whose attention layers are ``InPlaceLayer``s over ``buffers`` (per layer K and V
    ``[batch, heads, capacity, dim]``, e.g. ``KVPool.buffers``), holding their first ``length`` positions; a hybrid
    model's recurrent layers are the template's (fresh, no state)."""
    cache = DynamicCache()
    cache.layers = _layers_template(model)
    for i, (layer, bufs) in enumerate(zip(cache.layers, buffers)):
        if bufs is None or isinstance(layer, DummyLayer):
            continue
        if isinstance(layer, LinearAttentionAndFullAttentionLayer):
            cache.layers[i] = InPlaceHybridLayer(bufs[0], bufs[1], length, layer.number_of_states)
        else:
            cache.layers[i] = InPlaceLayer(bufs[0], bufs[1], length)
    return cache


def settle(cache: DynamicCache, buffers: Sequence[LayerKV | None], length: int) -> None:
    """Make sure the first ``length`` positions of every layer live in ``buffers`` (copying them there from a
    layer that had to fall back to concatenation). Changes only ``buffers``."""
    for layer, bufs in zip(cache.layers, buffers):
        if bufs is None or (isinstance(layer, InPlaceLayer) and layer.in_place):
            continue
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        assert keys is not None and values is not None, "settle: a KV layer without keys/values"
        bufs[0][:, :, :length].copy_(keys[:, :, :length])
        bufs[1][:, :, :length].copy_(values[:, :, :length])


def fresh_cache(model: PreTrainedModel, prefix_kv: Sequence[LayerKV | None] | None = None) -> DynamicCache:
    """A NEW DynamicCache of full-length layers, holding ``prefix_kv`` (per layer, or None for empty).

    The given tensors become the layers' storage (no copy): pass tensors nobody else writes to.
    """
    cache = DynamicCache()
    cache.layers = _layers_template(model)
    if prefix_kv is not None:
        for layer, kv in zip(cache.layers, prefix_kv):
            if kv is None or isinstance(layer, DummyLayer):
                continue
            k, v = kv
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v  # type: ignore[union-attr]
    return cache


def probe_specs(model: PreTrainedModel) -> list[LayerSpec | None]:
    """Per-layer K/V shapes, found by running ``model`` on one token. Changes nothing (no grad, eval-time)."""
    cache = fresh_cache(model)
    ids = torch.zeros((1, 1), dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    specs: list[LayerSpec | None] = []
    for layer in cache.layers:
        kv = _held_kv(layer)
        specs.append(
            None if kv is None else LayerSpec((kv[0].shape[1], kv[0].shape[3]), (kv[1].shape[1], kv[1].shape[3]))
        )
    return specs


def seq_length(cache: DynamicCache) -> int:
    """Tokens of KV the cache holds (full-length layers)."""
    return int(cache.get_seq_length())


def read_kv(cache: DynamicCache, start: int, stop: int, row: int = 0) -> list[LayerKV | None]:
    """Per-layer views of K/V for token positions ``start:stop`` of batch row ``row``. Changes nothing."""
    out: list[LayerKV | None] = []
    for layer in cache.layers:
        kv = _held_kv(layer)
        out.append(None if kv is None else (kv[0][row : row + 1, :, start:stop], kv[1][row : row + 1, :, start:stop]))
    return out


def _held_kv(layer: Any) -> LayerKV | None:  # any ``CacheLayer`` (or a custom layer class): probed by attribute
    """A cache layer's K, V tensors, or None for a layer that holds none (shared / attention-free / empty)."""
    keys = getattr(layer, "keys", None)
    if keys is None or not getattr(layer, "is_initialized", False) or keys.numel() == 0:
        return None
    return keys, layer.values
