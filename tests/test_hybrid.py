"""Hybrid models (recurrent SSM / linear-attention layers beside attention layers) and the MLA families, against the
bare model: greedy tokens equal, first-step logits and log-likelihoods within float tolerance, on the contiguous
``generate`` path and on the engine (``generate_batch``, ``score``). Cached tokens are checked against what the
snapshot policy (``prefixcache.core.snapshots``) says by hand: a prompt re-sent is served up to its re-send point,
a chat's next turn up to the last block boundary of the history, a prompt sharing a prefix up to the deepest
snapshot the shared KV reaches. Every test ends with a consistent cache and every live state slot returned.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from hybrid_testutil import FAMILIES, RECURRENT, build

from engine import PoolTooLargeError, PrefixCachedModel, UnsupportedModelError

BS = 16
NEW = 6
EOS = 2  # the tiny configs' eos id: suppressed, so every reply runs to its length
MLA = [f for f in FAMILIES if f not in RECURRENT]
TOL = 1e-4


@functools.cache
def model_of(family: str) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers: "falling back to its reference PyTorch implementation"
        return build(family)


def _gen(fn, ids: torch.Tensor, n: int = NEW, **kw):
    return fn(
        ids,
        attention_mask=kw.pop("attention_mask", torch.ones_like(ids)),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        suppress_tokens=[EOS],
        **kw,
    )


def _rand(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=g).tolist()


def _same_first_step(pcm, model, ids: torch.Tensor) -> None:
    """Greedy tokens equal the bare model's; the first step's logits within float tolerance."""
    out = _gen(pcm.generate, ids, output_scores=True, return_dict_in_generate=True)
    ref = _gen(model.generate, ids, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    a, b = out.scores[0].float(), ref.scores[0].float()
    finite = torch.isfinite(b)
    assert float((a[finite] - b[finite]).abs().max() / b[finite].abs().max()) < TOL


def _consistent(pcm) -> None:
    pcm.cache.check_integrity()
    assert pcm.cache.num_active_requests == 0
    hy = pcm.runtime.hybrid
    if hy is not None:
        hy.check_integrity()
        assert hy.free_live == hy.live  # every live state slot given back


@pytest.mark.parametrize("family", RECURRENT)
def test_generate_is_exact_and_served_from_snapshots(family):
    model = model_of(family)
    pcm = PrefixCachedModel(model, max_cached_tokens=4096, block_size=BS)
    assert pcm.runtime.hybrid is not None
    g = torch.Generator().manual_seed(5)
    shared = _rand(g, 40)
    first = shared + _rand(g, 9)  # 49 tokens: its re-send point is block (49 - 1) // 16 = 3
    for attempt in range(2):
        _same_first_step(pcm, model, torch.tensor([first]))
        assert pcm.last_request_stats[0].cached_tokens == (0 if attempt == 0 else 48)
    # a prompt sharing 40 tokens: its KV match is 2 blocks, but the deepest snapshot there is... none yet (the first
    # prompt kept states at blocks 3 and its end): it recomputes, and keeps its state where they part (block 2)
    second = shared + _rand(g, 12)
    _same_first_step(pcm, model, torch.tensor([second]))
    assert pcm.last_request_stats[0].cached_tokens == 0
    third = shared + _rand(g, 5)
    _same_first_step(pcm, model, torch.tensor([third]))
    assert pcm.last_request_stats[0].cached_tokens == 32
    # a four-turn chat: each turn is served the whole history up to its last block boundary
    conv, history = _rand(g, 20), 0  # history: tokens the previous turn committed (its prompt and reply)
    for turn in range(4):
        ids = torch.tensor([conv])
        out = _gen(pcm.generate, ids, 8)
        assert torch.equal(out, _gen(model.generate, ids, 8))
        if turn:
            assert pcm.last_request_stats[0].cached_tokens == history // BS * BS
        history = len(conv) + 8 - 1  # the last generated token has no KV (nor state) yet
        conv = out[0].tolist() + _rand(g, 7)
    _consistent(pcm)


@pytest.mark.parametrize("family", RECURRENT + MLA)
def test_engine_batches_and_scores_are_exact(family):
    model = model_of(family)
    pcm = PrefixCachedModel(model, max_cached_tokens=4096, block_size=BS)
    assert pcm.engine() is not None, pcm.engine_unsupported_reason
    g = torch.Generator().manual_seed(7)
    shared = _rand(g, 45)
    prompts = [shared + _rand(g, k) for k in (3, 9, 17, 1)]
    bare = [_gen(model.generate, torch.tensor([p]))[0, len(p) :].tolist() for p in prompts]
    for rnd in range(2):
        outs = pcm.generate_batch(prompts, max_new_tokens=NEW, do_sample=False, suppress_tokens=None)
        got = [outs[f"req_{i}"] for i in range(len(prompts))]
        for o, want in zip(got, bare):
            assert o.error is None and o.generated_tokens == want[: len(o.generated_tokens)]
        cached = [o.cached_tokens for o in got]
        if rnd == 0:
            # together, in token order: the one-token tail computes the shared prefix; the others wait for it, and
            # it keeps its state where they part (block 2), so even these first sightings are served 32 tokens
            assert sorted(cached) == [0, 32, 32, 32], cached
        else:  # each is served up to its re-send point
            assert cached == [(len(p) - 1) // BS * BS for p in prompts]
    pairs = [(shared, _rand(g, k)) for k in (2, 4, 3)]
    for _ in range(2):
        res = pcm.score(pairs)
        for (ctx, cont), r in zip(pairs, res):
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].double(), -1)
            want = sum(float(lp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))
            assert abs(r.logprob - want) < TOL * max(1.0, abs(want))
    assert [r.cached_tokens for r in res] == [(len(shared) - 1) // BS * BS] * 3
    _consistent(pcm)


def test_mla_families_on_the_contiguous_path():
    for family in MLA:
        model = model_of(family)
        pcm = PrefixCachedModel(model, max_cached_tokens=2048, block_size=BS)
        assert pcm.runtime.hybrid is None  # latents are attention KV: no state to keep
        g = torch.Generator().manual_seed(9)
        ids = torch.tensor([_rand(g, 37)])
        for attempt in range(2):
            _same_first_step(pcm, model, ids)
            assert pcm.last_request_stats[0].cached_tokens == (0 if attempt == 0 else 32)
        _consistent(pcm)


@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1", "jamba"])
def test_left_padded_batches_serve_each_row_from_its_own_snapshot(family):
    """Rows of different lengths and cached prefixes in one generate: each equals the bare model run alone (padding
    never reaches a recurrent state: every row's suffix is prefilled on its own)."""
    model = model_of(family)
    pcm = PrefixCachedModel(model, max_cached_tokens=4096, block_size=BS)
    g = torch.Generator().manual_seed(11)
    shared = _rand(g, 36)
    rows = [shared + _rand(g, k) for k in (2, 11, 25)] + [_rand(g, 7)]
    _gen(pcm.generate, torch.tensor([rows[1]]))  # the second row is cached (to its re-send point) beforehand
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = _gen(pcm.generate, ids, attention_mask=mask)
    for i, r in enumerate(rows):
        assert out[i, width:].tolist() == _gen(model.generate, torch.tensor([r]))[0, len(r) :].tolist()
    assert [s.cached_tokens for s in pcm.last_request_stats] == [32, (len(rows[1]) - 1) // BS * BS, 32, 0]
    _consistent(pcm)


def test_sampling_copies_are_those_of_the_bare_model():
    model = model_of("qwen3_5")
    pcm = PrefixCachedModel(model, max_cached_tokens=4096, block_size=BS)
    ids = torch.tensor([list(range(3, 43))])
    for _ in range(2):
        torch.manual_seed(3)
        out = pcm.generate(ids, max_new_tokens=5, do_sample=True, num_return_sequences=3, pad_token_id=0)
        torch.manual_seed(3)
        ref = model.generate(ids, max_new_tokens=5, do_sample=True, num_return_sequences=3, pad_token_id=0)
        assert torch.equal(out, ref)
    assert pcm.last_request_stats[0].cached_tokens == 32
    _consistent(pcm)


def test_a_hint_serves_the_second_prompt_that_shares_a_system_prompt():
    """Without a hint the second prompt sharing a 40-token system prompt recomputes it (as SGLang's and vLLM's
    caches do); with the system prompt's end as a hint, it is served its first two blocks."""
    model = model_of("qwen3_5")
    g = torch.Generator().manual_seed(13)
    system = _rand(g, 40)
    a, b = system + _rand(g, 30), system + _rand(g, 20)
    for hint, want in ((None, 0), ([40], 32)):
        pcm = PrefixCachedModel(model, max_cached_tokens=4096, block_size=BS)
        _gen(pcm.generate, torch.tensor([a]), snapshot_hints=hint)
        out = _gen(pcm.generate, torch.tensor([b]))
        assert torch.equal(out, _gen(model.generate, torch.tensor([b])))
        assert pcm.last_request_stats[0].cached_tokens == want
        _consistent(pcm)
    with pytest.raises(ValueError, match="snapshot_hints"):
        pcm.generate(torch.tensor([a]), max_new_tokens=1, snapshot_hints=[-3])


def test_preemption_and_a_small_pool_on_the_engine():
    """Eight requests in a pool of 20 blocks: preemption gives back their state slots; every output is exact."""
    model = model_of("qwen3_5")
    pcm = PrefixCachedModel(model, max_cached_tokens=20 * BS, block_size=BS)
    g = torch.Generator().manual_seed(17)
    shared = _rand(g, 24)
    prompts = [shared + _rand(g, 5 + 3 * i) for i in range(8)]
    outs = pcm.generate_batch(prompts, max_new_tokens=12, do_sample=False)
    for i, p in enumerate(prompts):
        want = _gen(model.generate, torch.tensor([p]), 12)[0, len(p) :].tolist()
        got = outs[f"req_{i}"]
        assert got.error is None and got.generated_tokens == want[: len(got.generated_tokens)]
    assert pcm.engine().stats.preemptions > 0
    _consistent(pcm)


def test_weights_and_dtype_changes_drop_the_states():
    model = build("bamba")
    pcm = PrefixCachedModel(model, max_cached_tokens=2048, block_size=BS)
    ids = torch.tensor([list(range(3, 40))])
    _gen(pcm.generate, ids)
    assert len(pcm.runtime.hybrid.index) > 0
    with torch.no_grad():
        next(model.parameters()).mul_(1.5)
    with pytest.warns(UserWarning, match="weights changed"):
        out = _gen(pcm.generate, ids)
    assert torch.equal(out, _gen(model.generate, ids)) and pcm.last_request_stats[0].cached_tokens == 0
    pcm.to(torch.bfloat16)
    for _ in range(2):  # a new state pool in bf16: served from it on the second call
        out = _gen(pcm.generate, ids)
        assert torch.equal(out, _gen(model.generate, ids))
    assert pcm.last_request_stats[0].cached_tokens == 32
    assert {t.dtype for t in pcm.runtime.hybrid.spec.tensors if t.kind == "conv"} == {torch.bfloat16}
    _consistent(pcm)


def test_bad_settings_and_unsupported_models_get_clear_errors(tmp_path):
    model = model_of("qwen3_5")
    with pytest.raises(ValueError, match="max_cached_states"):
        PrefixCachedModel(model, max_cached_tokens=512, max_cached_states=0)
    with pytest.raises(PoolTooLargeError, match="recurrent-state pool"):
        PrefixCachedModel(model, max_cached_tokens=512, max_cached_states=10**9)
    with pytest.raises(ValueError, match="recurrent-state snapshots"):  # a disk tier too small for one snapshot
        PrefixCachedModel(model, max_cached_tokens=512, disk_cache=tmp_path, max_disk_bytes=40_000)
    import transformers as T

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mamba = T.MambaForCausalLM(T.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4))
    with pytest.raises(UnsupportedModelError, match="recurrent layers only"):
        PrefixCachedModel(mamba.eval(), max_cached_tokens=64)


@pytest.mark.parametrize("use_engine", [True, False], ids=["engine", "batcher"])
def test_served_chats_behind_one_system_prompt(use_engine):
    """``prefixcache serve`` on a hybrid preset: the second user's first turn is served the system prompt (its end
    is a message end: a snapshot hint), later turns their history; every reply is the bare model's."""
    import openai
    from serve_testutil import bare_greedy, server_thread

    from engine import ModelRuntime, RuntimeConfig
    from engine.models import build_preset
    from engine.serve.app import create_app
    from engine.serve.backend import LocalBackend

    model, tok = build_preset("tiny-hybrid")
    runtime = ModelRuntime.load("tiny-hybrid", RuntimeConfig(max_cached_tokens=8192, block_size=BS))
    backend = LocalBackend(runtime, "tiny-hybrid", use_engine=use_engine)
    assert backend.info.hybrid and backend.runs_engine() == use_engine
    system = {"role": "system", "content": "You answer questions about prefix caching, briefly. " * 3}

    def ids_of(messages):
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])

    system_end = len(tok.apply_chat_template([system], tokenize=True)["input_ids"])
    with server_thread(create_app(backend)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        cached = []
        for user in ("What is a block?", "Why keep states?"):
            messages = [system, {"role": "user", "content": user}]
            for _ in range(2):
                r = client.chat.completions.create(model="tiny-hybrid", messages=messages, max_tokens=6, temperature=0)
                want = tok.decode(bare_greedy(model, ids_of(messages), 6), skip_special_tokens=True)
                assert r.choices[0].message.content == want
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
                messages += [{"role": "assistant", "content": want}, {"role": "user", "content": "And then?"}]

        def check() -> None:
            runtime.cache.check_integrity()
            assert runtime.hybrid is not None
            runtime.hybrid.check_integrity()

        backend.worker.run_exclusive(check).result(timeout=30)
    assert cached[0] == 0 and cached[1] > system_end  # the first user's second turn: its history
    assert cached[2] == system_end // BS * BS > 0  # the second user's FIRST turn: the system prompt
    assert cached[3] > cached[2]


def test_items_that_share_exemplars_are_served_them_on_first_sight():
    """Multiple choice: three items behind one exemplar prefix, scored together with small prefill chunks. The
    first request computes the exemplars; the first request of each other item waits for it and is served the
    exemplars (the running one ends a chunk where they part and keeps its state there), each item's other choices
    its whole context. Log-likelihoods equal the bare model's."""
    from engine.batching.scheduler import SchedulerConfig

    model = model_of("qwen3_5")
    pcm = PrefixCachedModel(
        model, max_cached_tokens=8192, block_size=BS, engine_config=SchedulerConfig(max_chunk_tokens=64)
    )
    g = torch.Generator().manual_seed(19)
    exemplars = _rand(g, 150)
    items = [exemplars + _rand(g, 21) for _ in range(3)]
    pairs = [(ctx, _rand(g, 4)) for ctx in items for _ in range(3)]
    res = pcm.score(pairs)
    for (ctx, cont), r in zip(pairs, res):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].double(), -1)
        assert abs(r.logprob - sum(float(lp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))) < 1e-4
    per_item = sorted(sorted(r.cached_tokens for r in res[3 * i : 3 * i + 3]) for i in range(3))
    context = (len(items[0]) - 1) // BS * BS
    assert per_item == [[0, context, context]] + [[150 // BS * BS, context, context]] * 2
    _consistent(pcm)


def test_a_disk_tier_keeps_states_with_the_kv_across_a_restart(tmp_path):
    """The tier holds the K/V blocks and the snapshots, each entry bound to the model: a restarted process serves a
    prompt from disk on both paths, exactly; a pure-attention model's entries in the same directory are never read
    by the hybrid one (another binding: a miss)."""
    model = model_of("qwen3_5")
    g = torch.Generator().manual_seed(23)
    ids = torch.tensor([_rand(g, 100)])
    ref = _gen(model.generate, ids)
    first = PrefixCachedModel(model, max_cached_tokens=2048, block_size=BS, disk_cache=tmp_path / "a")
    assert torch.equal(_gen(first.generate, ids), ref)
    first.close()
    again = PrefixCachedModel(model, max_cached_tokens=2048, block_size=BS, disk_cache=tmp_path / "a")
    assert torch.equal(_gen(again.generate, ids), ref)
    row = again.last_request_stats[0]
    assert row.cached_tokens == row.tier_tokens == 96
    assert again.cache_stats()["state_tier_served"] == 1
    _consistent(again)
    again.close()
    engine = PrefixCachedModel(model, max_cached_tokens=2048, block_size=BS, disk_cache=tmp_path / "a")
    out = engine.generate_batch([ids[0].tolist()], max_new_tokens=NEW, do_sample=False)["req_0"]
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert out.generated_tokens == want[0, 100:].tolist()[: len(out.generated_tokens)] and out.cached_tokens == 96
    _consistent(engine)
    engine.close()
    llama = build("deepseek_v3")  # a pure-attention model writes its entries first
    other = PrefixCachedModel(llama, max_cached_tokens=2048, block_size=BS, disk_cache=tmp_path / "b")
    _gen(other.generate, ids)
    other.close()
    hybrid = PrefixCachedModel(model, max_cached_tokens=2048, block_size=BS, disk_cache=tmp_path / "b")
    assert torch.equal(_gen(hybrid.generate, ids), ref) and hybrid.last_request_stats[0].cached_tokens == 0
    hybrid.close()
