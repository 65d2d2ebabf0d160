"""The only module that touches transformers' Cache classes.

* ``unsupported_reason(model)``: why a model's cache cannot be served from a prefix cache (recurrent state,
  encoder-decoder, non-attention layers), or ``None`` when it can.
* ``fresh_cache(model, prefix_kv)``: a NEW ``DynamicCache`` of full-length layers holding the prefix K/V.
  Sliding-window layers are replaced by full ``DynamicLayer``s: the attention masks are built from the model
  config's window and the token positions, so keeping every position is exact, and the pool needs full K/V.
  Layers holding a prefix gathered with room to spare are ``InPlaceLayer``s: they append the suffix and the
  generated tokens into that room instead of concatenating (a full copy of the prefix at every forward).
* ``read_kv(cache, start, stop, row)``: per-layer K/V of token positions ``start:stop`` after a generate call.
* ``probe_specs(model)``: per-layer K/V shapes, found by a one-token forward.
* ``cache_kwarg(model)``: the keyword ``generate`` takes a cache under (``cache`` in transformers >= 5.x
  where ``past_key_values`` is deprecated, else ``past_key_values``).
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from engine.kv_pool import LayerKV, LayerSpec

try:  # shared-KV / attention-free placeholder layers (transformers >= 5.x)
    from transformers.cache_utils import DummyLayer
except ImportError:  # pragma: no cover - older transformers
    DummyLayer = ()  # type: ignore[assignment,misc]

RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "rwkv", "jamba", "zamba", "zamba2", "bamba", "granitemoehybrid",
    "recurrent_gemma", "xlstm", "lfm2", "lfm2_moe", "qwen3_next", "qwen3_5", "kimi_linear", "minimax", "nemotron_h",
    "olmo_hybrid", "plamo2", "mamba_ssm",
})


def cache_kwarg(model) -> str:
    """Name of the keyword under which ``model.generate`` takes a ready cache."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot be prefix-cached exactly, or None. Changes nothing."""
    config = model.config
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        return (f"{type(model).__name__} (model_type={model_type!r}) is an encoder-decoder model: its decoder cache "
                "depends on the encoder input, so a decoder-token prefix cannot be reused")
    if getattr(model, "_is_stateful", False) or model_type in RECURRENT_MODEL_TYPES:
        return (f"{type(model).__name__} (model_type={model_type!r}) keeps recurrent state (SSM / linear attention), "
                "which cannot be split into per-token KV blocks")
    if not hasattr(model, "generate") or not getattr(model, "can_generate", lambda: True)():
        return f"{type(model).__name__} cannot generate"
    try:
        template = DynamicCache(config=config.get_text_config(decoder=True))
    except Exception as exc:  # pragma: no cover - exotic configs
        return f"cannot build a DynamicCache for {type(model).__name__}: {exc}"
    for i, layer in enumerate(template.layers):
        if not isinstance(layer, (DynamicLayer, DummyLayer)) or getattr(layer, "is_linear", False):
            return (f"{type(model).__name__} layer {i} uses {type(layer).__name__}, not pure attention KV "
                    "(recurrent or compressed state cannot be split into blocks)")
    if any(type(layer).__name__ == "DynamicIndexedLayer" for layer in template.layers):
        return f"{type(model).__name__} uses indexed (sparse) attention caches, which are not plain KV"
    return None


def _layers_template(model) -> list:
    """Fresh cache layers for ``model``: full ``DynamicLayer`` for every attention layer (sliding ones too)."""
    template = DynamicCache(config=model.config.get_text_config(decoder=True))
    return [
        DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) or type(layer) is DynamicLayer else layer
        for layer in template.layers
    ]


