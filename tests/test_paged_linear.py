"""PackedLinears: the engine's prepacked linears against the model's own ``nn.Linear``s, on a Llama (no biases)
and a Qwen2 (q/k/v biases); the model is left as it was; repack follows changed weights."""

from __future__ import annotations

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


def test_repack_follows_changed_weights():
    model = _model("llama")
    ids = torch.arange(9).unsqueeze(0)
    packed = linear.PackedLinears(model)
    with torch.no_grad():
        for m in linear.linears(model):
            m.weight.mul_(0.5)
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
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
