"""Model-backed replay on the built-in tiny model: outputs match the uncached model, hits match the
model-free simulation, conversation history is cached, Ctrl-C leaves no pinned blocks, the CLI end to end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from typer.testing import CliRunner

from engine.models import load_model
from engine.replay import ReplayError, replay
from prefixcache import cli
from prefixcache.sim.policy import Capacity, ReplayPolicy
from prefixcache.sim.replay import replay as simulate_replay
from prefixcache.sim.requests import from_scenario
from prefixcache.workload.render import ByteRenderer, Conversations
from prefixcache.workload.requests import ScenarioRequest
from prefixcache.workload.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def handwritten():
    return load_scenario(SCENARIOS / "handwritten.yaml")


def test_replay_matches_uncached_and_simulation(tiny, handwritten):
    sc = handwritten
    bs = sc.block_size
    (res,), info = replay(sc, [Capacity(None)], block_size=bs, loaded=tiny)
    assert info["model_class"] == "LlamaForCausalLM"
    rows = res.rows
    assert len(rows) == len(sc.requests)
    assert all(r.outputs_match is True for r in rows)
    assert all(r.ttft_cached_s > 0 and r.ttft_uncached_s > 0 and r.total_cached_s >= r.ttft_cached_s for r in rows)
    sim = simulate_replay(from_scenario(sc, bs), Capacity(None)).rows
    # prompts are tokenised identically (the byte renderer twins the built-in tokenizer) ...
    assert [r.prompt_tokens for r in rows] == [r.prompt_tokens for r in sim]
    # ... so hits agree wherever no earlier reply is part of the prompt (request 4 continues a conversation)
    for r, s in zip(rows, sim):
        if r.index != 3:
            assert r.cached_tokens == s.cached_tokens, r.index
    turn1 = Conversations().prompt(sc.requests[2], ByteRenderer())
    assert rows[3].cached_tokens >= len(turn1) // bs * bs  # the whole first turn is served from cache


def test_small_pool_evicts_and_outputs_still_match(tiny, handwritten):
    (res,), _ = replay(handwritten, [Capacity(6)], block_size=4, loaded=tiny)
    assert sum(r.evicted_blocks for r in res.rows) > 0
    assert all(r.outputs_match for r in res.rows)
    assert max(r.pool_used_blocks for r in res.rows) <= 6


def test_interrupt_is_partial_and_unpins(tiny, handwritten):
    caches = []

    def on_row(row, cache):
        caches.append(cache)
        if row.index == 2:
            raise KeyboardInterrupt

    results, _ = replay(
        handwritten, [Capacity(None), Capacity(50)], block_size=4, baseline=False, loaded=tiny, on_row=on_row
    )
    assert len(results) == 1 and results[0].partial and len(results[0].rows) == 3
    assert all(r.outputs_match is None and r.ttft_uncached_s is None for r in results[0].rows)
    assert caches[-1].num_active_requests == 0
    caches[-1].check_integrity()


def test_prompt_too_long_is_a_clear_error(tiny, handwritten):
    sc = replace(handwritten, requests=(ScenarioRequest(tokens=tuple([65] * 3000)),))
    with pytest.raises(ReplayError, match="request 1: 3000 prompt .* exceed the model's 2048 positions"):
        replay(sc, [Capacity(None)], loaded=tiny)


def test_cli_replay_verify_and_record(tmp_path):
    out = tmp_path / "run.json"
    r = CliRunner().invoke(
        cli.app,
        [
            "replay",
            str(SCENARIOS / "chat.yaml"),
            "--max-requests",
            "6",
            "--verify",
            "--capacity",
            "unlimited",
            "--json",
            str(out),
            "--html",
            str(tmp_path / "r.html"),
        ],
    )
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())
    t = rec["totals"][0]
    assert rec["command"] == "replay" and rec["settings"]["model"] == "tiny" and t["requests"] == 6
    assert t["outputs_checked"] == 6 and t["outputs_mismatched"] == 0
    assert t["ttft_cached_p50_s"] > 0 and t["ttft_uncached_p99_s"] > 0
    assert "TTFT cached vs uncached" in (tmp_path / "r.html").read_text()
    r = CliRunner().invoke(cli.app, ["replay", str(SCENARIOS / "chat.yaml"), "--model", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "cannot load model" in r.output


def test_replay_eviction_policy_matches_simulation(tiny, handwritten):
    # 4 blocks of 2: A, B, A again, C (evicts B under LRU and LFU, A under FIFO), A again
    a, b, c = (1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)
    reqs = tuple(ScenarioRequest(tokens=p + (50 + i,), max_new_tokens=1) for i, p in enumerate((a, b, a, c, a)))
    sc = replace(handwritten, requests=reqs, block_size=2)
    last = {}
    for eviction in ("lru", "fifo", "lfu"):
        (res,), _ = replay(sc, [Capacity(4)], block_size=2, eviction=eviction, baseline=False, loaded=tiny)
        sim = simulate_replay(from_scenario(sc, 2), Capacity(4), ReplayPolicy(eviction)).rows
        assert [r.cached_tokens for r in res.rows] == [s.cached_tokens for s in sim]
        last[eviction] = res.rows[-1].cached_tokens
    assert last == {"lru": 4, "fifo": 0, "lfu": 4}


def test_cli_replay_rejects_unknown_eviction():
    r = CliRunner().invoke(cli.app, ["replay", str(SCENARIOS / "chat.yaml"), "--eviction", "random"])
    assert r.exit_code == 2 and "unknown policy 'random'" in r.output


def test_verify_fails_when_the_cache_serves_wrong_kv(monkeypatch, tiny, handwritten):
    """Poisoned KV on every hit: the rows served from cache are mismatches, and ``replay --verify`` exits 1."""
    from engine import path_check
    from engine.kv_pool import KVPool

    real = KVPool.gather_into

    def poisoned(self, block_ids, dst):
        real(self, block_ids, dst)
        for kv in dst:
            if kv is not None:
                kv[1].mul_(-4.0)  # the values of every cached token: wrong KV, right shapes

    monkeypatch.setattr(KVPool, "gather_into", poisoned)
    # a fault the check at load would catch (tests/test_load_check.py): let it pass, as one that shows only later
    monkeypatch.setattr(path_check, "contiguous_reason", lambda rt: None)
    (res,), _ = replay(handwritten, [Capacity(None)], block_size=4, loaded=tiny)
    hits = [r.outputs_match for r in res.rows if r.cached_tokens > 0]
    assert hits and not all(hits)  # wrong KV was served and noticed
    assert all(r.outputs_match for r in res.rows if r.cached_tokens == 0)
    args = ["replay", str(SCENARIOS / "chat.yaml"), "--max-requests", "4", "--capacity", "unlimited", "--verify"]
    r = CliRunner().invoke(cli.app, args)
    assert r.exit_code == 1, r.output
    assert "gave different outputs cached and uncached" in r.output
    monkeypatch.setattr(KVPool, "gather_into", real)
    r = CliRunner().invoke(cli.app, args)  # the same run, unpoisoned, passes
    assert r.exit_code == 0, r.output


CAUSE_COLUMNS = (
    "cold_tokens",
    "evicted_tokens",
    "diverged_tokens",
    "partial_block_tokens",
    "namespace_tokens",
    "not_cached_tokens",
    "no_state_tokens",
)


def _causes(rows):
    return [tuple(getattr(r, c) for c in CAUSE_COLUMNS) for r in rows]


def _brute_force_causes(prompts: list[list[int]], cached: list[int], bs: int) -> list[tuple[int, ...]]:
    """The causes by their definition (prefixcache.sim.causes), for one namespace, no eviction and no fork with
    content seen again: history is every earlier commit (here: the prompt itself, max_new_tokens=1)."""
    out = []
    for i, p in enumerate(prompts):
        n, s = len(p), (len(p) - 1) // bs * bs
        t = 0  # the longest common prefix with an earlier sequence, token by token
        for q in prompts[:i]:
            k = 0
            while k < min(len(p), len(q)) and p[k] == q[k]:
                k += 1
            t = max(t, k)
        seen = min(t // bs * bs, s)  # leading full blocks committed earlier
        assert cached[i] == seen, i  # no eviction: the cache served all of them
        out.append((max(0, s - t), 0, 0, (n - s) + (min(t, s) - seen), 0, 0, 0))
    return out


def test_identical_caching_gives_identical_causes_equal_to_the_simulation(tiny, tmp_path):
    """Two pools that cache identically (no eviction) split the misses identically, whatever the pool's size,
    and as the model-free simulation (what `explain` and `simulate` run) and the definition computed by hand do.

    The small pool (10 blocks) is one whose wrapper, by default, remembers only 4 pools' worth (160 tokens) of
    history: ten requests of another 16 tokens push the first prompt out of it, so a bounded history would
    count the next prompt's 10 tokens shared with that first one (ending inside a block) as partly cold."""
    bs = 4
    prefix = list(range(1, 11))  # 10 tokens: two full blocks and half of the third
    p0, p1 = prefix + list(range(100, 106)), prefix + list(range(110, 116))
    other = list(range(200, 216))
    prompts = [p0] + [other] * 10 + [p1]
    lines = [f"block_size: {bs}", "max_new_tokens: 1", "requests:"] + [f"  - tokens: {p}" for p in prompts]
    path = tmp_path / "forgotten.yaml"
    path.write_text("\n".join(lines) + "\n")
    sc = load_scenario(path)
    small, unlimited = Capacity(10), Capacity(None)  # p0 4 blocks, other 4, p1 2: the small pool holds them all
    results, _ = replay(sc, [small, unlimited], block_size=bs, loaded=tiny, baseline=False)
    a, b = (res.rows for res in results)
    assert [r.cached_tokens for r in a] == [r.cached_tokens for r in b]
    assert sum(r.evicted_blocks for r in a) == 0
    assert _causes(a) == _causes(b)
    assert _causes(a) == _brute_force_causes(prompts, [r.cached_tokens for r in a], bs)
    # by hand: p1 has 8 tokens cached, shares 10 with p0, S = 12: 2 cold, (16 - 12) + (10 - 8) partial_block
    assert _causes(a)[11] == (2, 0, 0, 6, 0, 0, 0)
    reqs = from_scenario(sc, bs)  # commits = prompts, as the model's (its one new token has no KV yet)
    for cap, rows in ((small, a), (unlimited, b)):
        assert _causes(simulate_replay(reqs, cap).rows) == _causes(rows)


