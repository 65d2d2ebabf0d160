"""Known decoder layers run as one Python function each during the engine's forwards.

transformers runs a decoder layer as a tree of module calls (the layer, its attention and MLP, their linears, norms
and activation), each through ``nn.Module.__call__``, with wrappers around some forwards (deprecated-argument
renaming, the ``kernels`` package's routing). On a decode step that dispatch is a fixed cost per layer however few
rows the step has: on the ``small`` preset (12 layers, 8 rows decoding over 1,024 tokens) 0.1-0.6 ms of an 18-33 ms
step, timed with steps alternating within one process (``bench_decode_roofline.py``'s ``hf_layers_*``).
``LeanLayers(model).active()`` gives each decoder layer whose code is known a forward that runs the same ops in
the same order, calling its submodules' ``forward`` directly: the same bits. Its MLP applies SiLU and the product
in place on the gate projection's fresh output (torch's same kernels, no temporaries) when no gradient is recorded.

Only code we know is replaced: a layer whose class's ``forward`` source (sha256, ``fused.source_hash``) is in
``KNOWN_LAYER``, its attention's in ``KNOWN_ATTENTION`` and its MLP's in ``KNOWN_MLP`` (transformers 5's Llama
classes, and the Qwen2 and Mistral attentions, Llama's with a sliding window; the layer and MLP are Llama's), with
the attributes that code reads, a SiLU activation of a known class, and an attention not kernelized (the ``kernels``
package's per-model functions unreplaced). At call time the original forward runs instead when any submodule has
hooks (``LastLayerRows`` prunes the last layer through hooks) or global module hooks exist, when a submodule was
replaced since (a LoRA layer over a projection), in training mode, or for an argument the lean forward does not
take. ``PREFIXCACHE_LEAN_LAYERS=off`` keeps transformers' forwards everywhere.

A step of the engine with no row on the torch path goes further: ``decode_layer.fast_forward`` calls the same
functions straight, without the module calls between them (the same bits; ``PREFIXCACHE_DECODE_LAYER=off`` keeps
the module calls, ``LeanLayers.decode_layer_suspended()`` for a block).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules import module as nn_module

from engine.paged.decode_layer import fast_forward
from engine.paged.fused import ROTARY_NAME, source_hash
from engine.switches import switched_off

ENV = "PREFIXCACHE_LEAN_LAYERS"
DECODE_ENV = "PREFIXCACHE_DECODE_LAYER"  # off: every step takes the lean forward's module calls
KNOWN_LAYER = {
    "c58bc6a3bd6504f8": "LlamaDecoderLayer.forward (transformers 5.x; Qwen2/3, Mistral, SmolLM3, Starcoder2 copy it)",
}
# the attention's code: what it is, and the sliding window it passes the attention function (None: no argument;
# "module": its own ``sliding_window``; "config": its config's, or None)
KNOWN_ATTENTION = {
    "15034ca19bd84245": ("LlamaAttention.forward (transformers 5.x)", None),
    "19fc6c09f70ad662": ("Qwen2Attention.forward (transformers 5.x: Llama's with the module's window)", "module"),
    "4f9a18cc72b246aa": ("MistralAttention.forward (transformers 5.x: Llama's with the config's window)", "config"),
}
KNOWN_MLP = {"b4e9c2637c7f1172": "LlamaMLP.forward (transformers 5.x; Gemma, Qwen, Mistral, Olmo copy it)"}
KNOWN_SILU = {"daf20c34b63e8994": "SiLUActivation.forward (transformers 5.x)"}
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def _hooked(m: torch.nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _global_hooks() -> bool:
    return bool(
        nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
        or nn_module._global_backward_hooks
        or nn_module._global_backward_pre_hooks
    )


def _silu(act: torch.nn.Module) -> bool:
    """Whether ``act`` is a plain SiLU (torch's, or transformers' of known source)."""
    if type(act) is torch.nn.SiLU:
        return True
    return type(act).__name__ == "SiLUActivation" and source_hash(type(act).forward) in KNOWN_SILU


def lean_reason(layer: torch.nn.Module) -> str | None:
    """None when ``layer`` can run the lean forward, else why not. Reads only."""
    if source_hash(type(layer).forward) not in KNOWN_LAYER:
        return f"{type(layer).__name__}.forward is not known code"
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    if not all(isinstance(m, torch.nn.Module) for m in (attn, mlp, *norms)):
        return "no self_attn, mlp and norms"
    assert attn is not None and mlp is not None
    known = KNOWN_ATTENTION.get(source_hash(type(attn).forward) or "")
    if known is None:
        return f"{type(attn).__name__}.forward is not known code"
    if known[1] == "module" and not hasattr(attn, "sliding_window"):
        return "the attention lacks its sliding_window"
    if source_hash(type(mlp).forward) not in KNOWN_MLP:
        return f"{type(mlp).__name__}.forward is not known code"
    if not all(isinstance(getattr(attn, n, None), torch.nn.Module) for n in _ATTENTION_PARTS):
        return "the attention lacks a projection"
    if not all(hasattr(attn, n) for n in ("head_dim", "scaling", "layer_idx", "config", "attention_dropout")):
        return "the attention lacks an attribute its forward reads"
    if not all(isinstance(getattr(mlp, n, None), torch.nn.Module) for n in _MLP_PARTS):
        return "the MLP lacks a projection or its activation"
    if not _silu(mlp.act_fn):
        return f"the MLP's activation is {type(mlp.act_fn).__name__}"
    home = sys.modules.get(type(attn).__module__)
    if home is None or not all(
        hasattr(home, n) for n in (ROTARY_NAME, "ALL_ATTENTION_FUNCTIONS", "eager_attention_forward")
    ):
        return "the attention's module lacks what its forward calls"
    return None


def _kernelized(attn: torch.nn.Module) -> bool:
    """Whether the ``kernels`` package replaced one of ``attn``'s per-model functions (``kernelize``)."""
    funcs = attn.__dict__.get("_kernel_funcs") or {}
    return any("forward" in getattr(f, "__dict__", {}) for f in funcs.values())


