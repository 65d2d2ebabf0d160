"""The check at load (``engine.path_check``, ``engine.hybrid.layer_state.audit``): what protects a user on a
transformers release nobody here has tried. Each test simulates an upstream change on the installed transformers
(a recurrent cache layer that gains a member, a layer that counts tokens another way, a restore or a KV read that
goes wrong without an error) and asserts that caching is turned off with an ``UncachedCallWarning`` naming the
versions, and that the wrapper's outputs then equal the bare model's. And that the check itself leaves no trace:
an empty cache, zero counters, nothing written to the tier.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import transformers
from engine_testutil import tiny_model
from hybrid_testutil import build
from transformers.cache_utils import LinearAttentionLayer

from engine import PrefixCachedModel, UncachedCallWarning
from engine.hybrid import layer_state
from engine.kv_pool import KVPool

BS = 16


@functools.cache
def hybrid_model() -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: "falling back to its reference PyTorch implementation"
        return build("qwen3_5")


def _greedy(fn, ids: torch.Tensor):
    return fn(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        suppress_tokens=[2],
        output_scores=True,
        return_dict_in_generate=True,
    )


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 300, (40,), generator=g)
    return [torch.cat([shared, torch.randint(3, 300, (n,), generator=g)])[None] for n in (9, 13)]


def _turned_off(model: torch.nn.Module, match: str) -> PrefixCachedModel:
    """The wrapper of ``model``, built with the caching-off warning matching ``match`` and the versions."""
    with pytest.warns(UncachedCallWarning, match=match) as got:
        pcm = PrefixCachedModel(model, max_cached_tokens=2048, block_size=BS)
    text = " ".join(str(w.message) for w in got)
    assert f"transformers {transformers.__version__}" in text and f"torch {torch.__version__}" in text
    assert pcm.runtime.load_check_reason is not None and pcm.runtime.pool is None
    return pcm


def _equals_bare(pcm: PrefixCachedModel, model: torch.nn.Module) -> None:
    """Every prompt (twice: a would-be hit) gives the bare model's tokens and first-step scores, uncached."""
    for ids in [*_prompts(), *_prompts()]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UncachedCallWarning)
            out = _greedy(pcm.generate, ids)
        ref = _greedy(model.generate, ids)
        assert torch.equal(out.sequences, ref.sequences)
        assert torch.allclose(out.scores[0], ref.scores[0], atol=1e-6, rtol=0)
    assert pcm.cache_stats()["uncached_calls"] == 4 and pcm.cache_stats()["cached_tokens"] == 0


def test_a_layer_member_unknown_here_turns_caching_off(monkeypatch):
    init = LinearAttentionLayer.__init__

    def gains_a_tensor(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.chunk_offsets = torch.zeros(1, dtype=torch.long)  # what a future release might add

    monkeypatch.setattr(LinearAttentionLayer, "__init__", gains_a_tensor)
    model = hybrid_model()
    pcm = _turned_off(model, "chunk_offsets \\(Tensor\\), which prefixcache does not know")
    _equals_bare(pcm, model)


def test_a_count_left_behind_by_the_restore_turns_caching_off(monkeypatch):
    """transformers 5.25's change, as this code would meet it had it not learned of the count: a restore that
    leaves ``cumulative_length_linear`` at 0 (the cache then reports 0 tokens and every position shifts)."""
    if not hasattr(LinearAttentionLayer(), "cumulative_length_linear"):
        pytest.skip(f"transformers {transformers.__version__} has no token count on its recurrent layers (5.25 on)")
    monkeypatch.setattr(layer_state, "COUNTERS", ())
    model = hybrid_model()
    pcm = _turned_off(model, "reports 0 tokens where it holds")
    _equals_bare(pcm, model)


def test_a_layer_answering_its_length_differently_turns_caching_off(monkeypatch):
    monkeypatch.setattr(LinearAttentionLayer, "get_seq_length", lambda self: 7, raising=False)
    model = hybrid_model()
    pcm = _turned_off(model, "counts tokens in a way prefixcache does not know")
    _equals_bare(pcm, model)


def test_a_restore_wrong_without_an_error_is_caught_by_the_logits(monkeypatch):
    """A restore whose lengths are right but whose state is not (what no structural check sees): only comparing
    the cached path's logits with the bare model's catches it."""
    write = layer_state.write

    def stale_state(layer, tensors, kernels, *, length, previous=True):
        write(layer, {k: torch.zeros_like(t) for k, t in tensors.items()}, kernels, length=length, previous=previous)

    monkeypatch.setattr(layer_state, "write", stale_state)
    model = hybrid_model()
    pcm = _turned_off(model, "the check at load found its cached first-step logits .* from the bare model's")
    _equals_bare(pcm, model)


def test_an_attention_model_whose_kv_read_goes_wrong_runs_uncached(monkeypatch):
    gather = KVPool.gather_into

    def off_by_a_little(self, blocks, out):
        gather(self, blocks, out)
        for kv in out:
            if kv is not None:
                kv[0].add_(1e-2)

    monkeypatch.setattr(KVPool, "gather_into", off_by_a_little)
    model = tiny_model("llama")
    pcm = _turned_off(model, "the check at load found")
    ids = torch.randint(3, 120, (1, 40), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UncachedCallWarning)
        out = pcm.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))


