"""PackedLinears: the engine's prepacked linears against the model's own ``nn.Linear``s, on a Llama (no biases)
and a Qwen2 (q/k/v biases); the model is left as it was; repack follows changed weights."""

from __future__ import annotations

import time

import pytest
import torch

from engine.paged import linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def _model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common)).eval()


def _small_f32_or_skip() -> None:
    """Skips the test where the small-row kernel has no float32 build here (no AVX2 and FMA, nor AVX-512)."""
    from engine.paged import kernel

    lib = kernel.load_small_linear()
    if lib is None or not int(lib.small_linear_available()) & 1:
        pytest.skip(f"no float32 small-row kernel here: {kernel.unavailable_reason('small_linear')}")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_forward_gives_the_models_logits(kind):
    model = _model(kind)
    ids = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
        packed = linear.PackedLinears(model)
        with packed.active():
            got = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, ref)  # the model's own forward again outside
    assert all("forward" not in m.__dict__ for m in linear.linears(model))


def test_seconds_count_the_packed_forwards_only():
    model = _model("llama")
    ids = torch.arange(9).unsqueeze(0)
    packed = linear.PackedLinears(model)
    assert packed.seconds == 0.0
    with torch.inference_mode():
        model(input_ids=ids)  # the model's own linears: not counted
        assert packed.seconds == 0.0
        with packed.active():
            t0 = time.perf_counter()
            model(input_ids=ids)
            wall = time.perf_counter() - t0
    assert 0 < packed.seconds < wall


def test_repack_follows_changed_weights():
    model = _model("llama")
    ids = torch.arange(9).unsqueeze(0)
    packed = linear.PackedLinears(model)
    with torch.inference_mode(), packed.active():  # the forwards are made and kept: repack must make them again
        before = model(input_ids=ids).logits
    with torch.no_grad():
        for m in linear.linears(model):
            m.weight.mul_(0.5)
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
        assert not torch.allclose(ref, before)
        packed.repack()
        with packed.active():
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_row_counts_are_bucketed_and_padding_changes_nothing():
    """oneDNN keeps a primitive per input shape: row counts past 16 are computed as a multiple of 16 (so a server
    sees few shapes), and the padded rows change no result."""
    import torch

    from engine.paged.linear import PackedLinears, rows_bucket

    assert [rows_bucket(n) for n in (1, 16, 17, 32, 33, 256, 257)] == [1, 16, 32, 32, 48, 256, 272]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(24, 40)).eval()
    packed = PackedLinears(net)
    for n in (1, 5, 16, 17, 40, 257):
        x = torch.randn(n, 24)
        with torch.no_grad():
            ref = net(x)
            with packed.active():
                got = net(x)
        assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_row_kernel_against_float64_and_onednn(dtype, monkeypatch):
    """Row counts in ``small_rows_range`` go to the small-row kernel (in groups of 16 rows, 6 in its AVX2 build, over each block of
    outputs): its outputs are as close to a float64 reference as oneDNN's (the same sums in another order), bias
    included; other counts, and any count in a block entered with ``several_rows=False``, keep oneDNN's bits (one
    row: in bf16 nn.Linear's). Where oneDNN refuses the dtype, the kernel takes every count from 2 and the model's
    nn.Linear the rest."""
    from engine.paged import kernel

    lib = kernel.load_small_linear()
    if lib is None or not (int(lib.small_linear_available()) & (2 if dtype == torch.bfloat16 else 1)):
        pytest.skip(f"no small-row kernel for {dtype} here: {kernel.unavailable_reason('small_linear')}")
    torch.manual_seed(0)
    net = torch.nn.Linear(96, 48).to(dtype).eval()
    packed = linear.PackedLinears(net)
    assert packed.small_rows == 1
    onednn = linear.PackedLinears(net, small_rows=False)
    assert onednn.small_rows == 0
    eps = torch.finfo(dtype).eps
    least, most = linear.small_rows_range(lib, dtype)
    counts = {1, 2, 7, 16, 17, 31, 33, most, most + 1}
    if linear.onednn_refuses(dtype) is not None:  # the kernel alone, for every count from 2
        assert not any(p is not None for p in packed._packed)  # no oneDNN copy
        most, counts = 10**6, counts | {300}
    calls = []
    kernel_call = linear.SmallPacked.__call__
    monkeypatch.setattr(linear.SmallPacked, "__call__", lambda self, rows: calls.append(1) or kernel_call(self, rows))
    for n in sorted(counts):
        x = torch.randn(n, 96).to(dtype)
        ref = x.double() @ net.weight.double().t() + net.bias.double()
        with torch.inference_mode():
            before = len(calls)
            with packed.active():
                got = net(x)
            assert len(calls) - before == (least <= n <= most), n  # the kernel took exactly these counts
            with packed.active(several_rows=False):
                alone = net(x)
            assert len(calls) - before == (least <= n <= most), n
            with onednn.active():
                base = net(x)
            plain = net(x)
        assert got.shape == (n, 48) and got.dtype == dtype
        assert torch.equal(alone, base)
        if not least <= n <= most:  # oneDNN itself
            assert torch.equal(got, base)
        err, base_err = (got.double() - ref).abs(), (base.double() - ref).abs()
        scale = ref.abs() + 1
        assert (err <= base_err + 2 * eps * scale).all(), n  # no worse than oneDNN's, but for a rounding
        if n == 1 and dtype == torch.bfloat16:  # (float32: oneDNN's packed sums differ from nn.Linear's anyway)
            assert torch.equal(got, plain)


