"""A lean layer's decode fast path (engine.paged.decode_layer): the same logits and the same pool bytes as the lean
forward through the modules, bit for bit, for steps it takes; steps it does not take go on as before."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import VOCAB, tiny_model

from engine import hf_cache
from engine.kv_pool import KVPool
from engine.paged import decode_layer, kernel, lean, linear
from engine.paged.attention import Row
from engine.paged.fused import FusedOps
from engine.paged.runner import PagedRunner

BS = 4


def _kernels(dtype: torch.dtype) -> str | None:
    """Why this machine cannot take the fast path in ``dtype`` (None: it can)."""
    if kernel.load() is None or kernel.load_fused() is None:
        return "no C kernels here"
    if linear.small_rows_range(kernel.load_small_linear(), dtype)[1] < 2:
        return f"the small-row kernel takes no {dtype} rows here"
    return None


def _run(model: torch.nn.Module, ids: torch.Tensor, hits: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two prompts prefilled in one step, then four steps decoding both, with the engine's packed linears and fused
    ops in place: each step's logits, and the pool's K/V tensors after."""
    pool = KVPool(hf_cache.probe_specs(model), 16, BS, dtype=model.dtype, device="cpu")
    runner = PagedRunner(model, pool)
    packed, fused = linear.PackedLinears(model), FusedOps(model)
    a, b = list(range(0, 4)), list(range(4, 8))
    out = []
    with packed.active(several_rows=True), fused.active():
        flat = torch.cat([ids[0, :9], ids[1, :6]])
        out.append(runner.forward(runner.batch([Row(0, 9, 9, a), Row(9, 6, 6, b)]), flat, torch.tensor([8, 14])))
        before = sum(hits)
        for t in range(4):
            rows = [Row(0, 1, 10 + t, a), Row(1, 1, 7 + t, b)]
            step = torch.stack([ids[0, 9 + t], ids[1, 6 + t]])
            out.append(runner.forward(runner.batch(rows), step, torch.tensor([0, 1])))
        hits.append(sum(hits) - before)  # the decode steps' fast layers
    kv = [t.clone() for pair in (pool.layer(i) for i in range(len(pool.specs))) if pair is not None for t in pair]
    return out, kv


def _counting(monkeypatch: pytest.MonkeyPatch, hits: list[int]) -> None:
    """Count the layer calls the fast path takes (in ``hits``), for runners made after this."""
    made = lean.fast_forward

    def fast_forward(*args, **kwargs):
        fast = made(*args, **kwargs)

        def counted(*a):
            out = fast(*a)
            hits.append(out is not None)
            return out

        return counted

    monkeypatch.setattr(lean, "fast_forward", fast_forward)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral_window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("joined", [True, False])
def test_the_decode_fast_path_gives_the_lean_forwards_bits(
    monkeypatch: pytest.MonkeyPatch, arch: str, dtype: torch.dtype, joined: bool
) -> None:
    why = _kernels(dtype)
    if why:
        pytest.skip(why)
    if not joined:  # each projection its own call (weights not back to back)
        monkeypatch.setattr(decode_layer, "_joinable", lambda parts: False)
    model = tiny_model(arch, dtype=dtype, hidden=64)  # qwen2: q/k/v biases; mistral_window: a sliding window
    ids = torch.randint(3, VOCAB, (2, 14), generator=torch.Generator().manual_seed(3))
    hits: list[int] = []
    _counting(monkeypatch, hits)
    got, got_kv = _run(model, ids, hits)
    fast_layers = hits[-1]
    monkeypatch.setenv(lean.DECODE_ENV, "off")
    off: list[int] = []
    want, want_kv = _run(model, ids, off)
    assert off == [0]  # switched off: the lean forward's module calls every step
    if arch == "mistral_window":
        assert fast_layers == 0  # a layer that passes a window keeps the module calls
    else:
        # every decode step's layers but the last (its output rows pruned through hooks when fewer are kept; here all
        # are, so it runs lean too)
        assert fast_layers == 4 * model.config.num_hidden_layers
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for g, w in zip(got_kv, want_kv, strict=True):
        assert torch.equal(g, w)


def test_a_step_with_a_prefill_row_takes_the_module_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row of more new tokens than the decode path takes (here 20) sends the whole step the usual way."""
    if _kernels(torch.float32):
        pytest.skip(_kernels(torch.float32) or "")
    model = tiny_model("llama", hidden=64)
    hits: list[int] = []
    _counting(monkeypatch, hits)
    pool = KVPool(hf_cache.probe_specs(model), 16, BS, dtype=model.dtype, device="cpu")
    runner = PagedRunner(model, pool)
    packed, fused = linear.PackedLinears(model), FusedOps(model)
    ids = torch.randint(3, VOCAB, (22,), generator=torch.Generator().manual_seed(4))
    with packed.active(several_rows=True), fused.active():
        runner.forward(runner.batch([Row(0, 20, 20, list(range(5))), Row(20, 2, 2, [5])]), ids, torch.tensor([19]))
    assert hits and not any(hits)
