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


def test_gather_reserves_room_and_reuses_its_buffers():
    specs = [LayerSpec((2, 4), (2, 3))]
    bs = 2
    pool = KVPool(specs, num_blocks=6, block_size=bs, dtype=torch.float32, device="cpu")
    data = [_kv(specs[0], 4 * bs, 1)]
    pool.scatter([3, 0, 5, 1], data)
    k, v = pool.gather([3, 0], reserve=7)[0]
    assert torch.equal(k, data[0][0][:, :, : 2 * bs]) and torch.equal(v, data[0][1][:, :, : 2 * bs])
    for t in (k, v):  # a leading slice of a [1, heads, capacity, dim] buffer with room for 7 more tokens
        assert t._base is not None and t._base.shape[2] >= 2 * bs + 7 and t.data_ptr() == t._base.data_ptr()
    k2, _ = pool.gather([5, 1])[0]
    assert k2.data_ptr() == k.data_ptr()  # the same buffer, overwritten by the next gather
    assert torch.equal(k2, data[0][0][:, :, 2 * bs :])
    pool.surrender_buffers()
    k3, _ = pool.gather([3])[0]
    assert k3.data_ptr() != k2.data_ptr()  # surrendered buffers are never written again
    assert torch.equal(k2, data[0][0][:, :, 2 * bs :])


def test_in_place_layer_matches_concatenation_and_falls_back_when_full():
    from transformers.cache_utils import DynamicLayer

    from engine.hf_cache import InPlaceLayer

    g = torch.Generator().manual_seed(0)
    buf_k, buf_v = torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 3)
    pre_k, pre_v = torch.randn(1, 2, 4, 4, generator=g), torch.randn(1, 2, 4, 3, generator=g)
    buf_k[:, :, :4], buf_v[:, :, :4] = pre_k, pre_v
    layer = InPlaceLayer(buf_k, buf_v, 4)
    ref = DynamicLayer()
    ref.update(pre_k, pre_v)
    for step, m in enumerate((3, 2, 1, 4)):  # 4 + 3 + 2 + 1 = 10 fits; the last 4 do not
        k, v = torch.randn(1, 2, m, 4, generator=g), torch.randn(1, 2, m, 3, generator=g)
        got_k, got_v = layer.update(k, v)
        want_k, want_v = ref.update(k, v)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        assert (got_k.data_ptr() == buf_k.data_ptr()) == (step < 3)
    assert layer.get_seq_length() == 14