class _Switch:
    """Whether the lean forwards of one ``LeanLayers`` may take ``decode_layer``'s fast path (read at each call)."""

    def __init__(self, on: bool) -> None:
        self.on = on


def _lean_forward(layer: Any, decode_layer: _Switch | None = None) -> Callable[..., torch.Tensor]:
    """The layer's forward as one function (transformers 5's LlamaDecoderLayer, LlamaAttention and LlamaMLP, in
    their order), a step through ``decode_layer.fast_forward`` where it fits while ``decode_layer`` is on; the
    original for what it does not take."""
    original = type(layer).forward.__get__(layer)
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    q_proj, k_proj, v_proj, o_proj = (getattr(attn, n) for n in _ATTENTION_PARTS)
    gate_proj, up_proj, down_proj, act = (getattr(mlp, n) for n in _MLP_PARTS)
    parts = (attn, mlp, norm1, norm2, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, act)
    # where each part hangs: a part replaced since (a LoRA layer over a projection, another MLP) is not the one this
    # function would call, so the original forward runs
    wiring = tuple(
        (owner._modules, name, child)
        for owner, names in ((layer, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")),
                             (attn, _ATTENTION_PARTS), (mlp, _MLP_PARTS))
        for name in names
        for child in (owner._modules[name],)
    )  # fmt: skip
    home = sys.modules[type(attn).__module__]
    head_dim, layer_idx = attn.head_dim, attn.layer_idx
    window = KNOWN_ATTENTION[source_hash(type(attn).forward) or ""][1]
    fast = fast_forward(layer, home, window)
    switch = decode_layer or _Switch(False)

    def forward(
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if (
            layer.training
            or attn.training
            or position_embeddings is None
            or "past_key_values" in kwargs
            or _global_hooks()
            or any(_hooked(m) for m in parts)
            or any(modules.get(name) is not child for modules, name, child in wiring)
        ):
            return original(  # type: ignore[no-any-return]
                hidden_states, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
            )  # fmt: skip
        if switch.on and cache is not None:
            done = fast(hidden_states, cache, position_embeddings)
            if done is not None:
                return done
        residual = hidden_states
        x = norm1.forward(hidden_states)
        # LlamaAttention.forward
        input_shape = x.shape[:-1]
        hidden_shape = (*input_shape, -1, head_dim)
        q = q_proj.forward(x).view(hidden_shape).transpose(1, 2)
        k = k_proj.forward(x).view(hidden_shape).transpose(1, 2)
        v = v_proj.forward(x).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = getattr(home, ROTARY_NAME)(q, k, cos, sin)
        kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}  # what the attention gets there
        if cache is not None:
            k, v = cache.update(k, v, layer_idx, kwargs=kwargs)
        interface = home.ALL_ATTENTION_FUNCTIONS.get_interface(
            attn.config._attn_implementation, home.eager_attention_forward
        )
        extra: dict[str, Any] = {}  # passed as transformers passes it: a second sliding_window raises, as there
        if window == "module":
            extra["sliding_window"] = attn.sliding_window
        elif window == "config":
            extra["sliding_window"] = getattr(attn.config, "sliding_window", None)
        out, _ = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **extra, **kwargs)
        out = o_proj.forward(out.reshape(*input_shape, -1).contiguous())
        hidden_states = residual + out
        # LlamaMLP.forward: down(act(gate(x)) * up(x)); SiLU and the product in place on gate's fresh output
        residual = hidden_states
        x = norm2.forward(hidden_states)
        g = gate_proj.forward(x)
        u = up_proj.forward(x)
        if not torch.is_grad_enabled() and g.dtype == u.dtype and g.shape == u.shape:
            h = F.silu(g, inplace=True).mul_(u)
        else:
            h = act.forward(g) * u
        out = residual + down_proj.forward(h)
        return out  # type: ignore[no-any-return]

    return forward


