"""Window groups on real model families (sliding-window and chunked attention): with ``sliding_windows=True`` the
pool keeps those layers' K/V only within the windows of kept points, and every call still equals the bare model
(greedy tokens, first-step logits) on prompts longer than the window, with matches ending before, at and past a
window boundary, after eviction has reused block ids, and in padded batches."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as T

from engine.wrapper import PrefixCachedModel
from tests.engine_testutil import _gc, compare, left_pad, rand_tokens

W = 8  # window / chunk, in tokens
BS = 4
COMMON = dict(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
LL = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    **COMMON,
)
THREE_ONE = ["sliding_attention"] * 3 + ["full_attention"]


def _config(family: str):
    if family == "gemma3":
        return T.Gemma3ForCausalLM, T.Gemma3TextConfig(
            head_dim=8, sliding_window=W, query_pre_attn_scalar=8, layer_types=THREE_ONE, **LL
        )
    if family == "gemma4":
        return T.Gemma4ForCausalLM, T.Gemma4TextConfig(
            head_dim=8,
            global_head_dim=8,
            sliding_window=W,
            layer_types=THREE_ONE,
            vocab_size_per_layer_input=128,
            hidden_size_per_layer_input=8,
            **LL,
        )
    if family == "gpt_oss":
        return T.GptOssForCausalLM, T.GptOssConfig(
            head_dim=8,
            sliding_window=W,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **LL,
        )
    if family == "olmo3":
        return T.Olmo3ForCausalLM, T.Olmo3Config(sliding_window=W, layer_types=THREE_ONE, **LL)
    if family == "cohere2":
        return T.Cohere2ForCausalLM, T.Cohere2Config(sliding_window=W, layer_types=THREE_ONE, **LL)
    if family == "llama4":
        return T.Llama4ForCausalLM, T.Llama4TextConfig(
            head_dim=8,
            attention_chunk_size=W,
            intermediate_size_mlp=64,
            num_local_experts=2,
            no_rope_layers=[1, 1, 1, 0],
            **LL,
        )
    raise ValueError(family)


FAMILIES = ["gemma3", "gemma4", "gpt_oss", "olmo3", "cohere2", "llama4"]


def tiny(family: str):
    cls, cfg = _config(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(cfg)
    model = model.float().eval()
    model.generation_config = _gc()
    return model


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, tiny(request.param)


def wrap(model, **kw) -> PrefixCachedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrefixCachedModel(model, block_size=BS, sliding_windows=True, **kw)


def window_blocks_held(pcm: PrefixCachedModel) -> int:
    ws = pcm.cache.windows
    assert ws is not None
    return ws.num_held


def take_every_slot(pcm: PrefixCachedModel) -> None:
    """Drop every point and let other blocks take every slot (what pressure from other prompts does)."""
    ws = pcm.cache.windows
    for key in list(ws._points):
        ws.drop(key)
    live = set(pcm.cache._path_ids(None))
    others = [b for b in range(ws.num_blocks) if ws.table[b] < 0][: ws.capacity]
    ws.give("others", others)
    ws.drop("others")
    ws.forget(others)  # (they are not the cache's: give their slots back free)
    assert not live


def test_the_group_is_found_and_the_pool_is_smaller_per_block(family_model) -> None:
    family, model = family_model
    pcm = wrap(model, max_cached_tokens=256)
    rt = pcm.runtime
    assert rt.window is not None
    rule, layers = rt.window
    assert rule.kind == ("chunked" if family == "llama4" else "sliding") and rule.tokens == W
    assert layers == (frozenset({0, 2}) if family == "gpt_oss" else frozenset({0, 1, 2}))
    plain = PrefixCachedModel(model, block_size=BS, max_cached_tokens=256, sliding_windows=False)
    assert pcm.pool.nbytes <= plain.pool.nbytes  # the same bytes ...
    assert pcm.cache.num_blocks > plain.cache.num_blocks  # ... hold more blocks of cached prefix


def test_hits_before_at_and_past_a_window_boundary_equal_the_bare_model(family_model) -> None:
    family, model = family_model
    pcm = wrap(model, max_cached_tokens=512)
    gen = torch.Generator().manual_seed(1)
    base = rand_tokens(gen, 30)
    compare(pcm, model, torch.tensor([base]))  # a miss: keeps the re-send point (7) and the request end (8)
    held = window_blocks_held(pcm)
    assert 0 < held <= 2 * pcm.cache.windows.rule.max_blocks(BS) < 8  # points hold their windows, not all 8
    assert pcm.cache.windows.num_idle > 0  # the other blocks' windows stay while slots are spare
    for cut in (5, 8, 9, 12, 16, 17, 24, 29):  # the shared prefix ends before, at and past window boundaries
        prompt = base[:cut] + rand_tokens(gen, 7)
        compare(pcm, model, torch.tensor([prompt]))
        pcm.cache.check_integrity()
    # the same prompt again, then a longer turn: served the kept points exactly
    out = compare(pcm, model, torch.tensor([base]))
    assert pcm.last_request_stats[0].cached_tokens == (len(base) - 1) // BS * BS
    turn = out.sequences[0].tolist() + rand_tokens(gen, 6)
    compare(pcm, model, torch.tensor([turn]))
    assert pcm.last_request_stats[0].cached_tokens >= (len(base) + 4 - 1) // BS * BS - BS
    assert pcm.cache.num_pinned_blocks == 0 and not pcm.cache.windows.held(("request", 1))
    pcm.cache.check_integrity()


def test_a_match_whose_window_is_gone_is_cut_and_stays_exact(family_model) -> None:
    family, model = family_model
    pcm = wrap(model, max_cached_tokens=512)
    gen = torch.Generator().manual_seed(2)
    base = rand_tokens(gen, 40)
    compare(pcm, model, torch.tensor([base]))
    ws = pcm.cache.windows
    take_every_slot(pcm)  # no window is left: the full layers' blocks stay
    compare(pcm, model, torch.tensor([base + rand_tokens(gen, 3)]))
    cached = pcm.last_request_stats[0].cached_tokens
    if family == "llama4":  # a chunk boundary needs no window: served there
        assert cached > 0 and cached % W == 0
    else:  # no window held: nothing can be served; the cached KV it could not use is named (explain's no_state)
        assert cached == 0 and ws.stats.cut_matches >= 1
        assert pcm.last_request_stats[0].no_state_tokens == (len(base) + 3 - 1) // BS * BS
    pcm.cache.check_integrity()


def test_eviction_reuses_block_ids_without_serving_stale_windows(family_model) -> None:
    """A small pool and prompts sharing prefixes: blocks are evicted and their ids reused again and again; every
    call must still equal the bare model."""
    family, model = family_model
    pcm = wrap(model, max_cached_tokens=40, window_share=0.5)
    gen = torch.Generator().manual_seed(3)
    stems = [rand_tokens(gen, 18) for _ in range(3)]
    hits = 0
    for _ in range(16):
        stem = stems[int(torch.randint(0, 3, (1,), generator=gen))]
        prompt = stem[: int(torch.randint(9, 19, (1,), generator=gen))] + rand_tokens(gen, 3)
        compare(pcm, model, torch.tensor([prompt]))
        hits += pcm.last_request_stats[0].cached_tokens > 0
        pcm.cache.check_integrity()
    assert pcm.cache.stats.blocks_evicted > 0 and hits > 0


def test_padded_batches_equal_the_bare_model(family_model) -> None:
    family, model = family_model
    pcm = wrap(model, max_cached_tokens=512)
    gen = torch.Generator().manual_seed(4)
    base = rand_tokens(gen, 26)
    compare(pcm, model, torch.tensor([base]))
    rows = [base[:21] + rand_tokens(gen, 2), base + rand_tokens(gen, 5), rand_tokens(gen, 11)]
    ids, mask = left_pad(rows)
    compare(pcm, model, ids, mask)
    pcm.cache.check_integrity()


def test_windows_on_by_default_off_on_request_and_with_a_tier(tmp_path, family_model) -> None:
    family, model = family_model
    assert PrefixCachedModel(model, block_size=BS).runtime.window is not None
    assert PrefixCachedModel(model, block_size=BS, sliding_windows=False).runtime.window is None
    pcm = wrap(model, disk_cache=str(tmp_path / "tier"))
    assert pcm.runtime.window is None and pcm.cache.windows is None
    pcm.close()


def test_bad_window_settings_are_refused() -> None:
    model = tiny("gemma3")
    with pytest.raises(ValueError, match="window_share"):
        PrefixCachedModel(model, sliding_windows=True, window_share=1.5)
    with pytest.raises(TypeError, match="sliding_windows"):
        PrefixCachedModel(model, sliding_windows="yes")  # type: ignore[arg-type]


def _bare_greedy(model, prompt: list[int], new: int) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["gemma3", "olmo3", "cohere2", "gemma4"])
def test_the_engine_reads_window_slots_exactly(family: str) -> None:
    """generate_batch and score run on the paged engine, whose rows hold window slots only within their windows:
    greedy tokens and log-likelihoods equal the bare model's, hits included."""
    model = tiny(family)
    pcm = wrap(model, max_cached_tokens=512)
    assert pcm.runtime.engine() is not None, pcm.engine_unsupported_reason
    gen = torch.Generator().manual_seed(5)
    base = rand_tokens(gen, 30)
    prompts = [
        base + rand_tokens(gen, 5),
        base[:17] + rand_tokens(gen, 9),
        base + rand_tokens(gen, 5),
        rand_tokens(gen, 40),
    ]
    cached = []
    for _ in range(2):
        outs = pcm.generate_batch(prompts, max_new_tokens=6, do_sample=False)
        for prompt, out in zip(prompts, outs.values()):
            assert out.generated_tokens == _bare_greedy(model, prompt, 6)
        cached.append([o.cached_tokens for o in outs.values()])
    assert sum(cached[1]) > sum(cached[0])  # the second round is served the first's points
    ctx, cont = base + rand_tokens(gen, 3), rand_tokens(gen, 4)
    for _ in range(2):
        (got,) = pcm.score([(ctx, cont)])
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].float(), -1)
        want = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
        assert abs(got.logprob - want) < 1e-4
    assert got.cached_tokens > 0
    stats = pcm.cache_stats()
    assert stats["window_points"] == pcm.cache.windows.num_points > 0 and stats["window_slots_held"] > 0
    pcm.cache.check_integrity()
    ws = pcm.cache.windows
    assert pcm.cache.num_pinned_blocks == 0
    assert all(k[0] == "point" for b in range(ws.num_blocks) for k in ws._holders.get(b, ()))  # no request holds


