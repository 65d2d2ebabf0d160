"""Attention over the KV pool through block tables, plugged into transformers' ``AttentionInterface``.

One forward runs a flat batch (``StepBatch``): the new tokens of several sequences one after the other, each
sequence a row with its block table (the pool blocks holding its keys and values, in order), its length after
this step and how many of its tokens are new. The model runs on its own modeling code; two things are ours:

* ``PagedKV`` stands in for its cache: ``update`` writes each layer's new keys and values into the pool at the
  rows' slots (one ``index_copy_`` per side) and hands them back;
* the attention function ``paged_attention`` (registered as ``ATTENTION_NAME``) reads each row's keys and values
  from the pool where they lie: rows with few new tokens (decoding) through the C kernel, in place; rows with
  several in steps of several rows (prefill chunks beside decoding rows, a CPU with AVX-512 or AVX2 and FMA;
  bf16 with AVX512-BF16) through the kernel's prefill path, in place too; other rows with many (a prompt alone in its step),
  or where the kernel is unavailable, gathered and run through SDPA (or, with a logit soft-cap, the eager formula).

The model computes no mask (transformers makes none for an attention implementation it has no mask function
for): causality, sliding windows and the rows' boundaries come from the batch.
"""

from __future__ import annotations

import contextvars
import ctypes
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F

from engine.kv_pool import KVPool
from engine.paged import kernel

ATTENTION_NAME = "prefixcache_paged"
KERNEL_MAX_QUERIES = 16  # rows with at most this many new tokens go through the C kernel (bench_agent_attention)
KERNEL_SPLIT = 512  # the kernel's online softmax runs over splits of this many keys, as torch's flash attention does
KERNEL_BF16 = True  # bf16 pools: the kernel serves steps of several rows (a lone row keeps SDPA, bit for bit)
PREFILL_BF16 = True  # ... and its rows of several new tokens by AVX512-BF16 dot products (bench_agent_attention)
PREFILL_MIN_QUERIES = 4  # bf16 rows with at least this many new tokens take that prefill path (faster from 4 on)
PREFILL_F32 = True  # float32 rows of several new tokens in steps of several rows: the kernel's fp32 prefill path
PREFILL_MIN_QUERIES_F32 = 4  # ... from this many new tokens (bench_agent_attention); a lone row keeps SDPA
# the prefill path's 8-lane build (AVX2, no AVX-512) takes rows of at most this many new tokens; longer ones go to the
# torch path, which was faster in place there (Zen 3, fp32 agent shape, engine only: x0.90 req/s with every row on
# the prefill path; one chunk of 16 / 32 / 64 / 256 over 1,536 cached: 1.6 / 2.8 / 4.7-5.4 / 15.5 ms against SDPA's
# 2.2 / 3.2 / 4.7-5.9 / 12.5-14 ms, bench_agent_attention)
PREFILL_MAX_QUERIES_8LANE = 32
TWO_QUERIES_BF16 = True  # a bf16 decoding row on the torch path beside other rows runs SDPA on its query twice

_current: contextvars.ContextVar[StepBatch | None] = contextvars.ContextVar("prefixcache_step", default=None)


@dataclass
class Row:
    """One sequence of a step: ``q_len`` new tokens at positions ``kv_len - q_len .. kv_len - 1`` (the flat
    batch's tokens ``q_start ..``); ``blocks`` holds its keys and values, block i = positions i*bs .. .
    Positions below ``fresh_from`` are recomputed for their logits only: their K/V already lie in ``blocks``
    (cached, perhaps shared), so what the forward makes of them goes to the pool's scratch block."""

    q_start: int
    q_len: int
    kv_len: int
    blocks: Sequence[int]
    fresh_from: int = 0


