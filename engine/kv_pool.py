"""KVPool: preallocated K/V storage for cached blocks, on the model's device and dtype.

Layout: per layer and side, one tensor ``[heads, num_blocks, block_size * head_dim]``. Gathering n blocks
is ONE ``index_select`` on dim 1 per layer and side, written into the leading ``n * block_size`` positions of
a reusable buffer ``[1, heads, capacity, head_dim]`` -- what a ``DynamicCache`` layer holds, with room left
for the suffix and the generated tokens to be appended in place. (Measured: one 5-D tensor for all layers is
slower -- index_select on an inner dim of a 5-D tensor and fresh 100+ MB results that page-fault.) K and V shapes may differ (e.g. latent attention); layers without KV (shared
or attention-free layers) are ``None`` in the spec and get ``None`` back.

Window layers (sliding-window or chunked attention, ``window_layers``) keep their K/V in ``window_slots`` slots
of their own instead: block ``b``'s K/V of those layers lie in slot ``windows.table[b]``
(``prefixcache.core.windows.WindowSlots``, attached with ``attach_windows``). Gathering a block without a slot
reads zeros (a window layer never reads it: the cache serves only matches whose windows hold slots), scattering
one writes nowhere (a scratch slot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine import memory
from engine.malloc import advise_huge_pages
from prefixcache.core.windows import WindowSlots

LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LayerSpec:
    """Per-token shapes of one layer's K and V: (heads, head_dim) each."""

    k_shape: tuple[int, int]
    v_shape: tuple[int, int]

    @property
    def numel_per_token(self) -> int:
        return self.k_shape[0] * self.k_shape[1] + self.v_shape[0] * self.v_shape[1]


