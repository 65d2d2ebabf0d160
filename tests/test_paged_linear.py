"""PackedLinears: the engine's prepacked linears (and sibling projections fused into one matmul) against the
model's own ``nn.Linear``s, on a Llama (no biases) and a Qwen2 (q/k/v biases), called in the modeling code's order
and out of it."""

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
        assert packed.num_groups == 2 * 2  # q/k/v and gate/up in each of 2 layers
        with packed.active():
            got = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, ref)  # the model's own forward again outside
    assert all("forward" not in m.__dict__ for m in linear.linears(model))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_group_members_in_any_order_and_on_other_inputs(kind):
    """Each member gives its own projection of whatever it is given, whichever member ran before and on what."""
    model = _model(kind)
    attn = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(1, 5, 32, generator=gen), torch.randn(1, 5, 32, generator=gen)
    with torch.inference_mode():
        want = {(n, i): getattr(attn, n)(t) for n in ("q_proj", "k_proj", "v_proj") for i, t in enumerate((x, y))}
        packed = linear.PackedLinears(model)
        with packed.active():
            order = [("v_proj", 0), ("k_proj", 1), ("q_proj", 0), ("k_proj", 0), ("q_proj", 1), ("v_proj", 1)]
            got = {(n, i): getattr(attn, n)((x, y)[i]) for n, i in order}
    for key, ref in want.items():
        torch.testing.assert_close(got[key], ref, rtol=1e-5, atol=1e-5)


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
