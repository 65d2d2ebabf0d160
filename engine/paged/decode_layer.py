"""A lean layer's step with the Python between its C calls cut to the calls themselves.

On a step of the engine most ops of a Llama-style layer already run in C: the two RMSNorms and the rotary embedding
(``fused``), the seven linears (the small-row kernel, ``linear.SmallPacked``, for a few rows; oneDNN's packed matmul
for more) and the attention (the kernel's decode and prefill paths). What was left was the Python around them:
module lookups, views and transposes, each wrapper's checks and argument lists, the attention function's generic
dispatch. On the ``small`` preset (12 layers, 8 rows decoding over 1,024 tokens, 2 cores) that came to about a
quarter of a bf16 decode step (py-spy; issue 35's note).

``fast_forward(layer)`` gives a function that runs the layer the same way for a step it fits, and returns None for
any other, so the lean forward goes on as before. It fits when no row of the step takes the torch path (SDPA), the
layer is not a window layer and passes no window, the attention implementation is the paged one, the pool holds
this dtype, both norms and the rotary function are the fused ones in place now (``FusedOps.active()``) and the
linears the packed ones (``PackedLinears.active()``). It calls the same functions on the same inputs in the same
order as the lean forward does through the modules, so its outputs are the same bits (tests/test_decode_layer.py
compares them); three calls do more than one module's work without changing a bit: q/k/v and gate/up as one
small-row call each (``_join``), q and k in one rotary call. The new keys and values go in through
``StepBatch.write_kv``, as ``PagedKV.update`` writes them; SiLU and the product stay torch's ops, and the attention is
``attention.paged_attention`` called straight. It keeps the engine's timings: the linears' seconds, the attention's
(and its paths') seconds.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.paged import attention, linear
from engine.paged.attention import ATTENTION_NAME, PagedKV, StepBatch
from engine.paged.fused import ROTARY_NAME, cos_sin_fit

Forward = Callable[[torch.Tensor, Any, tuple[torch.Tensor, torch.Tensor]], "torch.Tensor | None"]
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _norm(module: torch.nn.Module) -> Any:
    """(fused library, norm module) when ``module`` runs the fused RMSNorm now, else None."""
    return getattr(module.__dict__.get("forward"), "fused_norm", None)


def fast_forward(layer: Any, home: Any, window: str | None) -> Forward:
    """The fast path of ``layer`` (a layer ``lean.lean_reason`` accepts; ``home`` its attention's modeling module,
    ``window`` how its attention passes a sliding window: see ``lean.KNOWN_ATTENTION``)."""
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    mods = [getattr(attn, n) for n in _LINEARS[:4]] + [getattr(mlp, n) for n in _LINEARS[4:]]
    head_dim, layer_idx, config = attn.head_dim, attn.layer_idx, attn.config
    clock = time.perf_counter
    joins: dict[str, Any] = {}  # the joined projections (see _joined)

    def forward(x: torch.Tensor, cache: Any, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> Any:
        if (
            torch.is_grad_enabled()
            or type(cache) is not PagedKV
            or x.dim() != 3
            or x.shape[0] != 1
            or not x.is_contiguous()
        ):
            return None
        b: StepBatch = cache.batch
        if b.torch_rows or b.windowed(layer_idx) or config._attn_implementation != ATTENTION_NAME:
            return None  # torch rows: SDPA over the queries as the module calls lay them out
        if window == "module" and attn.sliding_window is not None:
            return None
        if window == "config" and getattr(config, "sliding_window", None) is not None:
            return None
        pair = b.pool.layer(layer_idx)
        if pair is None or hasattr(attn, "expand_kv"):
            return None
        if b.slots.numel() != x.shape[1]:
            return None
        kpool, vpool = pair
        dtype, t, n = x.dtype, x.shape[1], x.shape[2]
        if kpool.dtype != dtype or dtype not in (torch.float32, torch.bfloat16):
            return None
        packed = [m.__dict__.get("forward") for m in mods]
        if any(getattr(f, "small_for", None) is None for f in packed):
            return None  # the linears are not the engine's packed ones now
        norms = (_norm(norm1), _norm(norm2))
        rot_lib = getattr(getattr(home, ROTARY_NAME, None), "fused_lib", None)
        if norms[0] is None or norms[1] is None or rot_lib is None:
            return None
        cos, sin = position_embeddings
        if not cos_sin_fit(cos, sin, 1, t, head_dim, dtype):
            return None
        for _lib, m in norms:
            if m.weight.dtype != dtype or m.weight.shape != (n,) or not m.weight.is_contiguous():
                return None
        hkv = kpool.shape[0]
        nq, nk, nv = (getattr(m, "out_features", -1) for m in mods[:3])
        if nk != hkv * head_dim or nv != nk or nq % head_dim or (nq // head_dim) % hkv:
            return None
        if kpool.shape[2] != b.pool.block_size * head_dim or vpool.shape != kpool.shape:
            return None
        hq = nq // head_dim
        bf = int(dtype == torch.bfloat16)
        threads = torch.get_num_threads()
        use = packed[0].use
        smalls = [f.small_for(t) for f in packed]  # the small-row kernel's, or None: the packed forward (oneDNN)
        sq, sk, sv, so, sg, su, sd = smalls
        mq, mk, mv, mo, mg, mu, md = mods
        qkv = _joined(joins, "qkv", (sq, sk, sv)) if sq and sk and sv else None
        gate_up = _joined(joins, "gate_up", (sg, su)) if sg and su else None

        def linear(small: Any, module: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
            """``h`` [T, K] through the small-row kernel, timed into ``use``; else the module's packed forward
            (which times itself)."""
            if small is not None:
                t0 = clock()
                y = small(h)
                if y is not None:
                    use.seconds += clock() - t0
                    return y  # type: ignore[no-any-return]
            return module.forward(h.unsqueeze(0))[0]  # type: ignore[no-any-return]  # as the lean forward calls it

        def norm(which: int, h: torch.Tensor) -> torch.Tensor:
            lib, m = norms[which]
            out = torch.empty_like(h)
            lib.fused_rms_norm(h.data_ptr(), n, m.weight.data_ptr(), out.data_ptr(), n, t, n, m.variance_epsilon, bf,
                               threads)  # fmt: skip
            return out

        # LlamaAttention.forward, its linears over the [T, hidden] rows
        rows = x[0]
        h = norm(0, rows)
        y = linear(qkv, mq, h) if qkv is not None else None  # None: qkv declined, mq's packed forward not called
        if y is not None and y.shape[1] == nq + nk + nv:  # one call: the three outputs side by side in y's rows
            q, k, v = torch.split(y, [nq, nk, nv], dim=1)
        else:
            y = None
            q, k, v = linear(sq, mq, h), linear(sk, mk, h), linear(sv, mv, h)
        cs = (ctypes.c_int64 * 2)(0 if cos.shape[0] == 1 else cos.stride(0), cos.stride(1))
        if y is not None:  # q and k side by side in y's rows: one rotary call over their heads together
            both = _rotary(rot_lib, y, cos, sin, cs, hq + hkv, t, head_dim, bf, threads)
            qr, kr = both[:, :hq], both[:, hq:]  # [T, Hq, D] and [T, Hkv, D]
        else:
            qr = _rotary(rot_lib, q, cos, sin, cs, hq, t, head_dim, bf, threads)
            kr = _rotary(rot_lib, k, cos, sin, cs, hkv, t, head_dim, bf, threads)
        # PagedKV.update: the new keys and values into the pool at the batch's slots
        b.write_kv(layer_idx, kr.transpose(0, 1), v.view(t, hkv, head_dim).transpose(0, 1))
        # the attention function itself (a direct call of the decode path saved 0.6-1.1% of a decode step more)
        out = attention.paged_attention(attn, qr.transpose(0, 1).unsqueeze(0), kr, v, None, 0.0, attn.scaling)[0][0]
        o = linear(so, mo, out.reshape(t, hq * head_dim))
        hidden = rows + o
        # LlamaMLP.forward: down(act(gate(x)) * up(x)), SiLU and the product in place as the lean forward does
        h = norm(1, hidden)
        y = linear(gate_up, mg, h) if gate_up is not None else None
        if y is not None and y.shape[1] == sg.n + su.n:
            g, u = torch.split(y, [int(sg.n), int(su.n)], dim=1)
        else:
            g, u = linear(sg, mg, h), linear(su, mu, h)
        if not torch.is_grad_enabled() and g.dtype == u.dtype and g.shape == u.shape:
            act = F.silu(g, inplace=True).mul_(u)
        else:
            act = mlp.act_fn.forward(g) * u
        d = linear(sd, md, act)
        return (hidden + d).unsqueeze(0)

    return forward


def _join(parts: tuple[Any, ...]) -> Any:
    """Projections of one input as one ``SmallPacked`` (one small-row kernel call): their packed weights lie back to
    back in one buffer (``linear._into_huge_pages`` copies them so, in the model's order), so the blocks of 16 outputs
    of all of them are one packed weight of their summed outputs. Each block's sums run over k in order whatever the
    other blocks (``_small_linear.c``), so every output is the bits its own call gives."""
    first = parts[0]
    numel = sum(p.weight.numel() for p in parts)
    weight = first.weight.as_strided((numel,), (1,), first.weight.storage_offset())  # all of them, in that buffer
    bias = None if first.bias is None else torch.cat([p.bias for p in parts])
    return linear.SmallPacked(first.fn, weight, bias, sum(p.n for p in parts), first.k, first.rows)


def _joinable(parts: tuple[Any, ...]) -> bool:
    """Whether ``parts`` (SmallPacked) can run as one call: one kernel, input width and dtype, all with a bias or
    none, and their packed weights back to back in one buffer."""
    first = parts[0]
    if any(p.fn is not first.fn or p.k != first.k or p.weight.dtype != first.weight.dtype for p in parts):
        return False
    if len({p.bias is None for p in parts}) != 1 or not all(p.weight.is_contiguous() for p in parts):
        return False
    buffer = first.weight.untyped_storage().data_ptr()
    at = first.weight.data_ptr()
    for p in parts:
        if p.weight.data_ptr() != at or p.weight.untyped_storage().data_ptr() != buffer:
            return False
        at += p.weight.numel() * p.weight.element_size()
    return True


def _joined(joins: dict[str, Any], name: str, parts: tuple[Any, ...]) -> Any:
    """The joined ``SmallPacked`` of ``parts`` (made again only when they change: ``PackedLinears.repack``), or None
    where they cannot join; ``joins`` keeps the last one under ``name``."""
    key = tuple(id(p) for p in parts)
    had = joins.get(name)
    if had is None or had[0] != key:
        had = joins[name] = (key, _join(parts) if _joinable(parts) else None, parts)  # parts: their ids stay theirs
    return had[1]


def _rotary(
    lib: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cs: Any, heads: int, t: int, d: int, bf: int,
    threads: int,
) -> torch.Tensor:  # fmt: skip
    """``fused.rotary`` of the projection rows ``x`` [T, heads * d] (rows contiguous, any row stride) seen as
    [1, heads, T, d]: [T, heads, d]."""
    out = torch.empty((t, heads, d), dtype=x.dtype)
    ld = x.stride(0)  # x's rows may be a slice of wider ones (the joined projections')
    xs = (ctypes.c_int64 * 3)(t * ld, d, ld)  # [1, heads, T, d] token-major, as out
    os = (ctypes.c_int64 * 3)(t * heads * d, d, heads * d)
    rc = lib.fused_rotary(x.data_ptr(), xs, cos.data_ptr(), sin.data_ptr(), cs, out.data_ptr(), os, 1, heads, t, d,
                          bf, threads)  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"fused_rotary returned {rc}")
    return out
