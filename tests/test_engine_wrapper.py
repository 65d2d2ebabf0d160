"""PrefixCachedModel: bad input, uncached routes, refused models, interrupts, batching details."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import transformers as T
from engine_testutil import BS, compare, left_pad, rand_tokens, tiny_model

from engine import PrefixCachedModel, UncachedCallWarning, UnsupportedModelError


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture
def pcm(llama):
    return PrefixCachedModel(llama, max_cached_tokens=1024, block_size=BS)


def _consistent(pcm) -> None:
    pcm.cache.check_integrity()
    assert pcm.cache.num_active_requests == 0


def _same_error(fn_ref, fn_test, uncached: str | None = None):
    """fn_test raises what fn_ref raises; ``uncached``: fn_test first warns that it runs uncached, saying why."""
    with pytest.raises(Exception) as ref:
        fn_ref()
    with pytest.raises(type(ref.value)):
        if uncached is None:
            fn_test()
        else:
            with pytest.warns(UncachedCallWarning, match=uncached):
                fn_test()


def test_bad_inputs_raise_like_the_model(llama, pcm):
    g = torch.Generator().manual_seed(0)
    warm = torch.tensor([rand_tokens(g, 20)])
    pcm.generate(warm, max_new_tokens=2)
    bad_inputs = (
        (torch.zeros((1, 0), dtype=torch.long), "is empty"),
        (warm.float(), "not integer"),
        (-warm, "negative"),
    )
    for bad, why in bad_inputs:
        _same_error(
            lambda: llama.generate(bad, max_new_tokens=2), lambda: pcm.generate(bad, max_new_tokens=2), uncached=why
        )
        _consistent(pcm)


def test_prompt_longer_than_positions_raises_like_gpt2():
    model = tiny_model("gpt2")  # n_positions=64
    pcm = PrefixCachedModel(model, max_cached_tokens=1024, block_size=BS)
    g = torch.Generator().manual_seed(0)
    base = rand_tokens(g, 40)
    pcm.generate(torch.tensor([base]), max_new_tokens=2)
    long = torch.tensor([base + rand_tokens(g, 40)])  # its first 40 tokens hit the cache
    assert pcm.probe(long[0]) == 40
    _same_error(lambda: model.generate(long, max_new_tokens=2), lambda: pcm.generate(long, max_new_tokens=2))
    _consistent(pcm)
    before = pcm.cache_stats()["blocks_inserted"]
    compare(pcm, model, torch.tensor([base]))  # still serves correctly afterwards
    assert pcm.cache_stats()["blocks_inserted"] == before


class _Interrupt(T.StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise KeyboardInterrupt


def test_interrupt_releases_pins(llama, pcm):
    g = torch.Generator().manual_seed(0)
    a = rand_tokens(g, 20)
    pcm.generate(torch.tensor([a]), max_new_tokens=2)
    with pytest.raises(KeyboardInterrupt):
        pcm.generate(
            torch.tensor([a + [5, 6]]), max_new_tokens=3, stopping_criteria=T.StoppingCriteriaList([_Interrupt()])
        )
    _consistent(pcm)
    assert pcm.cache_stats()["blocks_used"] == 5  # nothing of the interrupted call was committed


def test_uncached_routes_match_model(llama, pcm):
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([rand_tokens(g, 20)])
    pcm.generate(ids, max_new_tokens=2)  # warm the cache with this prompt
    for kw in (dict(num_beams=2), dict(use_cache=False), dict(output_hidden_states=True, return_dict_in_generate=True)):
        calls = pcm.uncached_calls
        ref = llama.generate(ids, max_new_tokens=3, **kw)
        with pytest.warns(UncachedCallWarning, match="without the prefix cache"):
            out = pcm.generate(ids, max_new_tokens=3, **kw)
        seq_ref = ref if isinstance(ref, torch.Tensor) else ref.sequences
        seq_out = out if isinstance(out, torch.Tensor) else out.sequences
        assert torch.equal(seq_out, seq_ref), kw
        assert pcm.uncached_calls == calls + 1, kw
        assert pcm.last_uncached_reason
    with warnings.catch_warnings():  # once per reason
        warnings.simplefilter("error")
        pcm.generate(ids, max_new_tokens=3, num_beams=2)
    embeds = llama.get_input_embeddings()(ids)
    ref = llama.generate(inputs_embeds=embeds, max_new_tokens=3)
    with pytest.warns(UncachedCallWarning, match="no input_ids"):
        assert torch.equal(pcm.generate(inputs_embeds=embeds, max_new_tokens=3), ref)
    with pytest.raises(ValueError, match="past_key_values"):
        pcm.generate(ids, past_key_values=T.DynamicCache(), max_new_tokens=2)
    with pytest.raises(ValueError, match="cache"):
        pcm.generate(ids, cache=T.DynamicCache(), max_new_tokens=2)
    _consistent(pcm)


def test_namespaces_never_share(llama, pcm):
    ids = torch.tensor([list(range(3, 23))])
    pcm.generate(ids, max_new_tokens=2, namespace="a")
    pcm.generate(ids, max_new_tokens=2, namespace="b")
    (r,) = pcm.last_request_stats
    assert (r.prompt_tokens, r.cached_tokens, r.inserted_blocks) == (20, 0, 5)  # 20 + 2 - 1 = 21 tokens -> 5 blocks
    assert (r.namespace_tokens, r.partial_block_tokens) == (16, 4)  # why: the same tokens are cached under "a"
    pcm.generate(ids, max_new_tokens=2, namespace="a")
    assert pcm.last_request_stats[0].cached_tokens == 16


def test_batch_with_eos_pads_finished_rows_like_batched_generate(llama, pcm):
    g = torch.Generator().manual_seed(4)
    rows = [rand_tokens(g, 13), rand_tokens(g, 7), rand_tokens(g, 10)]
    ids, mask = left_pad(rows)
    free = llama.generate(ids, attention_mask=mask, max_new_tokens=6)
    eos = int(free[0, ids.shape[1] + 1])  # row 0 stops at its second token
    pcm.generate(torch.tensor([rows[0]]), max_new_tokens=6)  # row 0 gets a hit
    ref = llama.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    out = pcm.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        eos_token_id=eos,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert torch.equal(out.sequences, ref.sequences)
    assert pcm.last_request_stats[0].cached_tokens == 12
    assert len(out.scores) == len(ref.scores)
    for t, (a, b) in enumerate(zip(out.scores, ref.scores)):
        live = [r for r in range(3) if not (out.sequences[r, ids.shape[1] : ids.shape[1] + t] == eos).any()]
        assert torch.allclose(a[live], b[live], atol=1e-4)


def test_max_length_counts_the_padded_prompt(llama, pcm):
    g = torch.Generator().manual_seed(5)
    ids, mask = left_pad([rand_tokens(g, 12), rand_tokens(g, 5)])
    ref = llama.generate(ids, attention_mask=mask, max_length=16, min_length=15)
    assert torch.equal(pcm.generate(ids, attention_mask=mask, max_length=16, min_length=15), ref)


def test_sampling_streamer_and_stopping_criteria(llama, pcm):
    g = torch.Generator().manual_seed(6)
    a = rand_tokens(g, 20)
    pcm.generate(torch.tensor([a]), max_new_tokens=2)
    ids = torch.tensor([a + rand_tokens(g, 3)])
    torch.manual_seed(11)
    ref = llama.generate(ids, do_sample=True, top_k=20, max_new_tokens=5)
    torch.manual_seed(11)
    out = pcm.generate(ids, do_sample=True, top_k=20, max_new_tokens=5)
    assert torch.equal(out, ref)
    assert pcm.last_request_stats[0].cached_tokens == 20

    class Collect(T.generation.streamers.BaseStreamer):
        def __init__(self):
            self.parts, self.ended = [], False

        def put(self, value):
            self.parts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    streamer = Collect()
    stop = T.StoppingCriteriaList([T.MaxLengthCriteria(max_length=ids.shape[1] + 2)])
    out = pcm.generate(ids, max_new_tokens=5, streamer=streamer, stopping_criteria=stop)
    assert out.shape[1] == ids.shape[1] + 2
    assert streamer.ended and sum(streamer.parts, []) == out[0].tolist()
    _consistent(pcm)


def test_threads_share_one_cache(llama, pcm):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.tensor([rand_tokens(g, 12 + i)]) for i in range(4)]
    refs = [llama.generate(p, max_new_tokens=3) for p in prompts]
    errors = []

    def work(i):
        try:
            for _ in range(2):
                assert torch.equal(pcm.generate(prompts[i], max_new_tokens=3), refs[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    _consistent(pcm)
    assert pcm.cache_stats()["lookups_with_hit"] == 4


def test_attributes_fall_through(llama, pcm):
    assert pcm.config is llama.config and pcm.device == llama.device and pcm.model is llama
    pcm.generate(torch.tensor([list(range(3, 20))]), max_new_tokens=2)
    pcm.reset_cache()
    assert pcm.cache_stats()["blocks_used"] == 0 and pcm.cache_stats()["lookups"] == 0


def test_pool_sizing(llama):
    by_tokens = PrefixCachedModel(llama, max_cached_tokens=100, block_size=BS)
    assert by_tokens.cache.num_blocks == 25
    # tiny llama: 2 layers x (K + V) x 2 kv heads x 8 dims x 4 bytes = 256 bytes per token
    per_block = 2 * 2 * 2 * 8 * 4 * BS
    by_bytes = PrefixCachedModel(llama, max_cached_bytes=10 * per_block + 5, block_size=BS)
    assert by_bytes.cache.num_blocks == 10
    assert by_bytes.pool.nbytes == 10 * per_block
    with pytest.raises(ValueError, match="not both"):
        PrefixCachedModel(llama, max_cached_tokens=10, max_cached_bytes=10)
    with pytest.raises(ValueError, match="no block"):
        PrefixCachedModel(llama, max_cached_tokens=3, block_size=BS)


def _mamba():
    cfg = T.MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=2)
    torch.manual_seed(0)
    return T.MambaForCausalLM(cfg).eval()


def _t5():
    cfg = T.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    torch.manual_seed(0)
    return T.T5ForConditionalGeneration(cfg).eval()


@pytest.mark.parametrize("make, reason", [(_mamba, "recurrent"), (_t5, "encoder-decoder")])
def test_unsupported_models_refused_or_passed_through(make, reason):
    model = make()
    with pytest.raises(UnsupportedModelError, match=reason):
        PrefixCachedModel(model, max_cached_tokens=64)
    pcm = PrefixCachedModel(model, max_cached_tokens=64, on_unsupported="passthrough")
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    ref = model.generate(ids, max_new_tokens=3, do_sample=False)
    with pytest.warns(UncachedCallWarning, match=f"model not cacheable: .*{reason}"):
        assert torch.equal(pcm.generate(ids, max_new_tokens=3, do_sample=False), ref)
    assert pcm.uncached_calls == 1 and reason in pcm.last_uncached_reason


def test_inference_mode_then_plain(llama):
    with torch.inference_mode():
        pcm = PrefixCachedModel(llama, max_cached_tokens=256, block_size=BS)
        ids = torch.tensor([list(range(3, 30))])
        pcm.generate(ids, max_new_tokens=2)
    compare(pcm, llama, ids)  # outside inference mode: reuses pool and gather buffers made inside it
    with torch.inference_mode():
        compare(pcm, llama, ids)
    assert pcm.last_request_stats[0].cached_tokens == 24


def test_returned_cache_is_not_overwritten_by_later_calls(llama, pcm):
    """Hits append into reusable gather buffers; a cache handed back to the caller must keep its values."""
    g = torch.Generator().manual_seed(7)
    shared = rand_tokens(g, 3 * BS)
    a = torch.tensor([shared + rand_tokens(g, 5)])
    pcm.generate(a, max_new_tokens=2)  # warm: the shared blocks are cached
    out = pcm.generate(a, max_new_tokens=3, return_dict_in_generate=True)
    held = out.cache if "cache" in out else out.past_key_values
    assert pcm.last_request_stats[0].cached_tokens > 0
    snapshot = [(layer.keys.clone(), layer.values.clone()) for layer in held.layers]
    ref = llama.generate(a, max_new_tokens=3, return_dict_in_generate=True)
    ref_cache = ref.cache if "cache" in ref else ref.past_key_values
    for (k, v), layer in zip(snapshot, ref_cache.layers):  # the held cache is the model's own KV
        assert torch.allclose(k, layer.keys, atol=1e-5) and torch.allclose(v, layer.values, atol=1e-5)
    for _ in range(2):  # later, smaller hits on the same prefix gather into the same room and append there
        pcm.generate(torch.tensor([shared + rand_tokens(g, 2)]), max_new_tokens=2)
    for (k, v), layer in zip(snapshot, held.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)
    _consistent(pcm)


def test_finished_rows_are_cached_up_to_their_eos_only(llama, pcm):
    g = torch.Generator().manual_seed(11)
    rows = [rand_tokens(g, 13), rand_tokens(g, 9)]
    ids, mask = left_pad(rows)
    free = llama.generate(ids, attention_mask=mask, max_new_tokens=8)
    first, eos = int(free[0, ids.shape[1]]), int(free[0, ids.shape[1] + 1])  # row 0 stops at its 2nd token
    assert eos != first and eos not in rows[0]
    out = pcm.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
    ref = llama.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)
    # row 0 holds prompt + [first, eos] + pads: only its 15 real tokens (3 full blocks) were cached
    padded = rows[0] + [first, eos] + [0] * 8
    assert pcm.probe(torch.tensor(padded)) == (15 // BS) * BS
    assert pcm.probe(torch.tensor(rows[0] + [first, eos, 5])) == (15 // BS) * BS
    _consistent(pcm)


def test_num_return_sequences_with_sampling_matches_the_model(llama, pcm):
    g = torch.Generator().manual_seed(21)
    a, b = rand_tokens(g, 20), rand_tokens(g, 7)
    pcm.generate(torch.tensor([a + [5]]), max_new_tokens=2)  # a's blocks are cached
    ids, mask = left_pad([a + [9, 9], b])
    for args in ((torch.tensor([a + [5, 6, 7]]), None), (ids, mask)):
        torch.manual_seed(3)
        out = pcm.generate(args[0], attention_mask=args[1], do_sample=True, num_return_sequences=3, max_new_tokens=5)
        torch.manual_seed(3)
        ref = llama.generate(args[0], attention_mask=args[1], do_sample=True, num_return_sequences=3, max_new_tokens=5)
        assert torch.equal(out, ref)
        assert pcm.last_request_stats[0].cached_tokens == 20
    _same_error(
        lambda: llama.generate(torch.tensor([a]), num_return_sequences=2, max_new_tokens=2),
        lambda: pcm.generate(torch.tensor([a]), num_return_sequences=2, max_new_tokens=2),
        uncached="invalid generation settings",
    )
    _consistent(pcm)


def test_nested_call_from_a_callback_runs_uncached_and_stays_exact(llama, pcm):
    g = torch.Generator().manual_seed(22)
    a, b = rand_tokens(g, 20), rand_tokens(g, 20)

    class Nest(T.LogitsProcessor):
        def __call__(self, input_ids, scores):
            pcm.generate(torch.tensor([b + [3] * 10]), max_new_tokens=3)  # would reuse the outer call's buffers
            return scores

    pcm.generate(torch.tensor([a + [5]]), max_new_tokens=2)
    pcm.generate(torch.tensor([b + [3] * 10]), max_new_tokens=3)
    ids = torch.tensor([a + [5, 6, 7, 8]])
    before = pcm.uncached_calls
    with pytest.warns(UncachedCallWarning, match="nested call"):
        out = pcm.generate(ids, max_new_tokens=6, logits_processor=T.LogitsProcessorList([Nest()]))
    assert torch.equal(out, llama.generate(ids, max_new_tokens=6))
    assert pcm.uncached_calls - before == 6  # one nested call per step
    later = torch.tensor([a + [5, 6, 7, 8] + out[0, -6:].tolist() + [1]])  # hits what the outer call stored
    assert torch.equal(pcm.generate(later, max_new_tokens=3), llama.generate(later, max_new_tokens=3))
    assert pcm.last_request_stats[0].cached_tokens >= 24
    _consistent(pcm)


def test_casting_the_wrapper_keeps_it_and_moves_the_pool(llama):
    from engine.runtime import eos_ids

    model = tiny_model("llama")
    pcm = PrefixCachedModel(model, max_cached_tokens=512, block_size=BS)
    g = torch.Generator().manual_seed(23)
    ids = torch.tensor([rand_tokens(g, 21)])
    pcm.generate(ids, max_new_tokens=2)
    assert pcm.to(torch.bfloat16) is pcm and pcm.half() is pcm and pcm.bfloat16() is pcm
    for _ in range(2):  # first call remakes the pool in bf16 (a miss), the second hits
        assert torch.equal(pcm.generate(ids, max_new_tokens=4), model.generate(ids, max_new_tokens=4))
    assert pcm.pool.dtype == torch.bfloat16 and pcm.last_request_stats[0].cached_tokens == 20
    assert pcm.cache_stats()["lookups"] == 3  # counters survive the remake
    gc = T.GenerationConfig(eos_token_id=[2, 7])
    assert eos_ids(gc) == (2, 7) and eos_ids(T.GenerationConfig(eos_token_id=3)) == (3,)
    _consistent(pcm)
