"""Faults injected into every phase of an engine step stay with the request they concern.

One request (the victim) meets an exception while it is admitted, allocated for, scored, sampled, streamed, stopped,
cached or finished, or while the tier loads or saves its blocks. The references are independent of the engine: the
bare model's greedy ``generate`` for every other request, and, for sampled requests, a run of the same requests with
the same seeds and no fault. After every step ``check_integrity()`` holds; at the end no request is live and no
block is in flight; and the engine goes on: a later request sharing the prefix is served from cache and equals the
bare model.
"""

from __future__ import annotations

import pytest
import torch
from engine_testutil import rand_tokens
from test_engine_batching import (
    Sink,
    assert_idle,
    assert_matches_bare,
    bare_logprobs,
    make_engine,
    run_checked,
    submit,
)

from engine.batching import engine as engine_module
from engine.batching.request import Request
from engine.batching.sampling import SamplingParams
from engine.tier import KVTier
from engine.tier.lmdb_store import LmdbStore
from engine.tier.open import binding_for

ARCH, BS = "llama", 4
BOOM = RuntimeError("injected fault")


def _prompts(seed: int = 31) -> tuple[list[int], list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    shared = rand_tokens(gen, 10)
    return shared, [shared + rand_tokens(gen, k) for k in (3, 6, 9, 4)]


def _inject(monkeypatch, engine, phase: str, victim: str) -> dict[str, int]:
    """Make ``phase`` raise ``BOOM`` for the request with id ``victim`` only; returns a count of injections."""
    hits = {"n": 0}

    def is_victim(req) -> bool:
        return req is not None and req.id == victim

    def fire() -> None:
        hits["n"] += 1
        raise BOOM

    def handle_of_victim(handle) -> bool:
        return any(
            r.handle is handle and is_victim(r) for r in engine.scheduler.running + list(engine.scheduler.waiting)
        )

    if phase == "admit":
        real_admitted = engine.scheduler._admitted

        def admitted(req):
            real_admitted(req)
            if is_victim(req):
                fire()

        monkeypatch.setattr(engine.scheduler, "_admitted", admitted)
    elif phase == "allocate_running":  # a running request's later chunk
        real_allocate = engine.cache.allocate
        seen = {"n": 0}

        def allocate(handle, n):
            if handle_of_victim(handle):
                seen["n"] += 1
                if seen["n"] >= 2:
                    fire()
            return real_allocate(handle, n)

        monkeypatch.setattr(engine.cache, "allocate", allocate)
    elif phase == "sample":
        real_sample = engine_module.sample
        victim_params = []

        def sample(rows, params, gens):
            out = real_sample(rows, params, gens)  # the generators have drawn: a retry must rewind them
            if any(any(p is vp for vp in victim_params) for p in params):
                fire()
            return out

        monkeypatch.setattr(engine_module, "sample", sample)
        hits["params"] = victim_params  # type: ignore[assignment]
    elif phase == "commit":
        real_commit = engine.cache.commit_blocks

        def commit_blocks(handle, tokens, table, **kw):
            if any(r.handle is handle and is_victim(r) for r in engine.scheduler.running):
                fire()
            return real_commit(handle, tokens, table, **kw)

        monkeypatch.setattr(engine.cache, "commit_blocks", commit_blocks)
    elif phase == "score":
        real_score = engine._score

        def score(req, logits):
            if is_victim(req):
                fire()
            return real_score(req, logits)

        monkeypatch.setattr(engine, "_score", score)
    return hits


@pytest.mark.parametrize("phase", ["admit", "allocate_running", "sample", "commit", "stream", "stop_check"])
def test_a_fault_fails_only_its_request(monkeypatch, phase):
    shared, prompts = _prompts()
    engine = make_engine(ARCH, BS, 64, max_step_tokens=12, max_chunk_tokens=4, max_running=4)
    hits = _inject(monkeypatch, engine, phase, "r2")
    reqs = []
    for i, p in enumerate(prompts):
        sink = Sink()
        if phase == "stream" and i == 2:

            def tokens(ids, sink=sink):
                hits["n"] += 1
                raise BOOM

            sink.tokens = tokens  # type: ignore[method-assign]
        req = Request(f"r{i}", list(p), "ns", SamplingParams(max_tokens=6), sink=sink)
        if phase == "stop_check" and i == 2:

            def stop_check(output):
                hits["n"] += 1
                raise BOOM

            req.stop_check = stop_check
        if phase == "sample" and i == 2:
            hits["params"].append(req.params)  # type: ignore[attr-defined]
        engine.submit(req)
        reqs.append((req, sink))
    run_checked(engine)
    assert hits["n"] >= 1, "the fault was never injected"
    for i, ((_, sink), p) in enumerate(zip(reqs, prompts)):
        if i == 2:
            assert sink.result is not None and sink.result.finish_reason == "error", phase
            assert sink.result.error is BOOM
            assert sink.calls_after_finish == 0
        else:
            assert_matches_bare(ARCH, p, sink, 6)
    assert engine.stats.faults >= 1
    assert_idle(engine)
    # the engine goes on, and what it cached is right
    later = shared + [5, 6, 7]
    _, s = submit(engine, "later", later, SamplingParams(max_tokens=6))
    run_checked(engine)
    assert_matches_bare(ARCH, later, s, 6)
    assert s.result.cached_tokens >= (len(shared) // BS) * BS
    assert_idle(engine)


def test_a_sampling_fault_leaves_the_other_seeded_draws_unchanged(monkeypatch):
    """Sampled requests with seeds draw the same tokens whether or not another request's sampling raised in the
    same steps (the batched draw is redone row by row from the generators' states before it)."""
    _, prompts = _prompts(seed=32)

    def run(inject: bool) -> list[tuple[int, ...] | None]:
        engine = make_engine(ARCH, BS, 64, max_step_tokens=64, max_chunk_tokens=64, max_running=4)
        hits = _inject(monkeypatch, engine, "sample", "r1") if inject else {}
        sinks = []
        for i, p in enumerate(prompts):
            params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=100 + i)
            if inject and i == 1:
                hits["params"].append(params)  # type: ignore[attr-defined]
            sinks.append(submit(engine, f"r{i}", p, params)[1])
        run_checked(engine)
        assert_idle(engine)
        if inject:
            assert hits["n"] >= 1
        return [None if s.result.error else tuple(s.result.output) for s in sinks]

    clean = run(False)
    faulty = run(True)
    monkeypatch.undo()
    assert faulty[1] is None and clean[1] is not None
    assert [o for i, o in enumerate(faulty) if i != 1] == [o for i, o in enumerate(clean) if i != 1]


def test_a_scoring_fault_fails_only_its_request(monkeypatch):
    _, prompts = _prompts(seed=33)
    engine = make_engine(ARCH, BS, 64, max_step_tokens=16, max_chunk_tokens=8)
    _inject(monkeypatch, engine, "score", "r1")
    sinks = [submit(engine, f"r{i}", p, None, score_from=5)[1] for i, p in enumerate(prompts)]
    run_checked(engine)
    for i, (p, s) in enumerate(zip(prompts, sinks)):
        if i == 1:
            assert s.result.finish_reason == "error" and s.result.error is BOOM
            continue
        want, _ = bare_logprobs(ARCH, p, 5)
        assert s.result.error is None
        assert max(abs(a - b) for a, b in zip(s.result.logprobs, want)) < 1e-4
    assert_idle(engine)


def test_a_sink_that_fails_on_its_result_is_finished_and_released():
    _, prompts = _prompts(seed=34)
    engine = make_engine(ARCH, BS, 64)
    sinks = []
    for i, p in enumerate(prompts[:3]):
        sink = Sink()
        if i == 0:

            def finished(result):
                raise BOOM

            sink.finished = finished  # type: ignore[method-assign]
        engine.submit(Request(f"r{i}", list(p), "ns", SamplingParams(max_tokens=4), sink=sink))
        sinks.append(sink)
    run_checked(engine)
    for p, s in zip(prompts[1:3], sinks[1:]):
        assert_matches_bare(ARCH, p, s, 4)
    assert engine.stats.finished == 3
    assert_idle(engine)


def _tier(engine, tmp_path) -> KVTier:
    b = binding_for(engine.model, "fp", engine.pool.specs, BS, engine.cache.config.hash_seed)
    return KVTier(LmdbStore(str(tmp_path), 1 << 28), b, None)


def test_a_failing_tier_save_fails_no_request(monkeypatch, tmp_path):
    _, prompts = _prompts(seed=35)
    engine = make_engine(ARCH, BS, 64)
    engine.tier = _tier(engine, tmp_path)

    def save(*args, **kwargs):
        raise BOOM

    monkeypatch.setattr(engine.tier, "save", save)
    with pytest.warns(UserWarning, match="injected fault"):
        sinks = [submit(engine, f"r{i}", p, SamplingParams(max_tokens=5))[1] for i, p in enumerate(prompts)]
        run_checked(engine)
    for p, s in zip(prompts, sinks):
        assert_matches_bare(ARCH, p, s, 5)
    assert engine.tier.counters.write_errors > 0 and engine.stats.faults == 0
    assert_idle(engine)
    engine.tier.close()


def test_a_failing_tier_load_computes_the_blocks_instead(monkeypatch, tmp_path):
    """The tier holds the prompt's blocks but writing them into the pool fails: nothing joins the tree, the request
    computes them and equals the bare model; the blocks it took for the load go back when it ends."""
    from engine.tier import kv_tier

    _, prompts = _prompts(seed=36)
    engine = make_engine(ARCH, BS, 64)
    engine.tier = _tier(engine, tmp_path)
    _, s = submit(engine, "first", prompts[0], SamplingParams(max_tokens=5))
    run_checked(engine)
    engine.tier.flush()
    engine.cache.reset()  # the pool forgets; the tier still holds the blocks
    monkeypatch.setattr(kv_tier, "write_rows", lambda *a, **k: (_ for _ in ()).throw(BOOM))
    with pytest.warns(UserWarning, match="injected fault"):
        _, s = submit(engine, "again", prompts[0], SamplingParams(max_tokens=5))
        run_checked(engine)
    assert_matches_bare(ARCH, prompts[0], s, 5)
    assert s.result.cached_tokens == 0 and engine.tier.counters.read_errors == 1
    assert_idle(engine)
    engine.tier.close()