def test_kimi_linear_with_grouped_kv_heads_is_a_clear_refusal_not_a_raw_error():
    """Kimi Linear's MLA with 2 KV heads of 4: transformers' own forward over a cached prefix raises (a shape
    error inside its attention). The wrapper is made, says why, and runs the model uncached."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("kimi_linear", num_key_value_heads=2)
    pcm = _turned_off(model, "KimiLinearForCausalLM's forward over a cached prefix .* raised RuntimeError")
    _equals_bare(pcm, model)


def test_the_check_leaves_no_trace(tmp_path):
    model = hybrid_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncachedCallWarning)
        pcm = PrefixCachedModel(model, max_cached_tokens=2048, block_size=BS, disk_cache=str(tmp_path / "tier"))
    stats = pcm.cache_stats()
    assert stats["blocks_used"] == 0 and stats["lookups"] == 0 and stats["state_snapshots"] == 0
    assert stats["state_stored"] == 0 and pcm.runtime.load_check_reason is None
    tier = pcm.runtime.tier
    assert tier is not None
    tier.flush()
    assert tier.num_blocks == 0 and tier.counters.written_blocks == 0  # the probe's blocks never reached the disk
    ids = _prompts()[0]
    out = _greedy(pcm.generate, ids)
    assert torch.equal(out.sequences, _greedy(model.generate, ids).sequences)
    assert pcm.last_request_stats[0].cached_tokens == 0  # nothing of the probe is served
    pcm.close()


@pytest.mark.parametrize("fault", ["raises", "differs"])
def test_a_paged_probe_that_fails_turns_the_engine_off_with_the_versions(monkeypatch, fault):
    from engine import EngineFallbackWarning, runtime

    def probe(*args, **kwargs):
        if fault == "raises":
            raise RuntimeError("a kernel this release broke")
        return 1.0

    monkeypatch.setattr(runtime, "probe_difference", probe)
    model = tiny_model("llama")
    pcm = PrefixCachedModel(model, max_cached_tokens=512, block_size=4)
    prompt = torch.randint(3, 120, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    with pytest.warns(EngineFallbackWarning, match=f"transformers {transformers.__version__}"):
        out = pcm.generate_batch([prompt], max_new_tokens=4, do_sample=False)
    assert pcm.runtime.engine_unsupported_reason is not None
    ids = torch.tensor([prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out["req_0"].generated_tokens == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("own", [7e-3, 3e-3, None])
def test_a_probe_past_the_tolerance_is_held_to_the_models_own_chunked_difference(monkeypatch, own):
    """A probe over 1e-3 still gets the engine where the model's own forward in the same two chunks moves from its
    one pass by at least half as much (a library whose results depend on the row count: an uncached run moves as
    much); otherwise, or where that cannot be measured, the engine is off and the reason gives both figures."""
    from engine import runtime

    monkeypatch.setattr(runtime, "probe_difference", lambda *a, **k: 8e-3)
    calls = []
    monkeypatch.setattr(runtime, "own_difference", lambda *a, **k: calls.append(1) or own)
    pcm = PrefixCachedModel(tiny_model("llama"), max_cached_tokens=512, block_size=4)
    made = pcm.runtime.engine() is not None
    assert calls == [1]
    assert made == (own == 7e-3)
    reason = pcm.runtime.engine_unsupported_reason
    if made:
        assert reason is None
    else:
        assert reason is not None and "8.0e-03" in reason
        assert ("its own forward in the same two chunks differs by 3.0e-03" in reason) == (own is not None)


def test_the_models_own_chunked_difference_is_measured_on_the_probes_prompt():
    """``own_difference`` is the model's own two-chunk forward against its one pass, on the probe's prompt: for an
    fp32 model on oneDNN, float rounding; for one whose forward depends on how many tokens a call has (a
    simulated library), that dependence."""
    from engine.paged.runner import own_difference

    model = tiny_model("llama")
    pcm = PrefixCachedModel(model, max_cached_tokens=512, block_size=4)
    rt = pcm.runtime
    with rt.cache.borrowed_blocks(4) as blocks:
        base = own_difference(model, rt.pool, blocks)
        assert base is not None and base < 1e-5
        head = model.lm_head
        plain = head.forward
        head.forward = lambda x: plain(x) * (1.0 + 0.01 * (x.shape[1] == 2))  # calls of 2 tokens: 1% larger
        try:
            moved = own_difference(model, rt.pool, blocks)
        finally:
            del head.forward
    assert moved is not None and moved > 5e-3  # the last token's logits come from a 2-token call


def test_a_check_failing_after_a_dtype_change_closes_the_tier_and_runs_uncached(tmp_path, monkeypatch):
    from engine import path_check

    model = tiny_model("llama")
    pcm = PrefixCachedModel(model, max_cached_tokens=512, block_size=4, disk_cache=str(tmp_path / "tier"))
    tier = pcm.runtime.tier
    assert tier is not None and pcm.runtime.load_check_reason is None
    monkeypatch.setattr(path_check, "contiguous_reason", lambda rt: "a difference this dtype shows (simulated)")
    model.to(torch.float64)
    ids = torch.randint(3, 120, (1, 12), generator=torch.Generator().manual_seed(4))
    with pytest.warns(UncachedCallWarning, match="simulated"):
        out = pcm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert pcm.runtime.tier is None and pcm.runtime.pool is None and tier._closed
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert torch.equal(out, ref)
