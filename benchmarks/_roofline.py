"""A roofline for the engine's forward: the FLOPs a step's forward does, against what the engine's own linears reach
here; and the bytes a decode step moves, against what this machine's memory delivers.

``forward_flops`` counts a forward's floating-point operations from the model's shapes: 2 per weight of every
``nn.Linear`` below the output head per computed token, 2 per weight of the output head per row whose logits are
taken, and 4 * layers * (query heads x head dim) per (query token, key) pair of attention (QK^T and PV).
``linear_gflops`` times the engine's linears (``PackedLinears``: oneDNN over weights packed once, the small-row kernel
for the row counts it takes) at given (m, k, n) shapes on this machine's threads, in the model's dtype: at the shapes
of a step's linears it is the matmul peak that step could reach; at a large square shape, the machine's peak.
``mm_gflops`` times ``torch.mm`` the same way, for reference only: on this AMD CPU torch's fp32 ``mm`` (MKL) runs at
about half of oneDNN's fp32 rate, so it is no peak (its bf16 rate is oneDNN's).
``stream_gbs`` measures the achievable memory bandwidth STREAM-style (a sum over, and a copy of, arrays far larger
than the caches, on torch's threads); ``decode_bytes`` counts what a decode step must read: every linear's weights
(the output head's included) once, and each row's cached K/V.
``forward_floor`` bounds a run's forwards from below: each step's linears at the linears' large-shape peak or at one
read of the weights (the longer), prefill attention at that peak, the decoding tokens' cached K/V read once at the read
bandwidth, everything else free.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from engine.paged import kernel
from engine.paged.linear import PackedLinears, linears, onednn_refuses, small_rows_range


def linear_shapes(model: Any) -> tuple[list[tuple[int, int]], int]:
    """(in, out) of every ``nn.Linear`` below the output head, one entry per layer's linear (``linears``: the ones
    the engine packs), and the head's weights."""
    head = model.get_output_embeddings()
    shapes = [(m.in_features, m.out_features) for m in linears(model) if m is not head]
    return shapes, int(head.weight.numel()) if head is not None else 0


def forward_flops(model: Any, tokens: int, logit_rows: int, attention_pairs: int) -> float:
    """FLOPs of forwards that computed ``tokens`` tokens, took ``logit_rows`` rows of logits and attended over
    ``attention_pairs`` (query token, key) pairs in every attention layer."""
    shapes, head = linear_shapes(model)
    cfg = model.config.get_text_config(decoder=True)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    layers = int(cfg.num_hidden_layers)
    linear = 2.0 * sum(i * o for i, o in shapes) * tokens
    return linear + 2.0 * head * logit_rows + 4.0 * layers * heads * head_dim * attention_pairs