def bytes_per_token(specs: Sequence[LayerSpec | None], dtype: torch.dtype) -> int:
    """Bytes of K+V one token takes across all layers."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(s.numel_per_token for s in specs if s is not None) * item


class KVPool:
    """K/V tensors for ``num_blocks`` blocks of ``block_size`` tokens; gather and scatter by block id."""

    def __init__(
        self,
        specs: Sequence[LayerSpec | None],
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        check_memory: bool = True,
        window_layers: frozenset[int] = frozenset(),
        window_slots: int = 0,
    ) -> None:
        """Allocate (and touch: zeros, so the memory is committed now, not on the first scatter) the pool.

        With ``check_memory`` (the default) a pool too large for the device's available memory is refused first
        (``engine.memory.PoolTooLargeError``; a ``PoolSizeWarning`` when it takes more than half of it)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"KVPool needs num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        if bool(window_layers) != (window_slots > 0):
            raise ValueError(f"KVPool: window layers {sorted(window_layers)} with {window_slots} window slots")
        self.window_layers = frozenset(i for i in window_layers if specs[i] is not None)
        self.window_slots = window_slots
        self.windows: WindowSlots | None = None
        if check_memory:
            full = bytes_per_token([s for i, s in enumerate(specs) if i not in self.window_layers], dtype)
            win = bytes_per_token([s for i, s in enumerate(specs) if i in self.window_layers], dtype)
            tokens = num_blocks * block_size
            memory.check_pool(full + -(-win * window_slots // num_blocks), tokens, device)
        self.specs = list(specs)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        with _plain_tensors():
            self._allocate()

    def _allocate(self) -> None:
        dtype, num_blocks, block_size = self.dtype, self.num_blocks, self.block_size
        self.huge_pages = False  # whether Linux was asked to back any pool tensor with huge pages
        self._layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for spec in self.specs:
            if spec is None:
                self._layers.append(None)
                continue
            (kh, kd), (vh, vd) = spec.k_shape, spec.v_shape
            # one block more than the cache hands out: the scratch block (see scratch_block); window layers: their
            # slots, a scratch slot and a zero slot (what a block without a slot reads)
            n = self.window_slots + 2 if len(self._layers) in self.window_layers else num_blocks + 1
            self._layers.append(
                (self._zeros((kh, n, block_size * kd), dtype), self._zeros((vh, n, block_size * vd), dtype))
            )
        # reusable gather buffers [1, heads, capacity, dim] per layer and side, grown on demand; see gather()
        self._scratch: list[list[torch.Tensor | None]] = [[None, None] for _ in self.specs]

    def _zeros(self, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed pool tensor; on the CPU, in transparent huge pages where Linux gives them
        (``engine.malloc.advise_huge_pages``, asked before the zeros touch it): blocks are read scattered over the
        pool, and with 4 KiB pages nearly every block read missed the TLB."""
        t = torch.empty(shape, dtype=dtype, device=self.device)
        if t.device.type == "cpu":
            self.huge_pages = advise_huge_pages(t.data_ptr(), t.numel() * t.element_size()) or self.huge_pages
        return t.zero_()

    def attach_windows(self, windows: WindowSlots | None) -> None:
        """Read and write the window layers through ``windows``' slots (the cache's window group)."""
        if windows is not None and (windows.capacity != self.window_slots or windows.num_blocks != self.num_blocks):
            raise ValueError(
                f"attach_windows: {windows.capacity} slots for {windows.num_blocks} blocks, the pool has "
                f"{self.window_slots} for {self.num_blocks}"
            )
        if windows is None and self.window_layers:
            raise ValueError("attach_windows: a pool with window layers needs their slots")
        self.windows = windows

    def window_ids(self, block_ids: Sequence[int] | np.ndarray, *, write: bool) -> np.ndarray:
        """The window-layer slots of ``block_ids`` (int64): those without a slot, and the scratch block, read the
        zero slot, or (``write``) write the scratch slot. Changes nothing."""
        ws = self.windows
        assert ws is not None, "a pool with window layers read before its slots were attached"
        ids = np.asarray(block_ids, dtype=np.int64)
        out = np.full(ids.shape, self.window_slots + (0 if write else 1), dtype=np.int64)
        inside = ids < self.num_blocks
        got = ws.table[ids[inside]]
        out[inside] = np.where(got < 0, out[inside], got)
        return out

    @property
    def num_layers(self) -> int:
        return len(self.specs)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``index``'s K and V block tensors ``[heads, num_blocks + 1, block_size * dim]`` (None: no KV).
        The paged engine reads and writes them in place."""
        return self._layers[index]

    @property
    def scratch_block(self) -> int:
        """A block no cache hands out (id ``num_blocks``): where the engine writes K/V it recomputes for logits
        only (their true K/V already lie in cached blocks). Never read."""
        return self.num_blocks

    @property
    def nbytes(self) -> int:
        """Bytes the pool's ``num_blocks`` blocks hold (the scratch block and gather buffers not counted)."""
        total = 0
        for i, pair in enumerate(self._layers):
            if pair is not None:
                n = self.window_slots if i in self.window_layers else self.num_blocks
                total += sum(t[:, 0].numel() * t.element_size() for t in pair) * n
        return total

    def gather(self, block_ids: Sequence[int], reserve: int = 0) -> list[LayerKV | None]:
        """K, V of ``block_ids`` in order, per layer, each ``[1, heads, len(block_ids) * block_size, dim]``.

        Each result is the leading slice of a gather buffer ``[1, heads, capacity, dim]`` (see ``buffers``)
        with room for at least ``reserve`` more tokens. Changes nothing in the pool.
        """
        t = len(block_ids) * self.block_size
        if t == 0:
            return [None] * len(self.specs)
        bufs = self.buffers(1, t + max(0, int(reserve)))
        out: list[LayerKV | None] = [None if b is None else (b[0][:, :, :t], b[1][:, :, :t]) for b in bufs]
        self.gather_into(block_ids, [None if kv is None else (kv[0][0], kv[1][0]) for kv in out])
        return out

    def buffers(self, batch: int, tokens: int) -> list[LayerKV | None]:
        """Per layer, reusable K and V buffers ``[batch, heads, capacity >= tokens, dim]`` (contents undefined).

        The same memory comes back from later calls (touching fresh memory on every request costs more than
        the copy itself): call ``surrender_buffers()`` before handing anything that lives in them to a caller.
        """
        with _plain_tensors():
            out: list[LayerKV | None] = []
            for layer, spec in enumerate(self.specs):
                if spec is None:
                    out.append(None)
                    continue
                (kh, kd), (vh, vd) = spec.k_shape, spec.v_shape
                out.append(
                    (self._buffer(layer, 0, kh, kd, batch, tokens), self._buffer(layer, 1, vh, vd, batch, tokens))
                )
            return out

    def surrender_buffers(self) -> None:
        """Forget the gather buffers (they now belong to whoever holds their contents); later calls allocate
        new ones."""
        self._scratch = [[None, None] for _ in self.specs]

    def _buffer(self, layer: int, side: int, heads: int, dim: int, batch: int, tokens: int) -> torch.Tensor:
        buf = self._scratch[layer][side]
        old_batch, old_cap = (0, 0) if buf is None else (buf.shape[0], buf.shape[2])
        if batch > old_batch or tokens > old_cap:
            cap = old_cap if tokens <= old_cap else max(tokens, old_cap + old_cap // 2)  # grow by >= 1.5x
            cap = -(-cap // self.block_size) * self.block_size
            buf = torch.empty((max(batch, old_batch), heads, cap, dim), dtype=self.dtype, device=self.device)
            self._scratch[layer][side] = buf
        assert buf is not None
        return buf[:batch]

    def gather_into(self, block_ids: Sequence[int], dst: Sequence[LayerKV | None]) -> None:
        """Copy the K, V of ``block_ids`` into ``dst`` (per layer, ``[heads, n * block_size, dim]`` tensors whose
        last two dims are contiguous, e.g. a row slice of a ``buffers`` result). ONE index_select per layer and
        side. Changes only ``dst``."""
        n = len(block_ids)
        if n == 0:
            return
        with _plain_tensors():
            idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
            widx = idx
            if self.window_layers:
                widx = torch.as_tensor(self.window_ids(block_ids, write=False), device=self.device)
            for layer, pair in enumerate(self._layers):
                target = dst[layer]
                if pair is None or target is None:
                    continue
                use = widx if layer in self.window_layers else idx
                for src, out in zip(pair, target):
                    heads, _, width = src.shape
                    # [heads, n * bs, dim] with contiguous (token, dim) is also [heads, n, bs * dim]
                    torch.index_select(src, 1, use, out=out.view(heads, n, width))

    def scatter(self, block_ids: Sequence[int], kv: Sequence[LayerKV | None]) -> None:
        """Write per-layer K, V (``[1, heads, len(block_ids) * block_size, dim]``) into ``block_ids``.

        Changes the pool: overwrites those blocks in every layer (window layers: in the blocks' slots).
        """
        with _plain_tensors():
            self._scatter(block_ids, kv)

    def scatter_window(self, block_ids: Sequence[int], kv: Sequence[LayerKV | None]) -> None:
        """``scatter`` into the window layers only (blocks that got a window slot after their K/V was cached)."""
        with _plain_tensors():
            self._scatter(block_ids, kv, only_windows=True)

    def _scatter(self, block_ids: Sequence[int], kv: Sequence[LayerKV | None], only_windows: bool = False) -> None:
        n = len(block_ids)
        if n == 0:
            return
        if len(kv) != len(self.specs):
            raise ValueError(f"scatter got KV for {len(kv)} layers, the pool has {len(self.specs)}")
        full_runs = runs(block_ids)
        window_runs = runs(self.window_ids(block_ids, write=True).tolist()) if self.window_layers else full_runs
        t = n * self.block_size
        for layer, pair in enumerate(self._layers):
            if pair is None or (only_windows and layer not in self.window_layers):
                continue
            layer_runs = window_runs if layer in self.window_layers else full_runs
            layer_kv = kv[layer]
            if layer_kv is None:
                raise ValueError(f"scatter: layer {layer} has no KV but the pool stores it")
            for side, dst in enumerate(pair):
                src = layer_kv[side]
                heads, width = dst.shape[0], dst.shape[2]
                dim = width // self.block_size
                if tuple(src.shape) != (1, heads, t, dim):
                    raise ValueError(
                        f"scatter: layer {layer} {'KV'[side]} has shape {tuple(src.shape)}, expected {(1, heads, t, dim)}"
                    )
                src = src[0].to(dtype=self.dtype, device=self.device)
                for first, start, count in layer_runs:  # one copy per run of consecutive block ids
                    part = src[:, start * self.block_size : (start + count) * self.block_size]
                    dst[:, first : first + count].copy_(part.reshape(heads, count, width))


def _plain_tensors() -> torch.inference_mode:
    """Pool tensors must be normal tensors (not inference tensors), whatever mode the caller runs in."""
    return torch.inference_mode(False)


def runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split block ids into runs of consecutive ids: (first id, position in block_ids, length)."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(block_ids):
        b = int(b)
        if runs and runs[-1][0] + runs[-1][2] == b:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((b, pos, 1))
    return runs
