"""The last decoder layer computes only the rows whose logits are kept.

A forward of the engine writes every new token's keys and values, but it needs the model's output only at the
positions it takes logits at (one per sampling request finishing its prompt or decoding; a scoring request's scored
positions; none for a middle chunk of a long prompt). Every layer but the last must compute every row (the next
layer's keys and values read them), but after the last layer's keys and values are written, its attention output
projection and its MLP serve only the kept rows: nothing else reads the others. ``LastLayerRows(model).active(keep,
tokens)`` has those two compute the kept rows alone (the others get zeros, which only the final norm sees before the
head drops them). On the ``small`` preset (12 layers, MLP of 4x the width) that is 7% of a prompt token's linear
FLOPs; on a deeper model, a smaller share.

Only code we know is changed. It applies when the last layer's class has a ``forward`` whose source sha256 is in
``KNOWN_LAYER`` (transformers 5's ``LlamaDecoderLayer``, which Qwen2/3, Mistral, SmolLM3, Starcoder2 and others copy,
and the Gemma 2/3, Olmo 2, Granite, Phi-3, Cohere 2, GLM-4, Qwen2-VL/2.5-VL, Qwen3-VL and Qwen3.5 layers: after the
attention, norms, residual adds and the MLP, each row on its own), its ``mlp`` a module whose ``forward`` source is in
``KNOWN_MLP`` (the gated MLPs, row by row; not a mixture of experts) and its ``self_attn.o_proj`` an ``nn.Linear`` (a
hybrid model whose last layer is a recurrent one has none). Anything else computes every row, and so does a call of
those modules from another thread meanwhile. The kept rows' values are what the full layer computes, up to the
rounding of a matmul over fewer rows (the engine's linears already vary with a step's row count); the engine's probe
forward checks the pruned path against the model's own logits at creation.
``PREFIXCACHE_LAST_ROWS=off`` has every layer compute every row.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.paged.fused import source_hash
from engine.switches import switched_off

# decoder layers whose every op after the attention is row by row (norms, residual adds, scalings, eval dropout)
KNOWN_LAYER = {
    "c58bc6a3bd6504f8": "LlamaDecoderLayer.forward (transformers 5.x; Qwen2/3, Mistral, SmolLM3, Starcoder2 copy it)",
    "9673c4b49cacf62c": "Gemma2DecoderLayer.forward (transformers 5.x)",
    "f0e376e682386ca6": "Gemma3DecoderLayer.forward (transformers 5.x)",
    "a45c365aeaaff297": "Olmo2DecoderLayer.forward (transformers 5.x)",
    "661e8ff1339ae507": "GraniteDecoderLayer.forward (transformers 5.x)",
    "95f20d9c7c28dda8": "Phi3DecoderLayer.forward (transformers 5.x)",
    "26ae051f5e0fbc06": "Cohere2DecoderLayer.forward (transformers 5.x: attention and MLP side by side)",
    "5b609b4137f8e53b": "Glm4DecoderLayer.forward (transformers 5.x)",
    "b1ee6a0058c68013": "Qwen2_5_VLDecoderLayer.forward (transformers 5.x; Qwen2-VL copies it)",
    "2be177747195d497": "Qwen3VLTextDecoderLayer.forward (transformers 5.x)",
    "5d0f621dd6d60c6f": "Qwen3_5DecoderLayer.forward (transformers 5.x: a linear-attention or an attention mixer)",
}
KNOWN_MLP = {
    "b4e9c2637c7f1172": "LlamaMLP.forward (transformers 5.x; Gemma, Qwen, Mistral, Olmo, Granite, Cohere copy it)",
    "82162c293daca80b": "Phi3MLP.forward (transformers 5.x: gate and up in one projection)",
}
ENV = "PREFIXCACHE_LAST_ROWS"


def last_layer(model: torch.nn.Module) -> tuple[torch.nn.Module | None, str | None]:
    """The decoder layer the model runs last, or (None, why not). Changes nothing."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config(decoder=True) if cfg is not None else None
    n = getattr(text, "num_hidden_layers", None)
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(n, int) or not isinstance(layers, torch.nn.ModuleList) or len(layers) != n or n < 1:
        return None, "no decoder layer list of num_hidden_layers layers"
    return layers[n - 1], None


class LastLayerRows:
    """The last layer of ``model`` made to compute only kept rows, when its code is known (``reason`` None)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.mlp: torch.nn.Module | None = None
        self.o_proj: torch.nn.Module | None = None
        layer, self.reason = last_layer(model)
        if switched_off(ENV):
            self.reason = f"turned off ({ENV}={os.environ[ENV]})"
            return
        if layer is None:
            return
        mlp = getattr(layer, "mlp", None)
        o_proj = getattr(getattr(layer, "self_attn", None), "o_proj", None)
        if source_hash(type(layer).forward) not in KNOWN_LAYER:
            self.reason = f"{type(layer).__name__}.forward is not a decoder layer whose code is known"
        elif mlp is None or source_hash(type(mlp).forward) not in KNOWN_MLP:
            self.reason = f"{type(layer).__name__}'s mlp is not a gated MLP whose code is known"
        elif type(o_proj) is not torch.nn.Linear:
            self.reason = f"{type(layer).__name__}'s self_attn.o_proj is not an nn.Linear"
        else:
            self.mlp, self.o_proj = mlp, o_proj

    @contextmanager
    def active(self, keep: torch.Tensor, tokens: int) -> Iterator[None]:
        """Inside, a forward of ``tokens`` new tokens (batch 1) computes the last layer's output projection and MLP at
        the flat positions ``keep`` only (distinct); the model is as it was on exit."""
        if self.mlp is None or self.o_proj is None or keep.numel() >= tokens:
            yield
            return

        owner = threading.get_ident()
        sliced: set[int] = set()  # the modules whose input this forward sliced (their output goes back to full size)

        def pre(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            x = args[0] if args else None
            if threading.get_ident() != owner or not (
                isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[:2] == (1, tokens)
            ):
                return None  # another thread's call, or not the shape this forward was set up for: every row
            sliced.add(id(module))
            return (x.index_select(1, keep), *args[1:])

        def post(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> Any:
            if threading.get_ident() != owner or id(module) not in sliced:
                return None  # another thread's call (this thread's may be under way), or one not sliced
            sliced.discard(id(module))
            full = out.new_zeros((1, tokens, out.shape[2]))
            return full.index_copy_(1, keep, out)

        handles = []
        try:
            for m in (self.o_proj, self.mlp):
                handles.append(m.register_forward_pre_hook(pre))
                handles.append(m.register_forward_hook(post))
            yield
        finally:
            for h in handles:
                h.remove()
