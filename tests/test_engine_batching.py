"""The continuous-batching engine (engine.batching) against the bare model, with the cache checked after every step.

References are independent of the engine: the bare model's own greedy ``generate`` run on one prompt alone (fp32),
the bare model's forward for log-probabilities, ``expected_cached`` (brute-force longest common prefix in full
blocks) for cached-token counts, and hand-computed expectations for stops and sampling limits. Every test steps the
engine itself and calls ``cache.check_integrity()`` after EVERY step, and ends with no live request and no block
in flight.
"""

from __future__ import annotations

import functools

import pytest
import torch
from engine_testutil import ARCHS, VOCAB, expected_cached, rand_tokens, tiny_model

from engine import PrefixCachedModel, hf_cache
from engine.batching.engine import Engine
from engine.batching.request import Request, RequestResult
from engine.batching.sampling import SamplingParams
from engine.batching.scheduler import SchedulerConfig
from engine.kv_pool import KVPool
from engine.paged import linear
from prefixcache import CacheConfig, PrefixCache

MAX_STEPS = 2000


@functools.cache
def model_of(arch: str):
    return tiny_model(arch)


@functools.cache
def bare_greedy(arch: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The bare model's own greedy continuation of ``prompt`` (run alone, fp32)."""
    model = model_of(arch)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return tuple(out[0, len(prompt) :].tolist())


TIE = 1e-5  # logits this close (relative to the row's largest, at least 1) are a float tie between tokens


def assert_bare_greedy(arch: str, prompt: tuple[int, ...], got: list[int], n: int) -> None:
    """``got`` is the bare model's greedy continuation of ``prompt`` (``n`` tokens) up to float ties: equal to it, or,
    fed back to the bare model after the prompt, each token's logit within ``TIE`` of its row's largest. A random
    tiny model has near-ties (top two logits one ulp apart) that any other order of the same sums can flip; from
    there the two continuations differ, and each later token must still be the bare model's choice given the
    engine's own tokens."""
    want = list(bare_greedy(arch, prompt, n))
    if got == want:
        return
    assert len(got) == len(want), (got, want)
    model = model_of(arch)
    ids = torch.tensor([list(prompt) + got[:-1]])
    with torch.no_grad():
        rows = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1 :].double()
    for i, (row, tok) in enumerate(zip(rows, got, strict=True)):
        top = float(row.max())
        assert float(row[tok]) >= top - TIE * max(1.0, abs(top)), (
            f"token {i}: {tok} is {top - float(row[tok]):.2e} below the bare model's best ({int(row.argmax())}); "
            f"got {got}, bare greedy {want}"
        )


def bare_logprobs(arch: str, tokens: list[int], score_from: int) -> tuple[list[float], list[bool]]:
    """log P(tokens[i] | tokens[:i]) for i >= score_from, and whether each is the argmax, from one plain forward."""
    model = model_of(arch)
    with torch.no_grad():
        ids = torch.tensor([tokens[:-1]])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)[score_from - 1 :]
    target = torch.tensor(tokens[score_from:])
    return logp.gather(1, target[:, None])[:, 0].tolist(), (logp.argmax(-1) == target).tolist()


class Sink:
    def __init__(self) -> None:
        self.streamed: list[int] = []
        self.result: RequestResult | None = None
        self.calls_after_finish = 0

    def tokens(self, ids: list[int]) -> None:
        if self.result is not None:
            self.calls_after_finish += 1
        self.streamed.extend(ids)

    def finished(self, result: RequestResult) -> None:
        if self.result is not None:
            self.calls_after_finish += 1
        self.result = result


def make_engine(arch: str, bs: int, num_blocks: int, eos: tuple[int, ...] = (), **config) -> Engine:
    model = model_of(arch)
    pool = KVPool(hf_cache.probe_specs(model), num_blocks, bs, dtype=model.dtype, device="cpu")
    cache = PrefixCache(CacheConfig(num_blocks=num_blocks, block_size=bs))
    return Engine(model, cache, pool, config=SchedulerConfig(**config), eos_token_ids=eos)