class LeanLayers:
    """The decoder layers of ``model`` that can run the lean forward (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers: list[torch.nn.Module] = []
        self.reasons: dict[str, str] = {}  # a layer class that cannot: why not (the first layer's reason)
        self._forwards: list[Callable[..., torch.Tensor]] = []
        self._suspended = False
        if switched_off(ENV):
            return
        for m in model.modules():
            if not (hasattr(m, "self_attn") and hasattr(m, "mlp")):
                continue
            why = lean_reason(m)
            if why is None:
                self.layers.append(m)
            else:
                self.reasons.setdefault(type(m).__name__, why)
        self.decode_layer = _Switch(not switched_off(DECODE_ENV))  # see decode_layer_suspended
        self._forwards = [_lean_forward(m, self.decode_layer) for m in self.layers]

    @contextmanager
    def active(self) -> Iterator[None]:
        """Inside, the known layers run their lean forward (a kernelized attention's layer keeps its own)."""
        entered: list[torch.nn.Module] = []
        try:
            for m, forward in zip(self.layers, self._forwards if not self._suspended else ()):
                if "forward" in m.__dict__ or _kernelized(m.get_submodule("self_attn")):
                    continue  # someone else's forward in place, or hub kernels: leave it
                m.__dict__["forward"] = forward
                entered.append(m)
            yield
        finally:
            for m in entered:
                m.__dict__.pop("forward", None)

    @contextmanager
    def decode_layer_suspended(self) -> Iterator[None]:
        """Inside, steps take the lean forward's module calls, not ``decode_layer``'s fast path (benchmarks compare
        the two, step by step)."""
        before, self.decode_layer.on = self.decode_layer.on, False
        try:
            yield
        finally:
            self.decode_layer.on = before

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Inside, ``active()`` leaves every layer's forward alone (benchmarks compare the two, step by step)."""
        before, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = before
