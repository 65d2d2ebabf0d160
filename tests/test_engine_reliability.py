"""PrefixCachedModel under hostile use: weight changes, forced hash collisions, bad sizes, interrupts inside
release, a reset from inside a running generate, a failed commit; and what the model really computes on a hit."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import transformers as T
from engine_testutil import BS, compare, left_pad, rand_tokens, tiny_model

from engine import PrefixCachedModel, StaleCacheWarning, UnverifiedCacheWarning, hf_cache


def _consistent(pcm) -> None:
    pcm.cache.check_integrity()
    assert pcm.cache.num_active_requests == 0


# ---- weights changed in place between calls ------------------------------------------------------------
def _warm(pcm, model, prompt: list[int]) -> torch.Tensor:
    """Cache ``prompt`` and check that the next call on it really hits."""
    ids = torch.tensor([prompt])
    compare(pcm, model, ids)
    compare(pcm, model, ids)
    assert pcm.last_request_stats[0].cached_tokens == (len(prompt) - 1) // BS * BS > 0
    return ids


def test_fine_tune_step_between_calls_drops_the_stale_kv():
    model = tiny_model("llama")
    pcm = PrefixCachedModel(model, max_cached_tokens=1024, block_size=BS)
    g = torch.Generator().manual_seed(30)
    ids = _warm(pcm, model, rand_tokens(g, 22))
    lookups = pcm.cache_stats()["lookups"]
    # one SGD step, as a fine-tuning loop between two generate calls would take
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    with pytest.warns(StaleCacheWarning, match=r"weights changed .*model\.") as rec:
        compare(pcm, model, ids)  # the bare model with the new weights: same tokens, same first-step logits
    assert len(rec) == 1
    assert pcm.last_request_stats[0].cached_tokens == 0  # nothing computed with the old weights was served
    assert pcm.cache_stats()["lookups"] == lookups + 1  # counters kept
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCacheWarning)
        compare(pcm, model, ids)  # the cache refills with the new weights and hits again
    assert pcm.last_request_stats[0].cached_tokens == 20
    _consistent(pcm)


def test_load_state_dict_of_other_weights_drops_the_cache_and_names_the_tensor():
    model = tiny_model("llama")
    pcm = PrefixCachedModel(model, max_cached_tokens=1024, block_size=BS)
    g = torch.Generator().manual_seed(31)
    ids = _warm(pcm, model, rand_tokens(g, 21))
    assert pcm.probe(ids[0]) == 20
    model.load_state_dict(tiny_model("llama", seed=1).state_dict())
    assert pcm.probe(ids[0]) == 0  # what a generate would serve now
    with pytest.warns(StaleCacheWarning, match="model.embed_tokens.weight"):
        compare(pcm, model, ids)
    assert pcm.last_request_stats[0].cached_tokens == 0
    # a single tensor changed through .data (a LoRA merge does this): noticed too, and named
    _warm(pcm, model, ids[0].tolist())
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.data.mul_(1.5)
    with pytest.warns(StaleCacheWarning, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        compare(pcm, model, ids)
    # a parameter replaced by a new tensor object
    _warm(pcm, model, ids[0].tolist())
    lm_head = model.lm_head
    lm_head.weight = torch.nn.Parameter(lm_head.weight.detach() * 0.5)
    with pytest.warns(StaleCacheWarning, match="lm_head.weight"):
        compare(pcm, model, ids)
    _consistent(pcm)


def test_unchanged_weights_keep_hitting_without_a_warning():
    model = tiny_model("llama")
    pcm = PrefixCachedModel(model, max_cached_tokens=1024, block_size=BS)
    g = torch.Generator().manual_seed(32)
    prompt = rand_tokens(g, 22)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCacheWarning)
        _warm(pcm, model, prompt)
        model.requires_grad_(False)  # flags, modes and reads change no weight
        model.train().eval()
        _ = model.state_dict()
        for _ in range(2):
            compare(pcm, model, torch.tensor([prompt]))
            assert pcm.last_request_stats[0].cached_tokens == 20


# ---- verify_tokens=False and a forced hash collision ---------------------------------------------------
def _constant_hash(parent: bytes, block: bytes) -> bytes:
    """Every block of every prefix collides."""
    return b"x" * 16


def test_forced_collision_is_caught_with_verification_and_serves_wrong_kv_without():
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(33)
    a, b = rand_tokens(g, 21), rand_tokens(g, 21)  # no block in common
    b[0] = a[0] + 1 if a[0] + 1 < 128 else 3
    ids_b = torch.tensor([b])
    ref = model.generate(ids_b, max_new_tokens=4, return_dict_in_generate=True, output_logits=True)

    checked = PrefixCachedModel(model, max_cached_tokens=1024, block_size=BS, hasher=_constant_hash)
    checked.generate(torch.tensor([a]), max_new_tokens=4)
    compare(checked, model, ids_b)  # every block of b collides with a's, and none is served
    assert checked.last_request_stats[0].cached_tokens == 0
    _consistent(checked)

    with pytest.warns(UnverifiedCacheWarning, match="collision"):
        unchecked = PrefixCachedModel(
            model, max_cached_tokens=1024, block_size=BS, verify_tokens=False, hasher=_constant_hash
        )
    unchecked.generate(torch.tensor([a]), max_new_tokens=4)
    out = unchecked.generate(ids_b, max_new_tokens=4, return_dict_in_generate=True, output_logits=True)
    assert unchecked.last_request_stats[0].cached_tokens == 20  # a's KV served for b: the documented risk
    diff = (out.logits[0] - ref.logits[0]).abs().max().item()
    assert diff > 1e-2, "the wrong KV changed nothing: the demonstration proves nothing"
    _consistent(unchecked)


def test_verify_tokens_off_warns_once_on_construction():
    model = tiny_model("llama")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        pcm = PrefixCachedModel(model, max_cached_tokens=256, block_size=BS, verify_tokens=False)
        for _ in range(2):
            pcm.generate(torch.tensor([list(range(3, 20))]), max_new_tokens=2)
        PrefixCachedModel(model, max_cached_tokens=256, block_size=BS)  # on: no warning
    assert [w.category for w in rec] == [UnverifiedCacheWarning]


# ---- sizes ---------------------------------------------------------------------------------------------
def test_bad_sizes_are_clear_errors_naming_the_argument():
    model = tiny_model("llama")
    for kwargs, error in (
        (dict(block_size=0), ValueError),
        (dict(block_size=-4), ValueError),
        (dict(block_size=16.0), TypeError),
        (dict(block_size=True), TypeError),
        (dict(block_size="16"), TypeError),
        (dict(max_cached_tokens=0), ValueError),
        (dict(max_cached_tokens=512.0), TypeError),
        (dict(max_cached_bytes=-1), ValueError),
        (dict(max_cached_bytes=1e6), TypeError),
    ):
        name = next(iter(kwargs))
        with pytest.raises(error, match=name):
            PrefixCachedModel(model, **kwargs)
        with pytest.raises(error, match=name):  # refused before the model is looked at, also in passthrough
            PrefixCachedModel(model, on_unsupported="passthrough", **kwargs)


def test_numpy_integers_are_accepted_for_sizes():
    model = tiny_model("llama")
    pcm = PrefixCachedModel(model, max_cached_tokens=np.int64(256), block_size=np.int64(BS))
    assert pcm.cache.num_blocks == 64 and pcm.block_size == BS and type(pcm.block_size) is int
    per_block = 2 * 2 * 2 * 8 * 4 * BS  # see test_pool_sizing
    by_bytes = PrefixCachedModel(model, max_cached_bytes=np.uint32(10 * per_block), block_size=np.int32(BS))
    assert by_bytes.cache.num_blocks == 10
    ids = torch.tensor([list(range(3, 25))])
    for _ in range(2):
        compare(pcm, model, ids)
    assert pcm.last_request_stats[0].cached_tokens == 20


# ---- release, reset and commit failures ----------------------------------------------------------------
def test_interrupt_inside_release_still_releases_every_handle(monkeypatch):
    model = tiny_model("llama")
    pcm = PrefixCachedModel(model, max_cached_tokens=1024, block_size=BS)
    g = torch.Generator().manual_seed(34)
    rows = [rand_tokens(g, 14), rand_tokens(g, 9), rand_tokens(g, 11)]
    pcm.generate(torch.tensor([rows[0]]), max_new_tokens=2)  # row 0 will hit (a pinned path to release)
    ids, mask = left_pad(rows)
    real = pcm.cache.release
    for fail_at in (1, 2, 3):  # the first, a middle, the last release of the call
        calls = [0]

        def release(handle, fail_at=fail_at, calls=calls):
            calls[0] += 1
            if calls[0] == fail_at:
                raise KeyboardInterrupt
            real(handle)

        monkeypatch.setattr(pcm.cache, "release", release)
        with pytest.raises(KeyboardInterrupt):
            pcm.generate(ids, attention_mask=mask, max_new_tokens=2)
        monkeypatch.setattr(pcm.cache, "release", real)
        _consistent(pcm)
    assert pcm.probe(torch.tensor(rows[0])) == 12


def test_reset_cache_from_inside_generate_keeps_the_output():
    model = tiny_model("llama")
    pcm = PrefixCachedModel(model, max_cached_tokens=1024, block_size=BS)
    g = torch.Generator().manual_seed(35)
    a = rand_tokens(g, 20)
    pcm.generate(torch.tensor([a + [5]]), max_new_tokens=2)

    class ResetOnce(T.LogitsProcessor):
        done = False

        def __call__(self, input_ids, scores):
            if not self.done:
                self.done = True
                pcm.reset_cache()
            return scores

    for rows in ([a + [5, 6, 7]], [a + [5, 6, 7], rand_tokens(g, 9)]):
        ids, mask = left_pad(rows)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=5)
        out = pcm.generate(
            ids, attention_mask=mask, max_new_tokens=5, logits_processor=T.LogitsProcessorList([ResetOnce()])
        )
        assert torch.equal(out, ref)
        assert pcm.last_request_stats[0].cached_tokens == 20  # served before the reset
        assert pcm.cache_stats()["blocks_used"] == 0  # nothing committed into the reset cache
        _consistent(pcm)
        pcm.generate(torch.tensor([a + [5]]), max_new_tokens=2)  # refill for the next round
    compare(pcm, model, torch.tensor([a + [5, 6]]))
    assert pcm.last_request_stats[0].cached_tokens == 20


def test_failed_commit_drops_the_cache_and_uncounts_its_blocks(monkeypatch):
    model = tiny_model("llama")
    pcm = PrefixCachedModel(model, max_cached_tokens=1024, block_size=BS)
    g = torch.Generator().manual_seed(36)
    a = rand_tokens(g, 18)
    pcm.generate(torch.tensor([a]), max_new_tokens=3)  # 20 tokens committed: 5 blocks
    before = pcm.cache_stats()
    assert before["blocks_inserted"] == 5
    ids, mask = left_pad([a + rand_tokens(g, 6), rand_tokens(g, 13)])
    real, calls = pcm.pool.scatter, [0]

    def scatter(block_ids, kv):
        calls[0] += 1
        if calls[0] == 2:  # the second row's blocks: the first row's are in the tree already
            raise RuntimeError("device error while writing the pool")
        real(block_ids, kv)

    monkeypatch.setattr(pcm.pool, "scatter", scatter)
    with pytest.raises(RuntimeError, match="device error"):
        pcm.generate(ids, attention_mask=mask, max_new_tokens=3)
    monkeypatch.setattr(pcm.pool, "scatter", real)
    after = pcm.cache_stats()
    assert after["blocks_used"] == 0  # dropped: some blocks were in the tree without their KV
    assert after["blocks_inserted"] == before["blocks_inserted"]  # none of the failed call's blocks stayed
    assert after["blocks_not_cached"] == before["blocks_not_cached"]
    assert after["lookups"] == before["lookups"] + 2
    _consistent(pcm)
    compare(pcm, model, torch.tensor([a]))
    assert pcm.cache_stats()["blocks_inserted"] == 5 + 5


# ---- what the model really computes on a hit -----------------------------------------------------------
class ForwardLog:
    """A forward pre-hook recording, per forward, each row's input ids and the cache length before it."""

    def __init__(self, model, cache_kwarg: str) -> None:
        self.calls: list[tuple[list[list[int]], int]] = []
        self._kw = cache_kwarg
        self._handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get(self._kw)
        past = 0 if cache is None else int(cache.get_seq_length())
        self.calls.append((ids.tolist(), past))

    def remove(self) -> None:
        self._handle.remove()


