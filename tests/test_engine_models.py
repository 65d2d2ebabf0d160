"""Built-in presets, the byte-level tokenizer, and loading a saved model from a local path."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM

from engine import PrefixCachedModel
from engine.models import PRESETS, build_preset, byte_tokenizer, load_model


def test_byte_tokenizer_round_trips_and_has_chat_template():
    tok = byte_tokenizer()
    text = "héllo, wörld ✓"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert ids[1:] == list(text.encode("utf-8"))  # one token per byte, id == byte value
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} <= set(range(256, 272))
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|bos|><|user|>hi<|end|><|assistant|>"
    assert len(tok.convert_tokens_to_ids(["<|user|>"])) == 1 and tok.convert_tokens_to_ids("<|user|>") >= 256


def test_presets_shapes():
    small = PRESETS["small"]
    from dataclasses import asdict

    from transformers import LlamaConfig

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**asdict(small), tie_word_embeddings=False))
    params = sum(p.numel() for p in model.parameters())
    assert 100e6 <= params <= 120e6
    assert small.max_position_embeddings >= 4096
    tiny, tok = build_preset("tiny", seed=0)
    again, _ = build_preset("tiny", seed=0)
    other, _ = build_preset("tiny", seed=1)
    p0, p1, p2 = (next(m.parameters()) for m in (tiny, again, other))
    assert torch.equal(p0, p1) and not torch.equal(p0, p2)
    assert tiny.config.vocab_size >= len(tok)


def test_load_from_local_path(tmp_path):
    model, tok = load_model("tiny")
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, tok2 = load_model(str(tmp_path))
    assert type(loaded).__name__ == "LlamaForCausalLM"
    ids = tok2("a shared prefix, then more", return_tensors="pt").input_ids
    assert ids.tolist() == tok("a shared prefix, then more", return_tensors="pt").input_ids.tolist()
    ref = model.generate(ids, max_new_tokens=5)
    assert torch.equal(loaded.generate(ids, max_new_tokens=5), ref)
    pcm = PrefixCachedModel.from_pretrained(str(tmp_path), max_cached_tokens=512, block_size=4)
    assert torch.equal(pcm.generate(ids, max_new_tokens=5), ref)
    assert torch.equal(pcm.generate(ids, max_new_tokens=5), ref)
    assert pcm.last_request_stats[0].cached_tokens == ((ids.shape[1] - 1) // 4) * 4
    assert pcm.tokenizer.eos_token == "<|eos|>"