def submit(engine: Engine, rid: str, prompt: list[int], params: SamplingParams | None, **kw) -> tuple[Request, Sink]:
    sink = Sink()
    req = Request(rid, list(prompt), "ns", params, sink=sink, **kw)
    engine.submit(req)
    return req, sink


def step_checked(engine: Engine) -> bool:
    ran = engine.step()
    engine.cache.check_integrity()
    return ran


def run_checked(engine: Engine) -> int:
    """Step until done, checking the cache after every step; returns the steps taken."""
    steps = 0
    while engine.has_work():
        step_checked(engine)
        steps += 1
        assert steps < MAX_STEPS, "the engine does not finish"
    return steps


def assert_idle(engine: Engine) -> None:
    cache = engine.cache
    cache.check_integrity()
    assert cache.num_active_requests == 0
    assert cache.num_owned_blocks == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert cache.num_free_blocks + cache.num_cached_blocks == cache.num_blocks


def assert_matches_bare(arch: str, prompt: list[int], sink: Sink, max_tokens: int) -> None:
    res = sink.result
    assert res is not None, "the request never finished"
    assert res.error is None, res.error
    want = bare_greedy(arch, tuple(prompt), max_tokens)
    assert list(res.output) == list(want), f"{arch}: engine {list(res.output)} != bare generate {list(want)}"
    assert sink.streamed == list(res.output)
    assert (res.finish_reason, res.prompt_tokens, res.completion_tokens) == ("length", len(prompt), max_tokens)
    assert sink.calls_after_finish == 0