def test_nothing_is_timed_before_a_warm_up_of_both_paths(tiny, monkeypatch, tmp_path):
    """The first timed call comes after the model ran the first prompt uncached and through a wrapper (a miss and
    a hit), so the first capacity of a sweep does not carry the process's one-time costs; the record says so."""
    import engine.replay as engine_replay
    from engine.wrapper import PrefixCachedModel

    model, _ = tiny
    forwards = [0]
    hook = model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    cached_calls: list[int] = []  # cached tokens of every wrapper call
    real_generate = PrefixCachedModel.generate

    def spy_generate(self, *args, **kwargs):
        out = real_generate(self, *args, **kwargs)
        cached_calls.append(self.last_request_stats[0].cached_tokens)
        return out

    timed: list[tuple[int, int]] = []  # (forwards so far, wrapper calls so far) at each timed call
    real_timed = engine_replay._timed_generate

    def spy_timed(fn, ids, kwargs):
        timed.append((forwards[0], len(cached_calls)))
        return real_timed(fn, ids, kwargs)

    monkeypatch.setattr(PrefixCachedModel, "generate", spy_generate)
    monkeypatch.setattr(engine_replay, "_timed_generate", spy_timed)
    path = tmp_path / "two.yaml"
    path.write_text("block_size: 4\nmax_new_tokens: 2\nrequests:\n  - tokens: [5, 6, 7, 8, 9, 10, 11, 12, 13]\n")
    try:
        (res,), info = replay(load_scenario(path), [Capacity(None)], block_size=4, loaded=tiny)
    finally:
        hook.remove()
    assert len(res.rows) == 1 and len(timed) == 2  # the baseline and the cached call of the one request
    before_forwards, before_wrapper = timed[0]
    assert before_forwards >= 2 * 3  # three untimed generate calls of 2 new tokens each
    assert cached_calls[:before_wrapper] == [0, 8]  # the warm-up's wrapper missed, then hit two blocks
    assert res.rows[0].cached_tokens == 0  # ... and was thrown away: the timed replay starts cold
    assert "before any timing" in info["ttft_warmup"]