@dataclass(frozen=True)
class KernelRows:
    """Rows of a step as the C kernel reads them: block tables padded with zeros ([R, max_blocks] int32; the
    window layers' slots in ``window_tables`` when the pool has window layers) and per row its first token in the
    flat batch, its new tokens and its length ([R] int32)."""

    tables: torch.Tensor
    window_tables: torch.Tensor | None
    q_start: torch.Tensor
    q_len: torch.Tensor
    kv_len: torch.Tensor

    @classmethod
    def of(cls, batch: StepBatch, which: list[int]) -> KernelRows | None:
        """The arrays of ``batch``'s rows ``which`` (None for no rows)."""
        if not which:
            return None
        rows = batch.rows
        width = max(len(rows[i].blocks) for i in which)
        table = torch.zeros((len(which), width), dtype=torch.int32)
        for j, i in enumerate(which):
            b = rows[i].blocks
            table[j, : len(b)] = torch.as_tensor(list(b), dtype=torch.int32)
        wtable = None
        if batch.pool.window_layers:
            wtable = torch.zeros((len(which), width), dtype=torch.int32)
            for j, i in enumerate(which):
                wb = batch.window_blocks[i]
                wtable[j, : len(wb)] = torch.as_tensor(wb, dtype=torch.int32)

        def ints(name: str) -> torch.Tensor:
            return torch.tensor([getattr(rows[i], name) for i in which], dtype=torch.int32)

        return cls(table, wtable, ints("q_start"), ints("q_len"), ints("kv_len"))