# ---- (a) greedy outputs equal the bare model, every architecture, prefixes shared -------------------------------
@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_bare_generate(arch, bs):
    gen = torch.Generator().manual_seed(11)
    shared = rand_tokens(gen, 13)
    prompts = [shared + rand_tokens(gen, k) for k in (1, 6, 17, 3, 9, 30)]
    prompts += [list(prompts[1]), rand_tokens(gen, 11), [shared[0]]]  # identical, unrelated, one token: 9 requests
    engine = make_engine(arch, bs, 256 // bs * 2, max_step_tokens=24, max_chunk_tokens=10)
    sinks = [submit(engine, f"r{i}", p, SamplingParams(max_tokens=5))[1] for i, p in enumerate(prompts)]
    run_checked(engine)
    for p, s in zip(prompts, sinks):
        assert_matches_bare(arch, p, s, 5)
    # the first request computes the shared prefix; the others sharing it wait for it and find it cached
    cached = [s.result.cached_tokens for s in sinks]
    assert cached[0] == 0
    for p, c in zip(prompts[1:7], cached[1:7]):
        assert c >= min(13 // bs, (len(p) - 1) // bs) * bs, cached
    assert cached[7:] == [0, 0]
    assert engine.stats.prefill_tokens < sum(len(p) for p in prompts)
    assert_idle(engine)
    committed = [p + list(s.result.output)[:-1] for p, s in zip(prompts, sinks)]
    assert engine.cache.num_cached_blocks == len(distinct_blocks(committed, bs))  # each block cached once


def distinct_blocks(seqs: list[list[int]], bs: int) -> set[tuple[int, ...]]:
    """Every distinct full block of ``seqs``, named by its whole prefix."""
    return {tuple(s[: (i + 1) * bs]) for s in seqs for i in range(len(s) // bs)}


@pytest.mark.parametrize("bs", [1, 4])
def test_concurrent_requests_computing_the_same_blocks(bs):
    """Without share_wait, requests sharing a prefix prefill it at the same time, each in blocks of its own; as
    each caches its blocks, a copy the tree has already is swapped for the tree's. Outputs equal the bare model
    and every distinct block is cached once."""
    arch = "mistral_window"
    gen = torch.Generator().manual_seed(21)
    shared = rand_tokens(gen, 12)
    prompts = [shared + rand_tokens(gen, k) for k in (0, 3, 0, 7, 5)] + [list(shared[:9])]
    engine = make_engine(arch, bs, 256, max_step_tokens=40, max_chunk_tokens=5, share_wait=False)
    sinks = [submit(engine, f"r{i}", p, SamplingParams(max_tokens=6))[1] for i, p in enumerate(prompts)]
    run_checked(engine)
    for p, s in zip(prompts, sinks):
        assert_matches_bare(arch, p, s, 6)
    assert engine.stats.most_requests == len(prompts)
    assert all(s.result.cached_tokens == 0 for s in sinks)  # all admitted together, nothing cached yet
    assert_idle(engine)
    committed = [p + list(s.result.output)[:-1] for p, s in zip(prompts, sinks)]
    assert engine.cache.num_cached_blocks == len(distinct_blocks(committed, bs))
    # and what is cached is right: a new request served from it still equals the bare model
    p = [*shared, 1, 2, 3]
    _, s = submit(engine, "after", p, SamplingParams(max_tokens=6))
    run_checked(engine)
    assert s.result.cached_tokens == expected_cached(p, committed, bs) > 0
    assert_matches_bare(arch, p, s, 6)
    assert_idle(engine)


def test_namespaces_never_share_blocks():
    arch, bs = "llama", 4
    gen = torch.Generator().manual_seed(22)
    prompt = rand_tokens(gen, 14)
    engine = make_engine(arch, bs, 128)
    sinks = []
    for ns in ("a", "b", "a"):
        sink = Sink()
        engine.submit(Request(ns, list(prompt), ns, SamplingParams(max_tokens=3), sink=sink))
        run_checked(engine)
        sinks.append(sink)
        assert_matches_bare(arch, prompt, sink, 3)
    assert [s.result.cached_tokens for s in sinks] == [0, 0, 12]
    assert_idle(engine)


# ---- (b) multi-turn: outputs and cached tokens ----------------------------------------------------------------
@pytest.mark.parametrize(("arch", "bs"), [("llama", 4), ("llama", 1), ("gpt2", 4), ("gemma3", 4)])
def test_multi_turn_outputs_and_cached_tokens(arch, bs):
    """Two conversations, four turns each, one request at a time: each turn's prompt is the previous prompt, its
    output and new tokens. Cached tokens = brute-force longest common prefix with everything committed before,
    where a finished request has committed its prompt and output but the last generated token (never computed)."""
    gen = torch.Generator().manual_seed(5)
    engine = make_engine(arch, bs, 512 // bs, max_step_tokens=32, max_chunk_tokens=12)
    committed: list[list[int]] = []
    hits = []
    convs = [rand_tokens(gen, 7), rand_tokens(gen, 10)]
    new_tokens = [3, 1, 6, 2]
    for turn, k in enumerate(new_tokens):
        for c in range(2):
            prompt = convs[c]
            n = (1, 3, 4, 5)[(turn + c) % 4]
            _, sink = submit(engine, f"c{c}t{turn}", prompt, SamplingParams(max_tokens=n))
            run_checked(engine)
            assert_matches_bare(arch, prompt, sink, n)
            assert sink.result.cached_tokens == expected_cached(prompt, committed, bs), (turn, c)
            hits.append(sink.result.cached_tokens)
            full = prompt + list(sink.result.output)
            committed.append(full[:-1])
            convs[c] = full + rand_tokens(gen, k)
            assert_idle(engine)
    assert hits[:2] == [0, 0] and all(h > 0 for h in hits[2:])  # every later turn is served its history


# ---- (c) invariants under cancellation, preemption, oversize requests, failing steps, concurrency ------------
def test_cancellation_mid_run():
    arch, bs = "llama", 4
    gen = torch.Generator().manual_seed(3)
    shared = rand_tokens(gen, 9)
    prompts = [shared + rand_tokens(gen, k) for k in (2, 5, 8, 11, 4, 7)]
    engine = make_engine(arch, bs, 128, max_step_tokens=16, max_chunk_tokens=8, max_running=3)
    reqs = [submit(engine, f"r{i}", p, SamplingParams(max_tokens=10)) for i, p in enumerate(prompts)]
    reqs[5][0].cancel()  # before it ever reaches the scheduler
    for _ in range(3):
        step_checked(engine)
    running = [r for r, _ in reqs if r in engine.scheduler.running]
    waiting = [r for r, _ in reqs if r in engine.scheduler.waiting]
    assert running and waiting
    running[0].cancel()
    waiting[-1].cancel()
    cancelled = {running[0].id, waiting[-1].id, reqs[5][0].id}
    steps = 0
    while engine.has_work():
        step_checked(engine)
        steps += 1
        assert steps < MAX_STEPS
        if steps == 4:  # one more, decoding by now
            late = next((r for r in engine.scheduler.running if r.id not in cancelled), None)
            if late is not None:
                late.cancel()
                cancelled.add(late.id)
    for (req, sink), p in zip(reqs, prompts):
        assert sink.result is not None and sink.calls_after_finish == 0
        if req.id in cancelled:
            assert sink.result.finish_reason == "cancelled"
            assert sink.result.error is None
            want = bare_greedy(arch, tuple(p), 10)
            assert list(sink.result.output) == list(want[: len(sink.result.output)])
            assert sink.streamed == list(sink.result.output)
        else:
            assert_matches_bare(arch, p, sink, 10)
    assert len(cancelled) == 4
    assert_idle(engine)


@pytest.mark.parametrize(("bs", "shared"), [(1, False), (4, True), (4, False)])
def test_preemption_in_a_small_pool(bs, shared):
    """Requests each needing about half the pool, with a seeded sampling request and two scoring ones among them:
    the engine must preempt, and still greedy outputs equal the bare model, the sampled tokens equal those of the
    same request run alone, and the scores the bare model's."""
    arch = "qwen2"
    gen = torch.Generator().manual_seed(8)
    head = rand_tokens(gen, 8) if shared else []
    prompts = [head + rand_tokens(gen, (9 if not shared else 2) + i) for i in range(5)]
    max_tokens = 12
    num_blocks = 48 // bs  # 48 tokens; one request needs up to 9 + 4 + 12 = 25
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=5)
    alone = make_engine(arch, bs, 256 // bs)
    _, ref = submit(alone, "alone", prompts[0], seeded)
    run_checked(alone)
    engine = make_engine(arch, bs, num_blocks, max_step_tokens=64, max_chunk_tokens=32)
    sinks = [submit(engine, f"r{i}", p, SamplingParams(max_tokens=max_tokens))[1] for i, p in enumerate(prompts)]
    _, sampler = submit(engine, "sampler", prompts[0], seeded)
    scored = [prompts[1] + rand_tokens(gen, 9), prompts[2][:3] + rand_tokens(gen, 20)]
    scorers = [submit(engine, f"s{i}", t, None, score_from=len(t) - 12)[1] for i, t in enumerate(scored)]
    run_checked(engine)
    assert engine.stats.preemptions > 0
    for p, s in zip(prompts, sinks):
        assert_matches_bare(arch, p, s, max_tokens)
    assert sampler.result.output == ref.result.output and sampler.result.finish_reason == "length"
    assert sampler.streamed == list(sampler.result.output)
    for t, s in zip(scored, scorers):
        check_scores(arch, t, len(t) - 12, s.result)
    assert_idle(engine)


def test_preempted_request_cancelled_while_waiting():
    arch, bs = "llama", 4
    gen = torch.Generator().manual_seed(9)
    prompts = [rand_tokens(gen, 10) for _ in range(4)]
    engine = make_engine(arch, bs, 12, max_step_tokens=64, max_chunk_tokens=32)
    reqs = [submit(engine, f"r{i}", p, SamplingParams(max_tokens=14)) for i, p in enumerate(prompts)]
    steps = 0
    victim = None
    while engine.has_work():
        step_checked(engine)
        steps += 1
        assert steps < MAX_STEPS
        if victim is None:
            victim = next((r for r, _ in reqs if r.preemptions and r in engine.scheduler.waiting), None)
            if victim is not None:
                victim.cancel()
    assert victim is not None, "no request was preempted"
    for (req, sink), p in zip(reqs, prompts):
        if req is victim:
            assert sink.result.finish_reason == "cancelled"
        else:
            assert_matches_bare(arch, p, sink, 14)
    assert_idle(engine)


def test_request_too_big_for_the_pool_fails_alone():
    arch, bs = "llama", 4
    gen = torch.Generator().manual_seed(4)
    engine = make_engine(arch, bs, 8, max_step_tokens=64, max_chunk_tokens=16)  # 32 tokens of KV
    small = [rand_tokens(gen, 6), rand_tokens(gen, 9)]
    _, s0 = submit(engine, "small0", small[0], SamplingParams(max_tokens=4))
    _, huge = submit(engine, "huge_prompt", rand_tokens(gen, 40), SamplingParams(max_tokens=2))
    grow_prompt = rand_tokens(gen, 20)
    _, grows = submit(engine, "grows", grow_prompt, SamplingParams(max_tokens=20))  # 40 tokens by its end
    _, s1 = submit(engine, "small1", small[1], SamplingParams(max_tokens=4))
    run_checked(engine)
    for sink in (huge, grows):
        res = sink.result
        assert res is not None and res.finish_reason == "error"
        assert isinstance(res.error, BaseException) and "max_cached_tokens" in str(res.error)
    assert huge.result.completion_tokens == 0
    partial = list(grows.result.output)  # what it generated before the pool ran out: the bare model's start
    assert len(partial) < 20
    assert partial == list(bare_greedy(arch, tuple(grow_prompt), 20)[: len(partial)])
    assert grows.streamed == partial
    assert_matches_bare(arch, small[0], s0, 4)
    assert_matches_bare(arch, small[1], s1, 4)
    assert_idle(engine)
    # the engine still works afterwards
    p = rand_tokens(gen, 7)
    _, s = submit(engine, "after", p, SamplingParams(max_tokens=5))
    run_checked(engine)
    assert_matches_bare(arch, p, s, 5)
    assert_idle(engine)


@pytest.mark.parametrize("fail_at", [1, 3, 6])
def test_exception_inside_a_step(monkeypatch, fail_at):
    """The runner's forward raises once: that step's requests finish with "error" (carrying the exception), the
    cache stays consistent, the other requests and later ones equal the bare model."""
    arch, bs = "llama", 4
    gen = torch.Generator().manual_seed(6)
    shared = rand_tokens(gen, 8)
    prompts = [shared + rand_tokens(gen, k) for k in (3, 5, 9, 2, 6)]
    engine = make_engine(arch, bs, 128, max_step_tokens=16, max_chunk_tokens=8, max_running=2)
    real = engine.runner.forward
    calls = {"n": 0}
    failed_rows: list[int] = []
    boom = RuntimeError("injected failure")

    def forward(batch, input_ids, logits_at, *rest):
        calls["n"] += 1
        if calls["n"] == fail_at:
            failed_rows.append(len(batch.rows))
            raise boom
        return real(batch, input_ids, logits_at, *rest)

    monkeypatch.setattr(engine.runner, "forward", forward)
    reqs = [submit(engine, f"r{i}", p, SamplingParams(max_tokens=6)) for i, p in enumerate(prompts)]
    run_checked(engine)
    assert failed_rows, "the failure was never injected"
    errored = [(r, s) for r, s in reqs if s.result.finish_reason == "error"]
    assert len(errored) == failed_rows[0]
    for _, s in errored:
        assert s.result.error is boom
        assert s.calls_after_finish == 0
    for (_, s), p in zip(reqs, prompts):
        if s.result.finish_reason != "error":
            assert_matches_bare(arch, p, s, 6)
    assert_idle(engine)
    later = [shared + rand_tokens(gen, 4), prompts[0]]
    sinks = [submit(engine, f"later{i}", p, SamplingParams(max_tokens=6))[1] for i, p in enumerate(later)]
    run_checked(engine)
    for p, s in zip(later, sinks):
        assert_matches_bare(arch, p, s, 6)
    assert_idle(engine)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no packed linears here")
def test_packed_linears_time_is_counted_within_the_forward():
    model = model_of("llama")
    pool = KVPool(hf_cache.probe_specs(model), 64, 4, dtype=model.dtype, device="cpu")
    cache = PrefixCache(CacheConfig(num_blocks=64, block_size=4))
    engine = Engine(model, cache, pool, linears=linear.PackedLinears(model))
    gen = torch.Generator().manual_seed(3)
    prompts = [rand_tokens(gen, 9), rand_tokens(gen, 5)]
    sinks = [submit(engine, f"r{i}", p, SamplingParams(max_tokens=4))[1] for i, p in enumerate(prompts)]
    run_checked(engine)
    st = engine.stats
    assert st.linears_s > 0 and st.linears_s + st.attention_s <= st.forward_s
    for p, s in zip(prompts, sinks):
        assert_matches_bare("llama", p, s, 4)
    assert_idle(engine)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_eight_concurrent_requests(arch):
    gen = torch.Generator().manual_seed(12)
    prompts = [rand_tokens(gen, 3 + 2 * i) for i in range(8)]
    engine = make_engine(arch, 4, 128, max_step_tokens=256, max_chunk_tokens=64)
    sinks = [submit(engine, f"r{i}", p, SamplingParams(max_tokens=7))[1] for i, p in enumerate(prompts)]
    run_checked(engine)
    assert engine.stats.most_requests == 8  # all eight ran in the same steps
    assert engine.stats.steps == 7  # one prefill step (that samples the first token), then 6 decode steps
    for p, s in zip(prompts, sinks):
        assert_matches_bare(arch, p, s, 7)
    assert_idle(engine)


# ---- (d) sampling with a seed, stop tokens ------------------------------------------------------------------
def sampled(engine: Engine, prompt: list[int], params: SamplingParams, others: int, gen: torch.Generator):
    """Run ``prompt`` with ``params`` alongside ``others`` other requests (sampling unseeded, or greedy)."""
    _, sink = submit(engine, "target", prompt, params)
    for i in range(others):
        p = rand_tokens(gen, 4 + i)
        other = SamplingParams(max_tokens=3 + i, temperature=0.8) if i % 2 else SamplingParams(max_tokens=5)
        submit(engine, f"other{i}", p, other)
    run_checked(engine)
    assert_idle(engine)
    return list(sink.result.output)


def test_seeded_sampling_is_reproducible_whatever_runs_beside_it():
    arch = "llama"
    gen = torch.Generator().manual_seed(13)
    prompt = rand_tokens(gen, 9)
    params = SamplingParams(max_tokens=12, temperature=1.3, top_k=40, top_p=0.95, seed=1234)
    runs = []
    for others in (0, 3, 6):
        engine = make_engine(arch, 4, 128, max_step_tokens=32, max_chunk_tokens=8)
        runs.append(sampled(engine, prompt, params, others, gen))
    engine = make_engine(arch, 1, 256, max_step_tokens=7, max_chunk_tokens=3)  # other block size, small chunks
    runs.append(sampled(engine, prompt, params, 4, gen))
    assert all(r == runs[0] for r in runs), runs
    assert len(runs[0]) == 12
    other_seed = sampled(make_engine(arch, 4, 128), prompt, SamplingParams(**{**params.__dict__, "seed": 99}), 0, gen)
    assert other_seed != runs[0]  # the seed matters (12 tokens at temperature 1.3 over 128 ids)
    assert list(bare_greedy(arch, tuple(prompt), 12)) != runs[0]  # and it really samples


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=5.0, top_p=1e-6)]
)
def test_sampling_restricted_to_the_top_token_is_greedy(params):
    """top_k=1, or top_p so small that only the most likely token is kept, must give the greedy tokens."""
    arch = "gemma3"
    gen = torch.Generator().manual_seed(14)
    prompts = [rand_tokens(gen, 5 + 3 * i) for i in range(3)]
    engine = make_engine(arch, 4, 128)
    sinks = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(**{**params.__dict__, "max_tokens": 8, "seed": i})
        sinks.append(submit(engine, f"r{i}", p, sp)[1])
    run_checked(engine)
    for p, s in zip(prompts, sinks):
        assert_matches_bare(arch, p, s, 8)
    assert_idle(engine)


def first_new(seq: tuple[int, ...], start: int) -> int | None:
    """The first index >= start whose token did not occur before it (None: there is none)."""
    return next((i for i in range(start, len(seq)) if seq[i] not in seq[:i]), None)


def test_stop_token_ids_and_eos():
    arch = "llama"
    gen = torch.Generator().manual_seed(15)
    prompts, greedy, cut = [], [], []
    while len(prompts) < 2:  # prompts whose greedy continuation has a token first seen at index 3 or later
        p = rand_tokens(gen, 6 + 5 * len(prompts))
        g = bare_greedy(arch, tuple(p), 12)
        k = first_new(g, 3)
        if k is not None and k < 11:
            prompts.append(p)
            greedy.append(g)
            cut.append(k)
    stops = [g[k] for g, k in zip(greedy, cut)]
    engine = make_engine(arch, 4, 128, eos=(stops[1],))
    _, by_stop = submit(engine, "stop", prompts[0], SamplingParams(max_tokens=12, stop_token_ids=(stops[0], 999)))
    _, by_eos = submit(engine, "eos", prompts[1], SamplingParams(max_tokens=12))
    _, ignored = submit(engine, "ignore_eos", prompts[1], SamplingParams(max_tokens=12, ignore_eos=True))
    _, both = submit(
        engine,
        "ignore_eos_stop",
        prompts[1],
        SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stops[1],)),
    )
    run_checked(engine)
    assert list(by_stop.result.output) == list(greedy[0][: cut[0] + 1])  # the stop token is kept
    assert by_stop.result.finish_reason == "stop"
    assert list(by_eos.result.output) == list(greedy[1][: cut[1] + 1])
    assert by_eos.result.finish_reason == "stop"
    assert list(ignored.result.output) == list(greedy[1])
    assert ignored.result.finish_reason == "length"
    assert list(both.result.output) == list(greedy[1][: cut[1] + 1])
    assert both.result.finish_reason == "stop"
    for s in (by_stop, by_eos, ignored, both):
        assert s.streamed == list(s.result.output)
        assert s.result.completion_tokens == len(s.result.output)
    assert_idle(engine)


