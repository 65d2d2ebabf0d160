"""A prompt with images (``pixel_values`` beside the ids) on a model whose text path is cached: the image's content
is not in the block keys yet (issue 32), so such a call runs uncached with the reason, equal to the bare model,
and two different images behind the same placeholder ids never hit each other's KV."""

from __future__ import annotations

import warnings

import torch
import transformers as T

from engine import PrefixCachedModel, UncachedCallWarning

IMAGE = 299


def tiny_llava() -> T.LlavaForConditionalGeneration:
    vision = T.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        projection_dim=32,
    )
    text = T.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg = T.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE, vision_feature_layer=-1, image_seq_length=4
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return T.LlavaForConditionalGeneration(cfg).eval()


def test_two_images_behind_the_same_placeholders_each_get_the_bare_output():
    model = tiny_llava()
    pcm = PrefixCachedModel(model, block_size=4, max_cached_tokens=256)
    assert pcm.runtime.load_check_reason is None  # its text path is cached
    ids = torch.tensor([[5] * 8 + [IMAGE] * 4 + [7] * 6])
    outs = []
    for seed in (1, 2):
        pix = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(seed))
        kw = dict(attention_mask=torch.ones_like(ids), pixel_values=pix, max_new_tokens=4, do_sample=False)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            out = pcm.generate(ids, **kw)
        assert "pixel_values given" in pcm.last_uncached_reason
        assert [w.category for w in got] == ([UncachedCallWarning] if seed == 1 else [])  # once per reason
        assert torch.equal(out, model.generate(ids, **kw))
        outs.append(out)
    assert pcm.cache_stats()["uncached_calls"] == 2 and pcm.cache_stats()["blocks_used"] == 0
    # the same ids without the image are cached as text, and never served to an image prompt
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncachedCallWarning)
        pcm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    assert pcm.cache_stats()["blocks_used"] > 0
    pix = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), pixel_values=pix, max_new_tokens=4, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncachedCallWarning)
        assert torch.equal(pcm.generate(ids, **kw), outs[0])
    assert "pixel_values given" in pcm.last_uncached_reason
