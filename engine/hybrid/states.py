"""The recurrent state of a hybrid model's sequences: its shapes (``StateSpec``) and a pool of slots holding it.

transformers (5.x) keeps a recurrent layer's state in the cache layer (a ``LinearAttentionCacheLayerMixin``): per
state index ``j``, a conv state (the last ``K`` inputs of its causal conv, in the model's dtype) and, for SSM and
linear-attention layers, a recurrent state (often float32). Both are fixed-size per sequence. ``StatePool`` holds
``num_slots`` of them, one slot = the state of every recurrent layer of one sequence after some prefix, on the
model's device: a running request's live state, or a snapshot at a block boundary (``prefixcache.core.snapshots``).

Slots are read and written through cache layers that *view* the pool (``attach``): the model's own updates
(``copy_`` into the layer's tensors, in-place decode steps) then land in the slot. A layer whose tensors were
replaced during a forward (a lazy first initialisation) is copied back (``detach``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DummyLayer, DynamicCache, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from engine import memory


@dataclass(frozen=True)
class StateTensor:
    """One tensor of one recurrent layer's state: ``kind`` "conv" or "recurrent", state index ``index``, its
    shape per sequence (no batch dimension) and dtype; ``kernel``: a conv state's kernel size."""

    layer: int
    index: int
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kernel: int | None = None

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StateSpec:
    """The state of one sequence: every tensor of every recurrent layer (``layers``: their cache indices, each
    with ``states[i]`` state indices)."""

    tensors: tuple[StateTensor, ...]
    layers: tuple[int, ...]
    states: tuple[int, ...]

    @property
    def bytes_per_snapshot(self) -> int:
        """Bytes of one sequence's state (one slot)."""
        return sum(t.nbytes for t in self.tensors)

    def describe(self) -> tuple[tuple[Any, ...], ...]:
        """A plain description (for a tier binding): per tensor, layer, index, kind, shape and dtype."""
        return tuple((t.layer, t.index, t.kind, t.shape, str(t.dtype)) for t in self.tensors)


