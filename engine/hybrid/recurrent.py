"""The recurrent modules of a hybrid model, run with each sequence's own state inside prefixcache's forwards.

A hybrid model's recurrent layers (gated delta nets, Mamba mixers, short convs) keep one state per batch row in
the cache. The paged engine runs ONE forward over a flat batch ``[1, T]`` holding several requests' new tokens;
the torch paths of these layers would run it as one sequence (one request's state leaking into the next). So
each recurrent module's forward is wrapped (``install``, per module instance; outside prefixcache's own calls
the wrapper calls the original at once): inside ``segments(...)`` it cuts the flat hidden states into the
requests' segments and runs the original forward on each with that request's state slot of the ``StatePool``
(prefill segments one by one; decode segments, one token each over a previous state, as one batched call); the
attention layers meanwhile read the KV pool as usual.

Some layers compute a multi-token forward over a previous state inexactly (transformers' Jamba mixer starts its
scan from zeros): ``tokenwise`` modules are then fed such inputs one token at a time (``ModelRuntime`` finds
out by a probe, ``engine.hybrid.probe``), on the engine and, inside ``stepwise()``, on the contiguous path.
"""

from __future__ import annotations

import contextvars
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

from engine.hybrid.states import SlotCache, StatePool


@dataclass(frozen=True)
class Segment:
    """One request's tokens in a flat step: ``length`` tokens from offset ``start``; its state is slot ``slot`` of
    the pool, holding a previous state (``has_state``) or to be started fresh."""

    start: int
    length: int
    slot: int
    has_state: bool


@dataclass(frozen=True)
class _Step:
    pool: StatePool
    segments: tuple[Segment, ...]
    num_layers: int


_step: contextvars.ContextVar[_Step | None] = contextvars.ContextVar("prefixcache_hybrid_step", default=None)
_stepwise: contextvars.ContextVar[bool] = contextvars.ContextVar("prefixcache_hybrid_stepwise", default=False)


def find_modules(model: torch.nn.Module, layers: list[int]) -> dict[int, torch.nn.Module] | str:
    """The recurrent module of each recurrent cache layer of ``layers`` (a module with that ``layer_idx`` that owns
    a causal ``Conv1d``), or the reason they cannot be told apart. Changes nothing."""
    found: dict[int, list[torch.nn.Module]] = {}
    wanted = set(layers)
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if idx not in wanted:
            continue
        if any(isinstance(child, torch.nn.Conv1d) for child in module.children()):
            found.setdefault(int(idx), []).append(module)
    missing = [i for i in layers if len(found.get(i, [])) != 1]
    if missing:
        return (
            f"cannot find exactly one recurrent module (a module with a Conv1d) for recurrent cache layer(s) {missing}"
        )
    return {i: mods[0] for i, mods in found.items()}


def install(modules: dict[int, torch.nn.Module], *, tokenwise: bool) -> None:
    """Wrap each module's forward (once; ``tokenwise`` is updated on later calls). Outside ``segments`` and
    ``stepwise`` the wrapper calls the original forward unchanged. Changes the module instances (instance
    attributes ``_prefixcache_forward`` and ``_prefixcache_tokenwise``; torch's ``Module.__setattr__`` takes them)."""
    for module in modules.values():
        target: Any = module
        if not hasattr(target, "_prefixcache_forward"):
            target._prefixcache_forward = target.forward
            target.forward = types.MethodType(_forward, target)
        target._prefixcache_tokenwise = tokenwise


@contextmanager
def segments(pool: StatePool, segs: list[Segment], num_layers: int) -> Iterator[None]:
    """Inside: the wrapped recurrent modules run the flat batch's ``segs`` with their slots' states."""
    token = _step.set(_Step(pool, tuple(segs), num_layers))
    try:
        yield
    finally:
        _step.reset(token)


@contextmanager
def stepwise() -> Iterator[None]:
    """Inside: a ``tokenwise`` module given several tokens over a previous state takes them one at a time (the
    contiguous path's exactness fix for such layers)."""
    token = _stepwise.set(True)
    try:
        yield
    finally:
        _stepwise.reset(token)


def _forward(self: Any, hidden_states: torch.Tensor, cache: Any = None, *args: Any, **kwargs: Any) -> Any:
    """The wrapped forward of a recurrent module (``self``: the module, typed Any for the attributes ``install``
    gave it)."""
    original = self._prefixcache_forward
    step = _step.get()
    if step is None:
        if _stepwise.get() and self._prefixcache_tokenwise and _has_state(cache, self.layer_idx):
            return _tokenwise(original, hidden_states, cache, args, kwargs)
        return original(hidden_states, *args, cache=cache, **kwargs)
    return _run_step(self, original, step, hidden_states, kwargs)


def _has_state(cache: Any, layer_idx: int) -> bool:
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return False
    layer = layers[layer_idx]
    return isinstance(layer, LinearAttentionCacheLayerMixin) and all(layer.has_previous_state.values())


def _tokenwise(original: Any, hidden: torch.Tensor, cache: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if hidden.shape[1] == 1:
        return original(hidden, *args, cache=cache, **kwargs)
    kwargs = {**kwargs, "attention_mask": None}
    steps = [original(hidden[:, t : t + 1], *args, cache=cache, **kwargs) for t in range(hidden.shape[1])]
    return torch.cat(steps, dim=1)


def _run_step(module: Any, original: Any, step: _Step, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """The flat batch ``hidden`` [1, T, H] through ``original``, segment by segment (decode rows batched)."""
    i = int(module.layer_idx)
    pool, n = step.pool, step.num_layers
    states = pool.spec.states[pool.spec.layers.index(i)]
    kwargs = {**kwargs, "attention_mask": None}
    out = torch.empty_like(hidden)
    decode = [s for s in step.segments if s.length == 1 and s.has_state]
    tokenwise = bool(module._prefixcache_tokenwise)
    for s in step.segments:
        if s.length == 1 and s.has_state:
            continue
        layer = pool.view_layer(i, s.slot, states, previous=s.has_state)
        cache = SlotCache(n, i, layer)
        piece = hidden[:, s.start : s.start + s.length]
        if tokenwise and s.has_state:
            res = _tokenwise(original, piece, cache, (), kwargs)
        else:
            res = original(piece, cache=cache, **kwargs)
        out[:, s.start : s.start + s.length] = res
        pool.store_layer(layer, i, s.slot)
    if decode:
        slots = [s.slot for s in decode]
        layer = pool.view_layer(i, slots, states)  # a gathered copy of the rows' states
        cache = SlotCache(n, i, layer)
        rows = torch.cat([hidden[:, s.start : s.start + 1] for s in decode], dim=0)  # [B, 1, H]
        res = original(rows, cache=cache, **kwargs)
        for b, s in enumerate(decode):
            out[:, s.start : s.start + 1] = res[b : b + 1]
        pool.store_layer(layer, i, slots)
    return out


def fresh_template(model: PreTrainedModel) -> DynamicCache:
    """A fresh ``DynamicCache`` of the model's own layer types. Changes nothing."""
    return DynamicCache(config=model.config.get_text_config(decoder=True))
