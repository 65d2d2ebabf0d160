"""A hybrid model's rows on the contiguous ``generate`` path (``engine.contiguous``).

Each row's prompt is served from its deepest snapshot that its KV match reaches (``HybridStates.restore_point``):
the row's cache gets the attention KV of that prefix and the snapshot's recurrent state; its suffix (all but the
prompt's last token) is prefilled on its own, unpadded (padding after a state would corrupt it), with explicit
positions, in pieces that end at the row's snapshot points, where the state is kept. The rows' states are then
stacked into the batch cache that ``generate`` runs on, and ``BoundaryCapture`` (a stopping criterion that never
stops) keeps each row's state at the last block boundary it passes while decoding, to publish as the request-end
snapshot once the row's blocks are committed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, StoppingCriteria
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

from engine.hybrid import layer_state, recurrent
from engine.hybrid.store import HybridStates


@dataclass
class HybridRow:
    """One row's plan: its chained block keys so far, the snapshot it restores (``restored`` blocks, from
    ``slot``; 0 and None: from scratch) and the block boundaries it keeps snapshots at while prefilling."""

    namespace: str
    keys: list[bytes]
    restored: int
    slot: int | None
    points: list[int]
    published: list[int] = field(default_factory=list)  # boundaries it published


def prefill(
    rt_model: PreTrainedModel,
    hy: HybridStates,
    cache: DynamicCache,
    tokens: torch.Tensor,
    start: int,
    stop: int,
    row: HybridRow,
    cache_kwarg: str,
    logits_kwargs: dict[str, Any],
    key_tokens: Any = None,
    extra: Callable[[int, int], dict[str, Any]] | None = None,
) -> None:
    """Run positions ``start..stop-1`` of ``tokens`` (one row, unpadded) through the model into ``cache`` (which
    holds the first ``start`` positions), in pieces ending at the row's snapshot points, publishing a snapshot at
    each. ``key_tokens``: the row's key stream (images' content folded in; default ``tokens``), which snapshots
    are keyed by; ``extra(a, b)``: more model inputs for positions ``[a, b)`` (an image's encoder outputs, M-RoPE
    positions, which then replace the 1-D ones). Changes ``cache``, the snapshot index and pool."""
    bs = hy.block_size
    cuts = [p * bs for p in row.points if start < p * bs < stop] + [stop]
    at = start
    for cut in cuts:
        if cut <= at:
            continue
        ids = tokens[at:cut].unsqueeze(0)
        pos = torch.arange(at, cut, device=ids.device)[None]
        kwargs = {cache_kwarg: cache, **logits_kwargs}
        if extra is not None:
            more = extra(at, cut)
            pos = more.pop("position_ids", pos)
            kwargs.update(more)
        with torch.no_grad():
            if hy.tokenwise:
                with recurrent.stepwise():
                    rt_model(input_ids=ids, position_ids=pos, use_cache=True, **kwargs)
            else:
                rt_model(input_ids=ids, position_ids=pos, use_cache=True, **kwargs)
        at = cut
        if cut % bs == 0 and cut // bs in row.points:
            b = cut // bs
            token_list = (tokens if key_tokens is None else key_tokens).tolist()
            hy.keys(row.keys, token_list, row.namespace, b)
            hy.publish_cache(row.keys, b, token_list, cache, 0)
            row.published.append(b)


def stack_states(
    hy: HybridStates, cache: DynamicCache, row_caches: list[DynamicCache | None], copies: int, length: int
) -> None:
    """Give ``cache`` (the batch's, holding ``length`` padded positions) the recurrent state of every row (row r of
    ``row_caches``, ``copies`` times in a row, as ``num_return_sequences`` expands the batch), each layer's token
    count ``length`` (``layer_state.write``). A row that computed nothing (a one-token prompt) joins with a zero
    state. Raises RuntimeError when the cache then reports another length. Changes ``cache``."""
    any_state = False
    stacked: dict[int, dict[tuple[int, str], torch.Tensor]] = {}  # per recurrent layer: its rows' tensors
    for i, n in zip(hy.spec.layers, hy.spec.states):
        stacked[i] = {}
        for j in range(n):
            for kind in ("conv", "recurrent"):
                pool = hy.pool.tensors.get((i, j, kind))
                if pool is None:
                    continue
                rows = []
                for rc in row_caches:
                    assert rc is not None, "a hybrid row always has its own cache"
                    layer = rc.layers[i]
                    assert isinstance(layer, LinearAttentionCacheLayerMixin)
                    held = layer_state.tensors_of(layer).get((j, kind))
                    if held is None or not layer.has_previous_state[j]:
                        rows.append(torch.zeros_like(pool[:1]))
                    else:
                        rows.append(held.to(pool.dtype))
                        any_state = True
                stacked[i][(j, kind)] = torch.cat(rows).repeat_interleave(copies, dim=0)
    for i, n in zip(hy.spec.layers, hy.spec.states):
        target = cache.layers[i]
        assert isinstance(target, LinearAttentionCacheLayerMixin), f"cache layer {i} keeps no recurrent state"
        kernels = {j: hy.pool.kernel(i, j) for j in range(n)}
        layer_state.write(target, stacked[i], kernels, length=length, previous=any_state)
    layer_state.check_length(cache, length)


class BoundaryCapture(StoppingCriteria):
    """While ``generate`` decodes: keep each output row's recurrent state at the last block boundary it passes
    (a copy), until the row's first EOS has been computed. Never stops anything."""

    def __init__(self, hy: HybridStates, cache: DynamicCache, pads: list[int], eos: tuple[int, ...]) -> None:
        self.hy = hy
        self.cache = cache
        self.pads = pads  # per output row
        self.eos = set(eos)
        self.ends: list[int | None] = [None] * len(pads)  # a row's committed length (its first EOS included)
        self.kept: dict[int, tuple[int, dict[tuple[int, int, str], torch.Tensor]]] = {}  # row -> (tokens, state)

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        bs = self.hy.block_size
        width = input_ids.shape[1]
        newest = input_ids[:, -1].tolist()
        for i, pad in enumerate(self.pads):
            done = width - 1 - pad  # tokens whose state the cache holds (the newest one is not computed yet)
            end = self.ends[i]
            if done % bs == 0 and done > 0 and (end is None or done <= end):
                self.kept[i] = (done, self._copy(i))
            if end is None and newest[i] in self.eos:
                self.ends[i] = width - pad
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def _copy(self, row: int) -> dict[tuple[int, int, str], torch.Tensor]:
        out: dict[tuple[int, int, str], torch.Tensor] = {}
        for i, n in zip(self.hy.spec.layers, self.hy.spec.states):
            layer = self.cache.layers[i]
            assert isinstance(layer, LinearAttentionCacheLayerMixin)
            for j in range(n):
                for kind, held in (("conv", layer.conv_states.get(j)), ("recurrent", layer.recurrent_states.get(j))):
                    if held is not None and (i, j, kind) in self.hy.pool.tensors:
                        out[(i, j, kind)] = held[row].clone()
        return out

    def publish(self, row: int, committed: int, keys: list[bytes], tokens: Any, namespace: str) -> int:
        """Publish output row ``row``'s kept boundary state as the request-end snapshot if its boundary lies within
        the ``committed`` tokens (whose keys ``keys`` are extended here); returns the boundary, or 0."""
        kept = self.kept.get(row)
        if kept is None or kept[0] > committed:
            return 0
        b = kept[0] // self.hy.block_size
        self.hy.keys(keys, tokens, namespace, b)
        self.hy.publish_tensors(keys, b, tokens, kept[1])
        return b