def recurrent_layers(template: DynamicCache) -> list[int]:
    """The indices of ``template``'s layers that keep recurrent state. Changes nothing."""
    return [i for i, layer in enumerate(template.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]


def spec_of(cache: DynamicCache) -> StateSpec:
    """The ``StateSpec`` of a cache after a forward of one sequence (batch 1). Changes nothing."""
    tensors: list[StateTensor] = []
    layers: list[int] = []
    counts: list[int] = []
    for i in recurrent_layers(cache):
        layer = cache.layers[i]
        assert isinstance(layer, LinearAttentionCacheLayerMixin)
        layers.append(i)
        counts.append(layer.number_of_states)
        for j in range(layer.number_of_states):
            conv = layer.conv_states.get(j)
            if conv is not None and layer.is_conv_states_initialized[j]:
                tensors.append(StateTensor(i, j, "conv", tuple(conv.shape[1:]), conv.dtype, layer.conv_kernel_size[j]))
            rec = layer.recurrent_states.get(j)
            if rec is not None and layer.is_recurrent_states_initialized[j]:
                tensors.append(StateTensor(i, j, "recurrent", tuple(rec.shape[1:]), rec.dtype))
    return StateSpec(tuple(tensors), tuple(layers), tuple(counts))


class StatePool:
    """``num_slots`` sequence states of ``spec`` on ``device``: per state tensor one ``[num_slots, *shape]`` tensor
    (zeros). ``check_memory`` refuses a pool above 90% of the device's available memory, as for the KV pool."""

    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device | str, *, check_memory: bool = True):
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.spec = spec
        self.num_slots = num_slots
        self.device = torch.device(device)
        if check_memory:
            memory.check_pool(
                spec.bytes_per_snapshot,
                num_slots,
                self.device,
                what="the recurrent-state pool",
                fix="lower max_cached_states (or --max-cached-states)",
            )
        self.tensors = {
            (t.layer, t.index, t.kind): torch.zeros((num_slots, *t.shape), dtype=t.dtype, device=self.device)
            for t in spec.tensors
        }
        self._kernels = {(t.layer, t.index): t.kernel for t in spec.tensors if t.kind == "conv"}

    @property
    def nbytes(self) -> int:
        return self.spec.bytes_per_snapshot * self.num_slots

    def copy(self, dst: int, src: int) -> None:
        """Slot ``dst`` becomes a copy of slot ``src``. Changes slot ``dst``."""
        if dst != src:
            for t in self.tensors.values():
                t[dst].copy_(t[src])

    def zero(self, slot: int) -> None:
        """Clear slot ``slot`` (a fresh sequence). Changes it."""
        for t in self.tensors.values():
            t[slot].zero_()

    def view_layer(self, layer_idx: int, slots: int | Sequence[int], number_of_states: int) -> LinearAttentionLayer:
        """A cache layer for recurrent layer ``layer_idx`` whose tensors are the pool's rows ``slots`` (one slot: a
        view, written in place; several: a gathered copy, see ``scatter_layer``), marked as holding a previous
        state. Changes nothing."""
        layer = LinearAttentionLayer(number_of_states=number_of_states)
        for j in range(number_of_states):
            conv = self.tensors.get((layer_idx, j, "conv"))
            if conv is not None:
                layer.conv_states[j] = _rows(conv, slots)
                layer.is_conv_states_initialized[j] = True
                layer.conv_kernel_size[j] = self._kernels[(layer_idx, j)]
                placed(layer, conv)
            rec = self.tensors.get((layer_idx, j, "recurrent"))
            if rec is not None:
                layer.recurrent_states[j] = _rows(rec, slots)
                layer.is_recurrent_states_initialized[j] = True
            layer.has_previous_state[j] = True
        return layer

    def store_layer(self, layer: LinearAttentionCacheLayerMixin, layer_idx: int, slots: int | Sequence[int]) -> None:
        """Write ``layer``'s tensors (one row per slot of ``slots``) into those slots, unless they are the slots'
        own views already. Changes those slots."""
        for j in range(layer.number_of_states):
            for kind, held in (("conv", layer.conv_states.get(j)), ("recurrent", layer.recurrent_states.get(j))):
                pool = self.tensors.get((layer_idx, j, kind))
                if pool is None or held is None:
                    continue
                if isinstance(slots, int):
                    dst = pool[slots : slots + 1]
                    if held.data_ptr() != dst.data_ptr():
                        dst.copy_(held.to(dst.dtype))
                else:
                    pool.index_copy_(0, _index(slots, pool.device), held.to(pool.dtype))

    def kernel(self, layer_idx: int, index: int) -> int | None:
        """The conv kernel size of state ``index`` of recurrent layer ``layer_idx``."""
        return self._kernels.get((layer_idx, index))

    def restore_cache(self, cache: DynamicCache, slot: int) -> None:
        """Put slot ``slot``'s state into ``cache``'s recurrent layers (batch 1) as fresh tensors (copies, not
        views: the cache may outlive the slot's contents), marked as a previous state. Changes ``cache``."""
        for i, n in zip(self.spec.layers, self.spec.states):
            layer = cache.layers[i]
            assert isinstance(layer, LinearAttentionCacheLayerMixin), f"cache layer {i} keeps no recurrent state"
            for j in range(n):
                conv = self.tensors.get((i, j, "conv"))
                if conv is not None:
                    layer.conv_states[j] = conv[slot : slot + 1].clone()
                    layer.is_conv_states_initialized[j] = True
                    layer.conv_kernel_size[j] = self._kernels[(i, j)]
                    placed(layer, conv)
                rec = self.tensors.get((i, j, "recurrent"))
                if rec is not None:
                    layer.recurrent_states[j] = rec[slot : slot + 1].clone()
                    layer.is_recurrent_states_initialized[j] = True
                layer.has_previous_state[j] = True

    def save_cache(self, cache: DynamicCache, row: int, slot: int) -> None:
        """Write batch row ``row`` of ``cache``'s recurrent state into slot ``slot``. Changes that slot."""
        for i, n in zip(self.spec.layers, self.spec.states):
            layer = cache.layers[i]
            assert isinstance(layer, LinearAttentionCacheLayerMixin)
            for j in range(n):
                for kind, held in (("conv", layer.conv_states.get(j)), ("recurrent", layer.recurrent_states.get(j))):
                    pool = self.tensors.get((i, j, kind))
                    if pool is not None and held is not None:
                        pool[slot].copy_(held[row].to(pool.dtype))


class SlotCache(DynamicCache):
    """A cache whose only live layer is recurrent layer ``layer_idx``, over pool rows: what a recurrent module
    sees for one segment of a paged step (``engine.hybrid.recurrent``)."""

    def __init__(self, num_layers: int, layer_idx: int, layer: LinearAttentionLayer) -> None:
        super().__init__()
        self.layers = [DummyLayer() for _ in range(num_layers)]
        self.layers[layer_idx] = layer


def placed(layer: LinearAttentionCacheLayerMixin, tensor: torch.Tensor) -> None:
    """Record on ``layer`` the device and dtype of the conv state ``tensor`` it now holds, as its lazy
    initialisation would (transformers annotates these attributes as None). Changes ``layer``."""
    setattr(layer, "device", tensor.device)  # noqa: B010
    setattr(layer, "dtype", tensor.dtype)  # noqa: B010


def _rows(pool: torch.Tensor, slots: int | Sequence[int]) -> torch.Tensor:
    if isinstance(slots, int):
        return pool[slots : slots + 1]
    return pool.index_select(0, _index(slots, pool.device))


def _index(slots: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(slots), dtype=torch.long, device=device)
