"""KVPool: gather returns what scatter wrote, in block order, as fresh tensors; K and V may differ in shape."""

from __future__ import annotations

import pytest
import torch

from engine.kv_pool import KVPool, LayerSpec, bytes_per_token


def _kv(spec: LayerSpec, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn((1, spec.k_shape[0], tokens, spec.k_shape[1]), generator=g)
    v = torch.randn((1, spec.v_shape[0], tokens, spec.v_shape[1]), generator=g)
    return k, v


def test_gather_returns_scattered_blocks_in_order():
    bs = 3
    # two layers alike, one with latent-style K/V of different shapes, one without KV (shared layer)
    specs = [LayerSpec((2, 4), (2, 4)), LayerSpec((1, 6), (1, 2)), None, LayerSpec((2, 4), (2, 4))]
    pool = KVPool(specs, num_blocks=8, block_size=bs, dtype=torch.float32, device="cpu")
    assert bytes_per_token(specs, torch.float32) == (16 + 8 + 16) * 4
    assert pool.nbytes == 8 * bs * (16 + 8 + 16) * 4
    data = [None if s is None else _kv(s, 3 * bs, i) for i, s in enumerate(specs)]
    pool.scatter([5, 6, 1], data)  # tokens 0-2 -> block 5, 3-5 -> block 6, 6-8 -> block 1
    more = [None if s is None else _kv(s, bs, 10 + i) for i, s in enumerate(specs)]
    pool.scatter([2], more)
    got = pool.gather([5, 6, 1, 2])
    assert got[2] is None
    for layer, spec in enumerate(specs):
        if spec is None:
            continue
        for side in (0, 1):
            want = torch.cat([data[layer][side], more[layer][side]], dim=2)
            assert torch.equal(got[layer][side], want)
            assert got[layer][side].is_contiguous()
    # the gathered tensors are not views of the pool: writing to them leaves the pool alone
    got[0][0].zero_()
    assert torch.equal(pool.gather([5])[0][0], data[0][0][:, :, :bs])


def test_scatter_rejects_wrong_shapes():
    specs = [LayerSpec((2, 4), (2, 4))]
    pool = KVPool(specs, num_blocks=4, block_size=2, dtype=torch.float32, device="cpu")
    k, v = _kv(specs[0], 3, 0)  # 3 tokens for 1 block of 2
    with pytest.raises(ValueError, match="shape"):
        pool.scatter([0], [(k, v)])
    with pytest.raises(ValueError, match="layers"):
        pool.scatter([0], [])
    assert all(x is None for x in pool.gather([]))


def test_pool_converts_dtype():
    specs = [LayerSpec((1, 2), (1, 2))]
    pool = KVPool(specs, num_blocks=2, block_size=1, dtype=torch.bfloat16, device="cpu")
    k, v = _kv(specs[0], 1, 0)
    pool.scatter([1], [(k, v)])
    got = pool.gather([1])[0]
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], k.to(torch.bfloat16))
