"""Miss causes on the model side: ``last_request_stats`` rows say why each prompt missed, ``pcm.explain`` says
where a prompt leaves the cache without changing it, and ``prefixcache replay`` records divergence points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch
from typer.testing import CliRunner

from engine.models import load_model
from engine.wrapper import PrefixCachedModel
from prefixcache import cli
from prefixcache.reports.record import load_record

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
BS = 4


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def dated(k: int) -> list[int]:
    """[1 2 3 | a date | 40 shared tokens | a question]: a prompt that departs from the others at token 3."""
    return [1, 2, 3, 40 + k, *range(100, 140), *(60 + k, 61 + k, 62 + k)]


def generate(pcm, ids: list[int], **kw):
    t = torch.tensor([ids])
    return pcm.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=3, do_sample=False, **kw)


def test_last_request_stats_say_why(tiny):
    model, _ = tiny
    pcm = PrefixCachedModel(model, max_cached_tokens=4096, block_size=BS)
    generate(pcm, dated(0))
    (first,) = pcm.last_request_stats
    n = len(dated(0))
    assert (first.cold_tokens, first.partial_block_tokens) == (((n - 1) // BS) * BS, n - (n - 1) // BS * BS)
    generate(pcm, dated(1))
    (r,) = pcm.last_request_stats
    assert r.cached_tokens == 0 and (r.shared_tokens, r.shared_with) == (3, 0)
    assert r.divergence is not None and r.divergence.position == 3
    assert r.divergence.this[0] == 41 and r.divergence.other[0] == 40
    assert r.diverged_tokens == 3 + 40  # the shared part of block 0 and the 40 shared tokens after the date
    uncached = (r.cold_tokens, r.evicted_tokens, r.diverged_tokens, r.partial_block_tokens)
    assert sum(uncached) + r.namespace_tokens + r.not_cached_tokens == r.prompt_tokens - r.cached_tokens
    generate(pcm, dated(1), namespace="tenant-b")  # the same prompt in another namespace
    (r,) = pcm.last_request_stats
    assert r.cached_tokens == 0 and r.namespace_tokens == (n - 1) // BS * BS
    pcm.reset_cache()
    generate(pcm, dated(1))
    assert pcm.last_request_stats[0].cold_tokens == (n - 1) // BS * BS  # reset forgets the history too


def test_eviction_in_a_small_pool(tiny):
    model, _ = tiny
    pcm = PrefixCachedModel(model, max_cached_tokens=16 * BS, block_size=BS)
    a, b = list(range(10, 50)), list(range(60, 100))
    for ids in (a, b, a):
        generate(pcm, ids)
    (r,) = pcm.last_request_stats
    assert r.evicted_tokens > 0 and r.evicted_tokens + r.cached_tokens == (len(a) - 1) // BS * BS
    assert r.cold_tokens == 0


def test_explain_changes_nothing(tiny):
    model, tok = tiny
    pcm = PrefixCachedModel(model, max_cached_tokens=4096, block_size=BS)
    pcm.tokenizer = tok
    generate(pcm, dated(0))
    before = pcm.cache_stats()
    e = pcm.explain(torch.tensor([dated(1)]))
    assert pcm.cache_stats() == before
    pcm.cache.check_integrity()
    assert (e.prompt_tokens, e.cached_tokens, e.common_tokens) == (len(dated(1)), 0, 3)
    assert e.prompt_next[0] == 41 and e.cached_next[0] == 40
    assert e.prompt_text == tok.decode([*e.prompt_next]) and e.cached_text == tok.decode([*e.cached_next])
    assert e.causes["diverged"] == 43 and sum(e.causes.values()) == e.prompt_tokens - e.cached_tokens
    again = pcm.explain(dated(0))  # a prompt the cache serves: nothing differs before its last block
    assert again.cached_tokens == pcm.probe(dated(0)) == (len(dated(0)) - 1) // BS * BS
    assert again.common_tokens >= again.cached_tokens and again.causes["diverged"] == 0
    with pytest.raises(ValueError, match="empty"):
        pcm.explain([])


def test_replay_records_divergence_points(tmp_path):
    out, html = tmp_path / "run.json", tmp_path / "run.html"
    r = CliRunner().invoke(
        cli.app,
        [
            "replay",
            str(SCENARIOS / "dated_system_prompt.yaml"),
            "--max-requests",
            "3",
            "--no-baseline",
            "--json",
            str(out),
            "--html",
            str(html),
        ],
    )
    assert r.exit_code == 0, r.output
    rec = load_record(out)
    rows = rec.runs[0].rows
    assert all(sum(getattr(x, f) for f in ("cold_tokens", "diverged_tokens", "partial_block_tokens")) for x in rows)
    for x in rows:
        causes = [x.cold_tokens, x.evicted_tokens, x.diverged_tokens, x.partial_block_tokens, x.namespace_tokens]
        assert sum(causes) + x.not_cached_tokens == x.prompt_tokens - x.cached_tokens
    # the built-in tokenizer renders like the simulator's: the seconds of the timestamp, 33 tokens in
    assert [d.position for d in rec.divergences] == [33] and rec.divergences[0].requests == 2
    assert "Why prefill was not saved" in html.read_text()
    why = tmp_path / "why.json"
    assert CliRunner().invoke(cli.app, ["explain", str(out), "--json", str(why)]).exit_code == 0
    assert json.loads(why.read_text())["runs"][0]["main_cause"] == "diverged"


def test_hybrid_rows_count_kv_without_a_snapshot_as_no_state():
    """A hybrid model is served only up to its deepest recurrent-state snapshot. With room for one snapshot, a
    second prompt's snapshot pushes out the first's: sent again, the first prompt's KV is all cached (36 tokens,
    blocks of 4) but nothing reaches it, so all 36 count as no_state (not evicted) and the causes still add up."""
    model, _ = load_model("tiny-hybrid")
    pcm = PrefixCachedModel(model, max_cached_tokens=4096, block_size=BS, max_cached_states=1)
    p, q = list(range(10, 50)), list(range(100, 140))
    for ids in (p, q, p):
        generate(pcm, ids)
    (r,) = pcm.last_request_stats
    assert (r.cached_tokens, r.no_state_tokens, r.evicted_tokens, r.cold_tokens) == (0, 36, 0, 0)
    # the KV is there, but nothing would be served from it: probe and explain say what a call would get
    assert pcm.runtime.cache.probe(p, pcm.runtime.namespace("default")) == 36
    assert pcm.probe(torch.tensor(p)) == 0
    assert pcm.explain(torch.tensor(p)).causes["no_state"] == 36
    causes = (r.cold_tokens, r.evicted_tokens, r.diverged_tokens, r.partial_block_tokens, r.namespace_tokens)
    assert sum(causes) + r.not_cached_tokens + r.no_state_tokens == r.prompt_tokens - r.cached_tokens
