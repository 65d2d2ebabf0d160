"""Helpers for the engine tests: tiny random models of several architectures and an uncached comparison.

``PREFIXCACHE_TEST_DEVICE`` (default "cpu") is the device the exactness tests (test_engine_archs.py) put their
models on, e.g. "cuda" on a GPU (``benchmarks/gpu_check.sh``); ``compare`` moves its inputs to the model.
"""

from __future__ import annotations

import os

import torch
import transformers as T

DEVICE = torch.device(os.environ.get("PREFIXCACHE_TEST_DEVICE") or "cpu")
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    raise RuntimeError(f"PREFIXCACHE_TEST_DEVICE={DEVICE} but torch {torch.__version__} sees no CUDA device")
VOCAB = 128
BS = 4  # block size used by the scenario tests


def _gc(**extra) -> T.GenerationConfig:
    # no eos: every row generates exactly max_new_tokens, so cached-token counts follow from block arithmetic
    return T.GenerationConfig(pad_token_id=0, eos_token_id=None, bos_token_id=None, do_sample=False, **extra)


def tiny_model(
    arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, device: torch.device | str = "cpu", hidden: int = 32
):
    """A tiny random decoder of ``arch`` on ``device`` in eval mode with a no-eos greedy generation config; the
    Llama-like ones with ``hidden`` (4 heads: head dim ``hidden // 4``)."""
    common = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    llama_like = dict(
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        **common,
    )
    if arch == "llama":
        cls, cfg = T.LlamaForCausalLM, T.LlamaConfig(**llama_like)
    elif arch == "qwen2":
        cls, cfg = T.Qwen2ForCausalLM, T.Qwen2Config(**llama_like)
    elif arch == "phi3":
        cls, cfg = T.Phi3ForCausalLM, T.Phi3Config(**llama_like)
    elif arch == "mistral_window":
        cls, cfg = T.MistralForCausalLM, T.MistralConfig(sliding_window=6, **llama_like)
    elif arch == "gpt2":
        cls = T.GPT2LMHeadModel
        cfg = T.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            initializer_range=0.1,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    elif arch == "gemma2":
        cls = T.Gemma2ForCausalLM
        cfg = T.Gemma2Config(
            head_dim=8, sliding_window=6, query_pre_attn_scalar=8, attn_implementation="eager", **llama_like
        )
    elif arch == "gemma3":
        cls = T.Gemma3ForCausalLM
        cfg = T.Gemma3TextConfig(
            head_dim=8,
            sliding_window=6,
            query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"],
            **llama_like,
        )
    else:
        raise ValueError(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    model = model.to(dtype=dtype, device=device).eval()
    model.generation_config = _gc()
    return model


ARCHS = ["llama", "qwen2", "phi3", "gpt2", "mistral_window", "gemma2", "gemma3"]


def rand_tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


def left_pad(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def compare(pcm, model, ids: torch.Tensor, mask: torch.Tensor | None = None, atol: float = 1e-4, **kw):
    """Run the wrapper and the unwrapped model; assert equal greedy tokens and close first-step logits."""
    args = dict(max_new_tokens=4, return_dict_in_generate=True, output_logits=True, **kw)
    ids = ids.to(model.device)
    if mask is not None:
        args["attention_mask"] = mask.to(model.device)
    ref = model.generate(ids, **args)
    out = pcm.generate(ids, **args)
    assert out.sequences.shape == ref.sequences.shape
    assert torch.equal(out.sequences, ref.sequences), (out.sequences, ref.sequences)
    assert len(out.logits) == len(ref.logits)
    diff = (out.logits[0].float() - ref.logits[0].float()).abs().max().item()
    assert diff <= atol, f"first-step logits differ by {diff}"
    return out


def expected_cached(prompt: list[int], committed: list[list[int]], bs: int = BS) -> int:
    """Brute force: longest common prefix with any committed sequence, in full blocks, leaving >= 1 token."""
    best = 0
    for c in committed:
        n = 0
        for a, b in zip(prompt, c):
            if a != b:
                break
            n += 1
        best = max(best, n // bs)
    return min(best, (len(prompt) - 1) // bs) * bs