class InPlaceLayer(DynamicLayer):
    """A full-length ``DynamicLayer`` whose K/V are the leading slice of a larger buffer: ``update`` writes the
    new tokens into the room after them instead of concatenating (which copies the whole prefix at every
    forward). When the room runs out, or anything replaced the tensors (beam reorder, batch expansion), it
    falls back to concatenation: the values are the same either way.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self._bufs = (_buffer_of(keys), _buffer_of(values))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        kb, vb = self._bufs
        k, v = self.keys, self.values
        n, m = k.shape[-2], key_states.shape[-2]
        if (kb is not None and vb is not None and n + m <= min(kb.shape[2], vb.shape[2])
                and key_states.shape[0] == 1 and _is_head_of(k, kb) and _is_head_of(v, vb)
                and key_states.dtype == kb.dtype and value_states.dtype == vb.dtype):
            kb[:, :, n : n + m].copy_(key_states)
            vb[:, :, n : n + m].copy_(value_states)
            self.keys, self.values = kb[:, :, : n + m], vb[:, :, : n + m]
            return self.keys, self.values
        self._bufs = (None, None)
        return super().update(key_states, value_states, *args, **kwargs)


def _buffer_of(t: torch.Tensor) -> torch.Tensor | None:
    """The ``[1, heads, capacity, dim]`` buffer ``t`` is the leading slice of, or None."""
    base = t._base if t._base is not None else t
    return base if base.dim() == 4 and base.shape[0] == 1 and base.is_contiguous() and _is_head_of(t, base) else None


def _is_head_of(t: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether ``t`` is ``buf[:, :, :L]`` for some L."""
    return (t.dim() == 4 and t.shape[0] == 1 and t.shape[1] == buf.shape[1] and t.shape[3] == buf.shape[3]
            and t.shape[2] <= buf.shape[2] and t.data_ptr() == buf.data_ptr() and t.stride() == buf.stride())


def fresh_cache(model, prefix_kv: Sequence[LayerKV | None] | None = None, *,
                append_in_place: bool = False) -> DynamicCache:
    """A NEW DynamicCache of full-length layers, holding ``prefix_kv`` (per layer, or None for empty).

    The given tensors become the layers' storage (no copy): pass tensors nobody else writes to. With
    ``append_in_place``, where a tensor is the leading slice of a larger buffer that the caller owns
    (``KVPool.gather(..., reserve=)`` makes them so), new tokens are written into that buffer's room
    (``InPlaceLayer``) instead of concatenated.
    """
    cache = DynamicCache()
    cache.layers = _layers_template(model)
    if prefix_kv is not None:
        for i, (layer, kv) in enumerate(zip(cache.layers, prefix_kv)):
            if kv is None or isinstance(layer, DummyLayer):
                continue
            k, v = kv
            if append_in_place and type(layer) is DynamicLayer and _buffer_of(k) is not None and _buffer_of(v) is not None:
                cache.layers[i] = InPlaceLayer(k, v)
            else:
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
    return cache


def probe_specs(model) -> list[LayerSpec | None]:
    """Per-layer K/V shapes, found by running ``model`` on one token. Changes nothing (no grad, eval-time)."""
    cache = fresh_cache(model)
    ids = torch.zeros((1, 1), dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    specs: list[LayerSpec | None] = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is None or not getattr(layer, "is_initialized", False) or keys.numel() == 0:
            specs.append(None)
            continue
        values = layer.values
        specs.append(LayerSpec((keys.shape[1], keys.shape[3]), (values.shape[1], values.shape[3])))
    return specs


def seq_length(cache) -> int:
    """Tokens of KV the cache holds (full-length layers)."""
    return int(cache.get_seq_length())


def read_kv(cache, start: int, stop: int, row: int = 0) -> list[LayerKV | None]:
    """Per-layer views of K/V for token positions ``start:stop`` of batch row ``row``. Changes nothing."""
    out: list[LayerKV | None] = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is None or not getattr(layer, "is_initialized", False) or keys.numel() == 0:
            out.append(None)
            continue
        out.append((keys[row : row + 1, :, start:stop], layer.values[row : row + 1, :, start:stop]))
    return out