def mm_gflops(shapes: list[tuple[int, int, int]], min_s: float = 0.2, dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of ``torch.mm`` over ``shapes`` (m, k, n) in ``dtype``, each run for at least ``min_s`` after a
    warm-up."""
    flops = seconds = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        torch.mm(a, b)
        reps, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < min_s:
            torch.mm(a, b)
            reps += 1
        flops += 2.0 * m * k * n * reps
        seconds += elapsed
    return flops / seconds / 1e9


def linear_gflops(shapes: list[tuple[int, int, int]], min_s: float = 0.2, dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of the engine's packed linears (``PackedLinears``, as a forward uses them) over ``shapes`` (m, k, n):
    ``m`` rows of ``k`` inputs into ``n`` outputs, in ``dtype``, each run for at least ``min_s`` after a warm-up.
    Where oneDNN cannot pack ``dtype`` here (bf16 without AVX-512), the small-row kernel alone, or ``nn.Linear``
    where that has no build for it either, as the engine then runs them."""
    packs = onednn_refuses(dtype) is None or small_rows_range(kernel.load_small_linear(), dtype)[1] >= 0
    flops = seconds = 0.0
    for m, k, n in shapes:
        layer = torch.nn.Linear(k, n, bias=False).to(dtype)
        packed = PackedLinears(layer).active() if packs else contextlib.nullcontext()
        x = torch.randn(m, k).to(dtype)
        with torch.inference_mode(), packed:
            layer(x)
            reps, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < min_s:
                layer(x)
                reps += 1
        flops += 2.0 * m * k * n * reps
        seconds += elapsed
    return flops / seconds / 1e9


def roofline(model: Any, forward_s: float, tokens: int, steps: int, logit_rows: int, pairs: int) -> dict[str, Any]:
    """The forward's achieved GFLOP/s over ``forward_s`` and its fraction of the engine's linears' peak in the model's
    dtype, at the step's mean linear shapes (m = tokens per step) and at a large shape (2048^3, or 256 x 2048^2 where
    the small-row kernel takes 256 rows and is faster there); torch.mm's rates at 2048^3 beside them (``mm_*``)."""
    flops = forward_flops(model, tokens, logit_rows, pairs)
    achieved = flops / forward_s / 1e9 if forward_s > 0 else 0.0
    m = max(1, round(tokens / max(steps, 1)))
    shapes, _ = linear_shapes(model)
    distinct = sorted(set(shapes))
    dtype = next(model.parameters()).dtype
    at_step = linear_gflops([(m, i, o) for i, o in distinct], dtype=dtype)
    # the peak: the best of 3 samples (the shared host's other load only ever lowers a sample), at 2048^3 and, where
    # the small-row kernel takes a step's 256 rows (its AVX2 build), at 256 x 2048 x 2048: the faster of the two
    big = [(2048, 2048, 2048)] + (
        [(256, 2048, 2048)] if small_rows_range(kernel.load_small_linear(), dtype)[1] >= 256 else []
    )
    large = max(linear_gflops([shape], dtype=dtype) for shape in big for _ in range(3))
    return {
        "forward_gflop": flops / 1e9,
        "forward_gflops": achieved,
        "mean_tokens_per_step": m,
        "linear_gflops_at_step_shapes": at_step,
        "linear_gflops_large": large,
        "mm_gflops_at_step_shapes": mm_gflops([(m, i, o) for i, o in distinct], dtype=dtype),
        "mm_gflops_large": mm_gflops([(2048, 2048, 2048)], dtype=dtype),
        "fraction_of_step_shape_peak": achieved / at_step if at_step else 0.0,
        "fraction_of_large_peak": achieved / large if large else 0.0,
    }


class ReadProbe:
    """A read of ``nbytes`` of float32 (a sum on torch's threads) kept allocated, to time again and again beside other
    work: ``probe(repeats)`` returns the best GB/s of ``repeats`` reads (the shared host's other load only ever
    lowers a sample). The array lies in transparent huge pages where Linux gives them, as the engine's KV pool and
    small-row weights do (``engine.malloc.advise_huge_pages``)."""

    def __init__(self, nbytes: int = 1 << 28) -> None:
        from engine.malloc import advise_huge_pages

        self.nbytes = nbytes
        self.x = torch.empty(nbytes // 4, dtype=torch.float32)
        advise_huge_pages(self.x.data_ptr(), self.x.numel() * 4)
        self.x.fill_(1.0)
        self.x.sum()

    def __call__(self, repeats: int = 2) -> float:
        best = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.x.sum()
            best = max(best, self.nbytes / (time.perf_counter() - t0) / 1e9)
        return best


def stream_gbs(nbytes: int = 1 << 30, repeats: int = 7) -> dict[str, float]:
    """Achievable memory bandwidth in GB/s (medians of ``repeats``): ``read`` (a sum over ``nbytes`` of float32),
    ``copy`` (``nbytes`` read and written: 2 x ``nbytes`` moved). Both arrays in huge pages (``ReadProbe``)."""
    import statistics

    from engine.malloc import advise_huge_pages

    read = ReadProbe(nbytes)
    x, y = read.x, torch.empty(nbytes // 4, dtype=torch.float32)
    advise_huge_pages(y.data_ptr(), y.numel() * 4)
    y.zero_()
    reads, copies = [], []
    y.copy_(x)
    for _ in range(repeats):
        reads.append(read(1))
        t0 = time.perf_counter()
        y.copy_(x)
        copies.append(2 * nbytes / (time.perf_counter() - t0) / 1e9)
    return {"read": statistics.median(reads), "copy": statistics.median(copies), "bytes": float(nbytes)}


def decode_bytes(model: Any, kv_tokens: int, kv_bytes_per_token: int) -> dict[str, int]:
    """Bytes one decode step must read: the weights of every linear (the head's too), in the model's dtype, and the
    K/V of ``kv_tokens`` cached tokens over all rows."""
    shapes, head = linear_shapes(model)
    item = next(model.parameters()).element_size()
    weights = (sum(i * o for i, o in shapes) + head) * item
    kv = kv_tokens * kv_bytes_per_token
    return {"weights": weights, "kv": kv, "total": weights + kv}


def forward_floor(
    model: Any,
    step_tokens: Sequence[int],
    logit_rows: int,
    prefill_pairs: int,
    decode_kv_bytes: int,
    peak_gflops: float,
    read_gbs: float,
) -> dict[str, float]:
    """A lower bound on the seconds of forwards (one per step, ``step_tokens`` tokens each, ``logit_rows`` rows of
    logits in all) that attended over ``prefill_pairs`` (query, key) pairs of prompt tokens in every attention layer
    and read ``decode_kv_bytes`` of cached K/V for decoding tokens. Each step's linears take the longer of their FLOPs
    at ``peak_gflops`` and one read of every weight at ``read_gbs`` (the weights are far larger than the caches); the
    head's rows and the prefill pairs' FLOPs run at the peak; the decoding tokens' K/V is read at ``read_gbs``. Norms,
    rotary, activations, K/V writes, a decoding token's FLOPs over its keys and the Python around it all count as
    free: no run of these forwards here is faster unless it beats the peak or the bandwidth it was given."""
    if peak_gflops <= 0 or read_gbs <= 0:
        raise ValueError(f"the peak ({peak_gflops} GFLOP/s) and the bandwidth ({read_gbs} GB/s) must be positive")
    per_token = forward_flops(model, 1, 0, 0) / peak_gflops / 1e9
    weights = decode_bytes(model, 0, 0)["weights"] / read_gbs / 1e9
    linears = sum(max(t * per_token, weights) for t in step_tokens)
    bound = sum(t * per_token < weights for t in step_tokens)
    head = forward_flops(model, 0, logit_rows, 0) / peak_gflops / 1e9
    prefill = forward_flops(model, 0, 0, prefill_pairs) / peak_gflops / 1e9
    kv = decode_kv_bytes / read_gbs / 1e9
    return {
        "linears_s": linears + head,
        "steps_bound_by_weights": float(bound),
        "prefill_attention_s": prefill,
        "decode_kv_s": kv,
        "total_s": linears + head + prefill + kv,
    }