def test_a_hit_prefills_exactly_the_uncached_suffix():
    """Counts the tokens the model really runs: prompt minus ``cached_tokens``, at the right positions."""
    model = tiny_model("llama")
    pcm = PrefixCachedModel(model, max_cached_tokens=1024, block_size=BS)
    g = torch.Generator().manual_seed(37)
    a, b = rand_tokens(g, 26), rand_tokens(g, 17)
    pcm.generate(torch.tensor([a]), max_new_tokens=2)
    pcm.generate(torch.tensor([b]), max_new_tokens=2)
    log = ForwardLog(model, hf_cache.cache_kwarg(model))
    try:
        # single rows: a hit, a hit ending on a block boundary, a miss; max_new_tokens=1 -> one forward
        for prompt in (a[:21] + rand_tokens(g, 5), a[:16] + [7], rand_tokens(g, 10)):
            log.calls.clear()
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=1)
            log.calls.clear()
            out = pcm.generate(torch.tensor([prompt]), max_new_tokens=1)
            assert torch.equal(out, ref)
            cached = pcm.last_request_stats[0].cached_tokens
            assert log.calls == [([prompt[cached:]], cached)]
        # a left-padded batch: each row's uncached suffix but its last token on its own, then one batched step
        rows = [a[:25] + rand_tokens(g, 3), b[:12] + rand_tokens(g, 2), rand_tokens(g, 8)]
        ids, mask = left_pad(rows)
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=1)
        log.calls.clear()
        out = pcm.generate(ids, attention_mask=mask, max_new_tokens=1)
        assert torch.equal(out, ref)
        cached = [s.cached_tokens for s in pcm.last_request_stats]
        assert cached == [24, 12, 0]
        suffixes = [([r[c:-1]], c) for r, c in zip(rows, cached)]
        assert log.calls == [*suffixes, ([[r[-1]] for r in rows], ids.shape[1] - 1)]
        computed = sum(len(t[0]) for t, _ in log.calls[:-1]) + len(rows)
        assert computed == sum(len(r) for r in rows) - sum(cached)
    finally:
        log.remove()


def test_snapshot_of_inference_tensors_and_bf16_sees_data_writes():
    from engine.weights import WeightsSnapshot, describe_change

    with torch.inference_mode():
        model = tiny_model("llama", dtype=torch.bfloat16)  # inference tensors: no version counters
    before = WeightsSnapshot.take(model)
    assert describe_change(model, before, WeightsSnapshot.take(model)) is None
    with torch.inference_mode():
        model.model.norm.weight.add_(1)
    assert describe_change(model, before, WeightsSnapshot.take(model)) == "model.norm.weight"
    model.register_buffer("extra", torch.zeros(2))
    assert "added or removed" in describe_change(model, before, WeightsSnapshot.take(model))
