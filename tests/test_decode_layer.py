"""A lean layer's fast path (engine.paged.decode_layer): the same logits and the same pool bytes as the lean forward
through the modules, bit for bit, for steps it takes (decoding, and prefill chunks beside other rows); steps it does
not take (a window, a row on the torch path) go on as before."""

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
    """Two prompts prefilled in one step (9 and 6 new tokens: the kernel's prefill path), four steps decoding both,
    then one with a third prompt's first 20 tokens beside them, with the engine's packed linears and fused ops in
    place: each step's logits, and the pool's K/V tensors after. ``hits`` gets each step's count of fast layers."""
    pool = KVPool(hf_cache.probe_specs(model), 16, BS, dtype=model.dtype, device="cpu")
    runner = PagedRunner(model, pool)
    packed, fused = linear.PackedLinears(model), FusedOps(model)
    a, b, c = list(range(0, 4)), list(range(4, 8)), list(range(8, 13))
    out = []
    steps: list[tuple[list[Row], torch.Tensor, torch.Tensor]] = [
        ([Row(0, 9, 9, a), Row(9, 6, 6, b)], torch.cat([ids[0, :9], ids[1, :6]]), torch.tensor([8, 14]))
    ]
    for t in range(4):
        rows = [Row(0, 1, 10 + t, a), Row(1, 1, 7 + t, b)]
        steps.append((rows, torch.stack([ids[0, 9 + t], ids[1, 6 + t]]), torch.tensor([0, 1])))
    rows = [Row(0, 1, 14, a), Row(1, 1, 11, b), Row(2, 20, 20, c)]
    steps.append((rows, torch.cat([ids[0, 13:14], ids[1, 10:11], ids[2, :20]]), torch.tensor([0, 1, 21])))
    with packed.active(several_rows=True), fused.active():
        for rows, flat, keep in steps:
            before = len(hits)
            out.append(runner.forward(runner.batch(rows), flat, keep))
            hits[before:] = [sum(hits[before:])]
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
    ids = torch.randint(3, VOCAB, (3, 20), generator=torch.Generator().manual_seed(3))
    hits: list[int] = []
    _counting(monkeypatch, hits)
    got, got_kv = _run(model, ids, hits)
    monkeypatch.setenv(lean.DECODE_ENV, "off")
    off: list[int] = []
    want, want_kv = _run(model, ids, off)
    assert off == [0] * 6  # switched off: the lean forward's module calls every step
    layers = model.config.num_hidden_layers
    if arch == "mistral_window":
        assert hits == [0] * 6  # a layer that passes a window keeps the module calls
    else:
        # every layer of every step, but the last layer of the first and last steps: it computes the kept rows only
        # (LastLayerRows' hooks), through transformers' forward
        assert hits == [layers - 1] + [layers] * 4 + [layers - 1]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    for g, w in zip(got_kv, want_kv, strict=True):
        assert torch.equal(g, w)


def test_a_step_with_a_torch_row_takes_the_module_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone row of more new tokens than the decode path takes goes through SDPA (the torch path), over queries as
    the module calls lay them out: the whole step keeps those calls."""
    if _kernels(torch.float32):
        pytest.skip(_kernels(torch.float32) or "")
    model = tiny_model("llama", hidden=64)
    hits: list[int] = []
    _counting(monkeypatch, hits)
    pool = KVPool(hf_cache.probe_specs(model), 16, BS, dtype=model.dtype, device="cpu")
    runner = PagedRunner(model, pool)
    packed, fused = linear.PackedLinears(model), FusedOps(model)
    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(4))
    with packed.active(several_rows=True), fused.active():
        batch = runner.batch([Row(0, 20, 20, list(range(5)))])
        assert batch.torch_rows == [0]
        runner.forward(batch, ids, torch.tensor([19]))
    assert hits and not any(hits)