@dataclass
class StepBatch:
    """The metadata of one flat forward over ``pool``; built by ``StepBatch.make``. Tensors live on the pool's
    device; ``layer`` is the pool layer the model updated last (attention reads that one)."""

    pool: KVPool
    rows: list[Row]
    slots: torch.Tensor  # [T] long: the pool slot (block * block_size + offset) of every new token
    positions: torch.Tensor  # [T] long
    kernel_rows: list[int]  # rows attended by the C kernel's decode path
    torch_rows: list[int]  # rows attended by the torch path
    prefill_rows: list[int] = field(default_factory=list)  # rows attended by the C kernel's prefill path
    kernel: KernelRows | None = None  # the kernel rows as the kernel reads them
    prefill: KernelRows | None = None  # the prefill rows likewise
    layer: int = -1
    attention_s: float = 0.0  # seconds spent in paged_attention for this batch (all layers)
    # of which, inside the C kernel's calls (all layers), and the work they did: the decode path's seconds and the
    # cached K/V bytes its queries read (each query's keys once), the prefill path's seconds and FLOPs (q.k and p.v)
    decode_path_s: float = 0.0
    decode_path_bytes: int = 0
    prefill_path_s: float = 0.0
    prefill_path_flops: int = 0
    latent_out: torch.Tensor | None = None  # the last multi-head latent attention's output
    top_slot: int = -1  # the largest of ``slots`` (-1: none)
    # a pool with window layers (``KVPool.window_layers``): their slots for the new tokens, and per row the slots
    # of its blocks (a block without one reads zeros: out of every new token's window)
    window_slots: torch.Tensor | None = None
    window_blocks: list[list[int]] = field(default_factory=list)
    _masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _capped: tuple[list[int], list[int], KernelRows | None] | None = None  # see capped_prefill

    @classmethod
    def make(cls, pool: KVPool, rows: list[Row], *, use_kernel: bool = True) -> StepBatch:
        """The batch of ``rows`` (their tokens in that order). Checks that every row's blocks cover its length."""
        bs = pool.block_size
        slots: list[int] = []
        positions: list[int] = []
        at = 0
        for r in rows:
            if r.q_start != at or r.q_len < 1 or r.kv_len < r.q_len:
                raise ValueError(f"StepBatch: bad row {r} (tokens so far: {at})")
            if len(r.blocks) * bs < r.kv_len:
                raise ValueError(f"StepBatch: {len(r.blocks)} blocks cannot hold {r.kv_len} tokens")
            first = r.kv_len - r.q_len
            scratch = pool.scratch_block * bs
            for p in range(first, r.kv_len):
                slots.append(int(r.blocks[p // bs]) * bs + p % bs if p >= r.fresh_from else scratch + p % bs)
            positions.extend(range(first, r.kv_len))
            at += r.q_len
        device = pool.device
        lib = kernel.load() if use_kernel and device.type == "cpu" and _kernel_dtype(pool.dtype, len(rows)) else None
        least = _prefill_from(lib, pool.dtype, len(rows))
        most = PREFILL_MAX_QUERIES_8LANE if lib is not None and kernel.prefill_8lane(lib) else math.inf
        prows, krows, trows = [], [], []  # each row to one path: the prefill path, the decode path, or torch
        for i, r in enumerate(rows):
            if least <= r.q_len <= most:
                prows.append(i)
            elif lib is not None and r.q_len <= KERNEL_MAX_QUERIES:
                krows.append(i)
            else:
                trows.append(i)
        batch = cls(
            pool,
            rows,
            torch.tensor(slots, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            krows,
            trows,
            prows,
        )
        batch.top_slot = max(slots, default=-1)
        if pool.window_layers:
            batch._windows(rows)
        batch.kernel = KernelRows.of(batch, krows)
        batch.prefill = KernelRows.of(batch, prows)
        return batch

    def _windows(self, rows: list[Row]) -> None:
        """The window layers' slots of the rows' blocks and new tokens (``KVPool.window_ids``). A new token whose
        block has no slot is a bug upstream (its K/V would be lost): raises."""
        pool, bs = self.pool, self.pool.block_size
        slots: list[int] = []
        scratch = pool.window_slots * bs
        for r in rows:
            read = pool.window_ids(list(r.blocks), write=False).tolist()
            self.window_blocks.append(read)
            first = r.kv_len - r.q_len
            for p in range(first, r.kv_len):
                if p < r.fresh_from:
                    slots.append(scratch + p % bs)
                    continue
                s = read[p // bs]
                if s >= pool.window_slots:
                    raise RuntimeError(f"paged step: block {r.blocks[p // bs]} (token {p}) has no window slot")
                slots.append(s * bs + p % bs)
        self.window_slots = torch.tensor(slots, dtype=torch.long, device=pool.device)

    def capped_prefill(self) -> tuple[list[int], list[int], KernelRows | None]:
        """The prefill rows split for a soft-capped model, whose scores the prefill path does not cap: those the
        decode path serves (at most ``KERNEL_MAX_QUERIES`` new tokens) with their arrays, and the longer ones (the
        torch path), as they went before the prefill path. Made once per step, for every layer."""
        if self._capped is None:
            short = [i for i in self.prefill_rows if self.rows[i].q_len <= KERNEL_MAX_QUERIES]
            long = [i for i in self.prefill_rows if self.rows[i].q_len > KERNEL_MAX_QUERIES]
            self._capped = (short, long, KernelRows.of(self, short))
        return self._capped

    def pairs(self, which: Sequence[int], window: int) -> int:
        """(query, key) pairs that rows ``which`` attend: each new token over the keys up to it (within ``window``)."""
        n = 0
        for i in which:
            r = self.rows[i]
            first = r.kv_len - r.q_len  # keys before the row's first new token
            if window <= 0:
                n += r.q_len * first + r.q_len * (r.q_len + 1) // 2
            else:  # the query at position p sees min(p + 1, window) keys: x = p + 1 over [first + 1, kv_len]
                lo, hi = first + 1, min(r.kv_len, window)
                n += (lo + hi) * (hi - lo + 1) // 2 if hi >= lo else 0
                n += window * max(0, r.kv_len - max(first, window))
        return n

    def write_kv(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write layer ``layer_idx``'s new keys and values ([heads, T, dim] each, any strides) into the pool at the
        batch's slots (a window layer's: its window slots), and make it the layer attention reads. On the CPU, K and
        V alike in shape and dtype and the slots inside the pool: one ``kv_write`` call (``_fused_ops.c``, a plain
        copy) for both; otherwise ``index_copy_`` per side."""
        pair = self.pool.layer(layer_idx)
        if pair is None:
            raise RuntimeError(f"paged forward: layer {layer_idx} has no KV in the pool")
        windowed = self.windowed(layer_idx)
        slots = self.window_slots if windowed else self.slots
        assert slots is not None
        kp, vp = pair
        bs = self.pool.block_size
        lib = None
        if (
            not windowed  # (window slots: no bound kept for them here)
            and kp.device.type == "cpu"
            and kp.shape == vp.shape
            and key.shape == value.shape == (kp.shape[0], slots.numel(), kp.shape[2] // bs)
            and key.dtype == value.dtype == kp.dtype == vp.dtype
            and key.stride(2) == value.stride(2) == 1
            and 0 <= self.top_slot < kp.shape[1] * bs
        ):
            lib = kernel.load_fused()
        if lib is not None:
            lib.kv_write(key.data_ptr(), key.stride(1), key.stride(0), value.data_ptr(), value.stride(1),
                         value.stride(0), kp.data_ptr(), vp.data_ptr(), kp.shape[1] * kp.shape[2], slots.data_ptr(),
                         slots.numel(), kp.shape[0], key.shape[2], kp.element_size())  # fmt: skip
        else:
            for src, dst in zip((key, value), pair):
                heads, _, width = dst.shape
                dst.view(heads, -1, width // bs).index_copy_(1, slots, src.to(dst.dtype))
        self.layer = layer_idx

    def windowed(self, layer: int) -> bool:
        """Whether pool layer ``layer`` is a window layer (read and written through window slots)."""
        return layer in self.pool.window_layers

    @property
    def num_tokens(self) -> int:
        return int(self.slots.shape[0])

    def mask(self, row: int, window: int) -> torch.Tensor:
        """Boolean [q_len, kv_len] mask of ``row`` (True: attend): causal, and within ``window`` (0: no window)."""
        key = (row, window)
        m = self._masks.get(key)
        if m is None:
            r = self.rows[row]
            device = self.pool.device
            q_pos = torch.arange(r.kv_len - r.q_len, r.kv_len, device=device)[:, None]
            k_pos = torch.arange(r.kv_len, device=device)[None, :]
            m = k_pos <= q_pos
            if window > 0:
                m &= k_pos > q_pos - window
            self._masks[key] = m
        return m


def _prefill_from(lib: ctypes.CDLL | None, dtype: torch.dtype, rows: int) -> float:
    """The fewest new tokens a row of a step of ``rows`` rows needs to take the kernel's prefill path (infinity:
    none does). bfloat16: ``PREFILL_MIN_QUERIES`` (the kernel serves bf16 steps of several rows only, see
    ``_kernel_dtype``). float32: ``PREFILL_MIN_QUERIES_F32``, in steps of several rows too: a lone row's prefill keeps
    SDPA, bit for bit the bare model's (a prompt scored alone), as its chunks beside other rows were before."""
    if lib is None or not kernel.prefill_available(lib, dtype):
        return math.inf
    if dtype == torch.bfloat16 and PREFILL_BF16:
        return PREFILL_MIN_QUERIES
    if dtype == torch.float32 and PREFILL_F32 and rows > 1:
        return PREFILL_MIN_QUERIES_F32
    return math.inf


def _kernel_dtype(dtype: torch.dtype, rows: int) -> bool:
    """Whether the C kernel serves a step of ``rows`` rows over a pool of ``dtype``. float32: always. bfloat16: in
    steps of several rows (``KERNEL_BF16``), where the linears, computing the rows together, already differ from the
    bare model's one-row decode by bf16 rounding (benchmarks/bench_bf16_decode.py); the kernel follows torch's
    flash-attention arithmetic (bf16 probabilities, fp32 sums) and adds nothing measurable to that. A row alone
    in its step keeps torch's SDPA: bit for bit the bare model's."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and KERNEL_BF16 and rows > 1)


class PagedKV:
    """What the model sees as its cache during a paged forward: ``update`` writes new K/V into the pool."""

    is_compileable = False

    def __init__(self, batch: StepBatch) -> None:
        self.batch = batch

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new keys and values ([1, heads, T, dim]) into the pool at the batch's slots."""
        self.batch.write_kv(layer_idx, key_states[0], value_states[0])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class use_batch:
    """Context manager: ``batch`` is the step that ``paged_attention`` serves inside it."""

    def __init__(self, batch: StepBatch) -> None:
        self.batch = batch

    def __enter__(self) -> StepBatch:
        self._token = _current.set(self.batch)
        return self.batch

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._token)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: attention of the step's queries ([1, Hq, T, D]) over every row's keys
    and values in the pool. Returns [1, T, Hq, D] (as transformers' attention functions do)."""
    t0 = time.perf_counter()
    b = _current.get()
    if b is None:
        raise RuntimeError(
            f"the {ATTENTION_NAME!r} attention runs only inside a paged forward (engine.paged.runner); "
            "this model's attention implementation was left switched to it"
        )
    pair = b.pool.layer(b.layer)
    assert pair is not None
    kpool, vpool = pair
    if hasattr(module, "expand_kv"):  # multi-head latent attention: the pool holds the latents, not K/V
        if b.windowed(b.layer):
            raise RuntimeError("paged attention: latent attention layers in a window group are not supported")
        _latent_attention(b, module, query, kpool, vpool, scaling, sliding_window)
        b.attention_s += time.perf_counter() - t0
        assert b.latent_out is not None
        return b.latent_out, None
    _, hq, t, dim = query.shape
    hkv = kpool.shape[0]
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(dim)
    cap = float(softcap) if softcap else 0.0
    window = int(sliding_window) if sliding_window else 0
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    out = torch.empty((t, hq, dim), dtype=query.dtype, device=query.device)
    if b.kernel_rows or b.prefill_rows:
        _kernel_attention(b, q, kpool, vpool, hkv, scale, cap, window, out)
    for i in b.torch_rows:
        _torch_attention(b, i, q, kpool, vpool, hkv, scale, cap, window, out)
    b.attention_s += time.perf_counter() - t0
    return out.unsqueeze(0), None


def _latent_attention(
    b: StepBatch,
    module: torch.nn.Module,
    query: torch.Tensor,
    kpool: torch.Tensor,
    vpool: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None,
) -> None:
    """Multi-head latent attention (DeepSeek-V3, GLM-4-MoE-Lite, Kimi Linear): transformers caches the compressed
    latents (``cache.update(kv_nope, k_rot)``) and expands them per head with the module's ``expand_kv`` only
    afterwards, so here each row's latents are gathered from the pool and expanded the module's own way, then
    attended with SDPA over the row's mask. Sets ``b.latent_out`` ([1, T, Hq, Dv])."""
    bs = b.pool.block_size
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    window = int(sliding_window) if sliding_window else 0
    t = query.shape[2]
    expand = cast("Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]", module.expand_kv)
    out: torch.Tensor | None = None
    for i, r in enumerate(b.rows):
        latent = _gather(kpool, r.blocks, r.kv_len, bs)[None].to(query.dtype)  # [1, 1, kv_len, rank]
        rope = _gather(vpool, r.blocks, r.kv_len, bs)[None].to(query.dtype)  # [1, 1, kv_len, rope dim]
        k, v = expand(latent, rope)  # [1, H, kv_len, dk], [1, H, kv_len, dv]
        qi = query[:, :, r.q_start : r.q_start + r.q_len]
        res = F.scaled_dot_product_attention(qi, k, v, attn_mask=b.mask(i, window), scale=scale)
        if out is None:
            out = torch.empty((t, query.shape[1], v.shape[-1]), dtype=query.dtype, device=query.device)
        out[r.q_start : r.q_start + r.q_len] = res[0].transpose(0, 1)
    assert out is not None
    b.latent_out = out.unsqueeze(0)


def _kernel_attention(
    b: StepBatch,
    q: torch.Tensor,
    kpool: torch.Tensor,
    vpool: torch.Tensor,
    hkv: int,
    scale: float,
    cap: float,
    window: int,
    out: torch.Tensor,
) -> None:
    """Attention of the batch's kernel rows (the decode path) and prefill rows (its prefill path) through the
    C kernel, into ``out``; rows it does not serve (a bf16 soft-cap, a shape beyond its limits) take the torch path."""
    lib = kernel.load()
    assert lib is not None
    bf16 = kpool.dtype == torch.bfloat16
    fallback: list[int] = []
    done: list[int] = []  # rows whose results are in ``res``
    qf: torch.Tensor | None = None
    res = out
    for which, arrays, prefill in ((b.kernel_rows, b.kernel, False), (b.prefill_rows, b.prefill, True)):
        if not which:
            continue
        assert arrays is not None
        if (bf16 and cap) or (prefill and q.dtype != kpool.dtype):
            # bf16 soft-capped scores: the torch path's eager formula (bf16 scores), not fp32 ones; the prefill path
            # takes queries of the pool's dtype only (bf16 ones it reads as bf16 pairs)
            fallback += which
            continue
        if prefill and cap:  # the fp32 prefill path takes no soft-cap (capped_prefill)
            which, long, capped = b.capped_prefill()
            fallback += long
            if capped is None:
                continue
            arrays, prefill = capped, False
        if qf is None:
            qf = q if q.dtype == torch.float32 else q.float()
            if qf.stride(2) != 1:
                qf = qf.contiguous()
            if out.dtype != torch.float32:
                res = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        tables = arrays.window_tables if b.windowed(b.layer) else arrays.tables
        assert tables is not None
        threads = torch.get_num_threads()
        args = [
            ctypes.c_void_p(qf.data_ptr()),
            qf.stride(0),
            qf.stride(1),
            ctypes.c_void_p(kpool.data_ptr()),
            ctypes.c_void_p(vpool.data_ptr()),
            kpool.shape[1],
            b.pool.block_size,
            q.shape[2],
            hkv,
            q.shape[1],
            ctypes.c_void_p(tables.data_ptr()),
            tables.shape[1],
            ctypes.c_void_p(arrays.q_start.data_ptr()),
            ctypes.c_void_p(arrays.q_len.data_ptr()),
            ctypes.c_void_p(arrays.kv_len.data_ptr()),
            len(which),
            scale,
            cap,
            window,
            KERNEL_SPLIT,
            ctypes.c_void_p(res.data_ptr()),
            threads,
        ]
        t0 = time.perf_counter()
        if prefill:
            scratch = _scratch(threads * int(lib.paged_prefill_scratch(q.shape[2], KERNEL_SPLIT)))
            rc = (lib.paged_prefill_bf16 if bf16 else lib.paged_prefill_f32)(
                *args, ctypes.c_void_p(scratch.data_ptr()), scratch.numel()
            )
        else:
            rc = (lib.paged_attention_bf16 if bf16 else lib.paged_attention_f32)(*args)
        took = time.perf_counter() - t0
        if rc != 0:  # shapes beyond the kernel's limits: the torch path for these rows
            fallback += which
            continue
        done += which
        pairs = b.pairs(which, window)
        if prefill:
            b.prefill_path_s += took
            b.prefill_path_flops += 4 * pairs * q.shape[1] * q.shape[2]
        else:
            b.decode_path_s += took
            b.decode_path_bytes += 2 * pairs * hkv * q.shape[2] * kpool.element_size()
    if res is not out:  # float32 results of these rows into the output's dtype (nearest even)
        if len(done) == len(b.rows):  # every row (a step's usual case): one copy, not one per row
            out.copy_(res)
        else:
            for i in done:
                r = b.rows[i]
                out[r.q_start : r.q_start + r.q_len] = res[r.q_start : r.q_start + r.q_len]
    for i in fallback:
        _torch_attention(b, i, q, kpool, vpool, hkv, scale, cap, window, out)


_scratch_of = threading.local()


def _scratch(nbytes: int) -> torch.Tensor:
    """This thread's scratch for the prefill path: at least ``nbytes`` bytes, kept (and grown) between calls."""
    buf: torch.Tensor | None = getattr(_scratch_of, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        _scratch_of.buf = buf
    return buf


def _gather(pool_side: torch.Tensor, blocks: Sequence[int], length: int, block_size: int) -> torch.Tensor:
    """[heads, length, dim] keys or values of one row, copied out of the pool."""
    heads, num, width = pool_side.shape
    idx = torch.as_tensor(list(blocks), dtype=torch.long, device=pool_side.device)
    if heads > 1 and pool_side.is_contiguous():  # one row per (head, block) of a 2-D view: dim-0 index_select
        idx = (torch.arange(0, heads * num, num, device=idx.device)[:, None] + idx).reshape(-1)  # copies rows whole,
        got = pool_side.view(heads * num, width).index_select(0, idx)  # about 1.8x faster than along dim 1
    else:
        got = pool_side.index_select(1, idx)
    return got.view(heads, -1, width // block_size)[:, :length]


def _torch_attention(
    b: StepBatch,
    i: int,
    q: torch.Tensor,
    kpool: torch.Tensor,
    vpool: torch.Tensor,
    hkv: int,
    scale: float,
    cap: float,
    window: int,
    out: torch.Tensor,
) -> None:
    r = b.rows[i]
    bs = b.pool.block_size
    blocks = b.window_blocks[i] if b.windowed(b.layer) else r.blocks
    k = _gather(kpool, blocks, r.kv_len, bs)
    v = _gather(vpool, blocks, r.kv_len, bs)
    qi = q[r.q_start : r.q_start + r.q_len].transpose(0, 1)  # [Hq, q_len, D]
    hq = qi.shape[0]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=0)
        v = v.repeat_interleave(hq // hkv, dim=0)
    k, v = k.to(qi.dtype), v.to(qi.dtype)
    mask = b.mask(i, window)
    if cap:
        scores = torch.matmul(qi, k.transpose(1, 2)) * scale
        scores = torch.tanh(scores / cap) * cap
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qi.dtype)
        res = torch.matmul(probs, v)
    elif TWO_QUERIES_BF16 and r.q_len == 1 and len(b.rows) > 1 and qi.dtype == torch.bfloat16 and qi.is_cpu:
        # torch's CPU flash attention takes a slow path for one bf16 query (3.5x the time of two, on 2,000 keys);
        # the query twice takes the fast one: the same arithmetic but for the order of some fp32 sums (about 3 in
        # 10,000 outputs differ by one bf16 ulp). Only in a step of several rows: there the linears (several rows
        # at once) already differ from the bare model's one-row decode by bf16 rounding, by as much
        # (benchmarks/bench_bf16_decode.py); a lone row stays the bare model's bit for bit
        two = torch.cat([qi, qi], dim=1)
        res = F.scaled_dot_product_attention(two[None], k[None], v[None], attn_mask=mask.expand(2, -1), scale=scale)
        res = res[0, :, :1]
    else:
        res = F.scaled_dot_product_attention(qi[None], k[None], v[None], attn_mask=mask, scale=scale)[0]
    out[r.q_start : r.q_start + r.q_len] = res.transpose(0, 1)
