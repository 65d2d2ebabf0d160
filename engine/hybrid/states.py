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
from engine.hybrid import layer_state


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
    """The ``StateSpec`` of a cache after a forward of one sequence (batch 1): what ``layer_state.tensors_of`` finds
    in each recurrent layer (check ``layer_state.audit`` first). Changes nothing."""
    tensors: list[StateTensor] = []
    layers: list[int] = []
    counts: list[int] = []
    for i in recurrent_layers(cache):
        layer = cache.layers[i]
        assert isinstance(layer, LinearAttentionCacheLayerMixin)
        layers.append(i)
        counts.append(layer.number_of_states)
        for (j, kind), t in layer_state.tensors_of(layer).items():
            kernel = layer.conv_kernel_size[j] if kind == "conv" else None
            tensors.append(StateTensor(i, j, kind, tuple(t.shape[1:]), t.dtype, kernel))
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

    def view_layer(
        self, layer_idx: int, slots: int | Sequence[int], number_of_states: int, *, previous: bool = True
    ) -> LinearAttentionLayer:
        """A cache layer for recurrent layer ``layer_idx`` whose tensors are the pool's rows ``slots`` (one slot: a
        view, written in place; several: a gathered copy, see ``scatter_layer``), marked as holding a previous
        state (``previous``; False: a fresh sequence). Its token count is 0: on the paged path positions are explicit and only the model-level cache
        (``engine.paged.attention``) is asked for a length. Changes nothing."""
        layer = LinearAttentionLayer(number_of_states=number_of_states)
        layer_state.write(
            layer,
            self._layer_tensors(layer_idx, number_of_states, slots),
            self._layer_kernels(layer_idx),
            length=0,
            previous=previous,
        )
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

    def restore_cache(self, cache: DynamicCache, slot: int, length: int) -> None:
        """Put slot ``slot``'s state (after ``length`` tokens, which ``cache``'s attention layers hold) into
        ``cache``'s recurrent layers (batch 1) as fresh tensors (copies, not views: the cache may outlive the slot's
        contents), marked as a previous state, each layer's token count ``length`` (``layer_state.write``; raises
        RuntimeError when the cache then reports another length). Changes ``cache``."""
        for i, n in zip(self.spec.layers, self.spec.states):
            layer = cache.layers[i]
            assert isinstance(layer, LinearAttentionCacheLayerMixin), f"cache layer {i} keeps no recurrent state"
            held = {key: t.clone() for key, t in self._layer_tensors(i, n, slot).items()}
            layer_state.write(layer, held, self._layer_kernels(i), length=length)
        layer_state.check_length(cache, length)

    def _layer_tensors(
        self, layer_idx: int, number_of_states: int, slots: int | Sequence[int]
    ) -> dict[tuple[int, str], torch.Tensor]:
        """Rows ``slots`` of recurrent layer ``layer_idx``'s tensors, by ``(state index, kind)`` (``_rows``)."""
        out: dict[tuple[int, str], torch.Tensor] = {}
        for j in range(number_of_states):
            for kind in ("conv", "recurrent"):
                pool = self.tensors.get((layer_idx, j, kind))
                if pool is not None:
                    out[(j, kind)] = _rows(pool, slots)
        return out

    def _layer_kernels(self, layer_idx: int) -> dict[int, int | None]:
        """Recurrent layer ``layer_idx``'s conv kernel sizes, by state index."""
        return {j: k for (i, j), k in self._kernels.items() if i == layer_idx}

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


def _rows(pool: torch.Tensor, slots: int | Sequence[int]) -> torch.Tensor:
    if isinstance(slots, int):
        return pool[slots : slots + 1]
    return pool.index_select(0, _index(slots, pool.device))


def _index(slots: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(list(slots), dtype=torch.long, device=device)