def test_the_engine_under_pressure_preempts_and_replaces_duplicates_exactly() -> None:
    """A pool short of blocks and window slots, identical prompts prefilled side by side (their blocks become
    duplicates whose window slots move to the tree's), preemption: every reply equals the bare model's and the
    cache ends consistent with only points holding slots."""
    from engine.batching.scheduler import SchedulerConfig

    model = tiny("gemma3")
    pcm = wrap(
        model,
        max_cached_tokens=48,
        window_share=0.5,
        engine_config=SchedulerConfig(max_step_tokens=24, max_chunk_tokens=8, share_wait=False),
    )
    gen = torch.Generator().manual_seed(6)
    stem = rand_tokens(gen, 20)
    prompts = [stem + rand_tokens(gen, 4), stem + rand_tokens(gen, 4), list(stem), list(stem), rand_tokens(gen, 30)]
    for _ in range(3):
        outs = pcm.generate_batch(prompts, max_new_tokens=5, do_sample=False)
        for prompt, out in zip(prompts, outs.values()):
            assert out.finish_reason == "length" and out.generated_tokens == _bare_greedy(model, prompt, 5)
        pcm.cache.check_integrity()
    assert pcm.cache.num_pinned_blocks == 0 and pcm.cache.num_owned_blocks == 0
    ws = pcm.cache.windows
    assert pcm.cache.stats.blocks_evicted > 0 and ws.stats.points_evicted > 0 and ws.stats.cut_matches > 0
    assert all(k[0] == "point" for b in range(ws.num_blocks) for k in ws._holders.get(b, ()))


def test_chunked_models_stay_off_the_paged_engine() -> None:
    """The paged attention builds no chunk masks: Llama 4 runs the contiguous path (exact there), not the engine."""
    pcm = wrap(tiny("llama4"))
    assert pcm.runtime.engine() is None and "chunked" in (pcm.engine_unsupported_reason or "")
    plain = PrefixCachedModel(tiny("llama4"), block_size=BS)
    assert plain.runtime.engine() is None and "chunked" in (plain.engine_unsupported_reason or "")