def test_small_row_kernel_leaves_shapes_it_does_not_take_to_onednn():
    _small_f32_or_skip()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 32)).eval()  # 40 outputs: not 16k
    packed = linear.PackedLinears(net)
    assert packed.small_rows == 1  # the second only
    x = torch.randn(5, 24)
    with torch.inference_mode():
        want = net(x)
        with packed.active():
            got = net(x)
            strided = net(torch.randn(24, 5).t())  # rows not contiguous: the kernel takes any row stride
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert strided.shape == (5, 32)


def test_onednn_only_turns_the_small_row_kernel_off_for_a_block(monkeypatch):
    _small_f32_or_skip()
    torch.manual_seed(0)
    net = torch.nn.Linear(32, 32).eval()
    packed, onednn = linear.PackedLinears(net), linear.PackedLinears(net, small_rows=False)
    x = torch.randn(4, 32)
    calls = []
    kernel_call = linear.SmallPacked.__call__
    monkeypatch.setattr(linear.SmallPacked, "__call__", lambda self, rows: calls.append(1) or kernel_call(self, rows))
    with torch.inference_mode():
        with onednn.active():
            want = net(x)
        with packed.active():  # the small-row kernel's forwards, made and kept
            small = net(x)
        assert len(calls) == 1
        with packed.onednn_only(), packed.active():  # the kept forwards are not used here
            got = net(x)
        assert len(calls) == 1
        with packed.active():
            again = net(x)
        assert len(calls) == 2
    assert torch.equal(got, want) and packed.small_rows == 1  # restored after the block
    assert torch.equal(again, small)
    assert (small - want).abs().max() < 1e-4  # the same linear either way, by another order of sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_refuses_exactly_where_packing_raises(dtype):
    """``onednn_refuses`` is None where oneDNN packs and runs a linear of ``dtype`` here (a real pack, not the
    probe's), else it says why: on a CPU without AVX-512 oneDNN's bf16 packing raises."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(32, 48).to(dtype), linear.PACK_HINT)
        torch.ops.mkldnn._linear_pointwise(torch.randn(3, 48).to(dtype), w, None, "none", [], "")
        packs = True
    except RuntimeError:
        packs = False
    why = linear.onednn_refuses(dtype)
    assert (why is None) == packs
    assert why is None or str(dtype) in why


def test_engine_runs_the_small_row_kernel_alone_where_onednn_refuses(monkeypatch):
    """Where oneDNN cannot pack the model's dtype (bf16 on a CPU without AVX-512; simulated here for float32), the
    engine packs the small-row kernel's copy alone: steps of 2 rows or more go to the kernel, one row to the
    model's own ``nn.Linear``, and its greedy tokens are the bare model's (up to float ties)."""
    from test_engine_batching import assert_bare_greedy

    from engine import PrefixCachedModel
    from tests.engine_testutil import tiny_model

    _small_f32_or_skip()
    monkeypatch.setattr(linear, "onednn_refuses", lambda dtype: "oneDNN cannot pack (test)")
    model = tiny_model("llama")
    assert linear.available(model) is None and linear.kernel_only(model)
    pcm = PrefixCachedModel(model, max_cached_tokens=512)
    packed = pcm.runtime._packed()
    assert packed is not None and packed.small_rows == len(linear.linears(model))
    assert all(p is None for p in packed._packed) and packed.nbytes == linear.weight_bytes(model)
    sizes = []
    kernel_call = linear.SmallPacked.__call__
    monkeypatch.setattr(
        linear.SmallPacked, "__call__", lambda self, rows: sizes.append(len(rows)) or kernel_call(self, rows)
    )
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (21, 9)]
    outs = pcm.generate_batch(prompts, max_new_tokens=5, do_sample=False)
    assert sizes and min(sizes) >= 2 and max(sizes) >= 21  # prefill rows and two-row decode steps, all on the kernel
    for i, p in enumerate(prompts):
        assert outs[f"req_{i}"].error is None
        assert_bare_greedy("llama", tuple(p), outs[f"req_{i}"].generated_tokens, 5)


def test_engine_keeps_nn_linear_where_onednn_refuses_and_no_kernel_is_built(monkeypatch):
    """Where oneDNN cannot pack the model's dtype and the small-row kernel has no build for it either, the engine
    runs with the model's own ``nn.Linear``s (no packed copy, no error) and its greedy tokens are the bare model's."""
    from engine import PrefixCachedModel
    from tests.engine_testutil import tiny_model

    monkeypatch.setattr(linear, "onednn_refuses", lambda dtype: "oneDNN cannot pack (test)")
    monkeypatch.setattr(linear, "small_rows_range", lambda lib, dtype: (0, -1))
    model = tiny_model("llama")
    assert linear.available(model) == "oneDNN cannot pack (test)"
    pcm = PrefixCachedModel(model, max_cached_tokens=512)
    engine = pcm.engine()
    assert engine is not None and pcm.runtime._packed() is None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (21, 9)]
    outs = pcm.generate_batch(prompts, max_new_tokens=5, do_sample=False)
    for i, p in enumerate(prompts):
        with torch.inference_mode():
            want = model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)[0, len(p) :].tolist()
        assert outs[f"req_{i}"].error is None and outs[f"req_{i}"].generated_tokens == want