# ---- (e) scoring ----------------------------------------------------------------------------------------------
def check_scores(arch: str, tokens: list[int], score_from: int, res: RequestResult) -> None:
    want_lp, want_greedy = bare_logprobs(arch, tokens, score_from)
    assert res.finish_reason == "stop" and res.error is None
    assert len(res.logprobs) == len(want_lp) == len(tokens) - score_from
    assert max(abs(a - b) for a, b in zip(res.logprobs, want_lp)) <= 1e-4, (res.logprobs, want_lp)
    assert list(res.greedy) == want_greedy
    assert res.output == () and res.completion_tokens == 0


@pytest.mark.parametrize(("arch", "bs"), [("llama", 4), ("gemma2", 4), ("mistral_window", 1)])
def test_scoring_equals_bare_log_probs(arch, bs):
    """Score requests submitted together, then again one at a time (now their contexts are cached): log-probs of
    the continuation tokens equal the bare model's; at most len(context) - 1 tokens come from cache, exactly the
    brute-force expectation when one request runs at a time."""
    gen = torch.Generator().manual_seed(16)
    shared, block = rand_tokens(gen, 6), rand_tokens(gen, 4)
    short = rand_tokens(gen, 2)
    contexts = [block, block, short, rand_tokens(gen, 1), shared + rand_tokens(gen, 3), shared + rand_tokens(gen, 2)]
    contexts += [shared + rand_tokens(gen, 7), rand_tokens(gen, 3)]
    items = [(c, rand_tokens(gen, x)) for c, x in zip(contexts, (1, 5, 3, 1, 1, 4, 6, 2))]
    engine = make_engine(arch, bs, 256 // bs * 2, max_step_tokens=16, max_chunk_tokens=5)
    together = [submit(engine, f"s{i}", c + x, None, score_from=len(c))[1] for i, (c, x) in enumerate(items)]
    run_checked(engine)
    assert_idle(engine)
    for (c, x), s in zip(items, together):
        check_scores(arch, c + x, len(c), s.result)
        assert s.result.cached_tokens <= ((len(c) - 1) // bs) * bs
    # one at a time: everything committed before is the contexts (continuations are not cached by default)
    committed = [c for c, _ in items]
    for i, (c, x) in enumerate(items):
        _, s = submit(engine, f"again{i}", c + x, None, score_from=len(c))
        run_checked(engine)
        check_scores(arch, c + x, len(c), s.result)
        assert s.result.cached_tokens == expected_cached(c, committed, bs)
        assert_idle(engine)
    assert sum(expected_cached(c, committed, bs) for c, _ in items) > 0


def test_scoring_request_preempted_mid_prefill():
    """A long scoring request prefilled in small chunks next to two growing generations in a 12-block pool is
    preempted (its log-probs so far are dropped and recomputed): its scores still equal the bare model's."""
    arch = "llama"
    gen = torch.Generator().manual_seed(30)
    engine = make_engine(arch, 4, 12, max_step_tokens=16, max_chunk_tokens=4)
    gens = [
        (p, submit(engine, f"g{i}", p, SamplingParams(max_tokens=14))[1])
        for i, p in enumerate([rand_tokens(gen, 8) for _ in range(2)])
    ]
    tokens = rand_tokens(gen, 26)
    req, s = submit(engine, "score", tokens, None, score_from=3)
    run_checked(engine)
    assert req.preemptions > 0
    check_scores(arch, tokens, 3, s.result)
    for p, g in gens:
        assert_matches_bare(arch, p, g, 14)
    assert_idle(engine)


def test_scoring_beside_generation():
    arch, bs = "qwen2", 4
    gen = torch.Generator().manual_seed(17)
    ctx = rand_tokens(gen, 10)
    engine = make_engine(arch, bs, 128, max_step_tokens=12, max_chunk_tokens=4)
    _, g = submit(engine, "gen", ctx, SamplingParams(max_tokens=6))
    conts = [rand_tokens(gen, k) for k in (1, 4, 7)]
    scores = [submit(engine, f"s{i}", ctx + x, None, score_from=len(ctx))[1] for i, x in enumerate(conts)]
    run_checked(engine)
    assert_matches_bare(arch, ctx, g, 6)
    for x, s in zip(conts, scores):
        check_scores(arch, ctx + x, len(ctx), s.result)
    assert_idle(engine)


def test_pcm_score_and_generate_batch_return_the_callers_order():
    """``PrefixCachedModel.score`` (reorder=True runs the pairs in token-sequence order) and ``generate_batch``
    give each input its own result, in the caller's order, equal to the bare model's."""
    arch = "llama"
    pcm = PrefixCachedModel(tiny_model(arch), max_cached_tokens=512, block_size=4)  # same weights as model_of
    gen = torch.Generator().manual_seed(18)
    shared = rand_tokens(gen, 9)
    # contexts in descending token order, so running them in token-sequence order reverses them
    pairs = [([VOCAB - 1, *shared], rand_tokens(gen, 2)), ([60, *shared], rand_tokens(gen, 1))]
    pairs += [([5, *shared[:k]], rand_tokens(gen, 3)) for k in (8, 4, 3)]
    pairs += [([3], [7]), ([5, *shared[:4]], [9, 9])]
    results = pcm.score(pairs, token_logprobs=True, reorder=True)
    again = pcm.score(pairs, token_logprobs=True, reorder=False)
    assert len(results) == len(again) == len(pairs)
    for (c, x), r, r2 in zip(pairs, results, again):
        want_lp, want_greedy = bare_logprobs(arch, c + x, len(c))
        for got in (r, r2):
            assert len(got.token_logprobs) == len(x)
            assert max(abs(a - b) for a, b in zip(got.token_logprobs, want_lp)) <= 1e-4
            assert abs(got.logprob - sum(want_lp)) <= 1e-4
            assert got.is_greedy == all(want_greedy)
            assert got.cached_tokens <= len(c) - 1
    assert any(r.cached_tokens > 0 for r in again)  # the second pass finds the contexts cached
    prompts = [c for c, _ in pairs]
    out = pcm.generate_batch(prompts, max_new_tokens=4)
    assert list(out) == [f"req_{i}" for i in range(len(prompts))]
    for i, p in enumerate(prompts):
        o = out[f"req_{i}"]
        assert o.prompt_ids == p and o.error is None and o.finish_reason == "length"
        assert o.generated_tokens == list(bare_greedy(arch, tuple(p), 4))
    pcm.cache.check_integrity()
    assert pcm.cache.num_active_requests == 0 and pcm.cache.num_owned_blocks == 0
