"""The model-free cluster simulation: round robin and the global bound against independent replays, the load
model against hand-computed queues, the index-driven routers, and `simulate --replicas` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prefixcache.cli import app
from prefixcache.sim.cluster import DEFAULT_NEAR_TOKENS, ClusterSpec, LoadModel, cluster_replay, global_bound
from prefixcache.sim.policy import Capacity
from prefixcache.sim.queueing import PrefillQueue
from prefixcache.sim.replay import replay
from prefixcache.sim.requests import from_scenario, from_trace
from prefixcache.workload.scenario import load_scenario
from prefixcache.workload.trace import load_trace, trace_from_lists

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[1]
HEAD = DATA / "mooncake_conversation_head200.jsonl"


def test_round_robin_equals_independent_replays_of_each_replicas_share():
    trace = load_trace(HEAD)
    n, cap = 3, 40
    res = cluster_replay(from_trace(trace), ClusterSpec(n, Capacity(cap), "round_robin"))
    assert list(res.replica) == [i % n for i in range(len(trace))]
    for r in range(n):  # replica r saw exactly requests r, r+n, ...: replay that sub-trace on its own
        own = replay(from_trace(trace.take(list(range(r, len(trace), n)))), Capacity(cap))
        assert [row.cached_tokens for row in own.rows] == [row.cached_tokens for row in res.run.rows[r::n]]


def test_global_bound_is_one_cache_of_the_total_size():
    reqs = from_trace(load_trace(HEAD))
    spec = ClusterSpec(4, Capacity(25))
    assert global_bound(reqs, spec).totals() == replay(reqs, Capacity(100)).totals()


def test_queueing_delays_by_hand():
    # three requests of 4 blocks x 16 tokens on ONE replica at 64 tokens/s: each needs 1 s of prefill
    # (nothing is shared); arrivals at 0, 0.5 and 3 s -> waits 0, 0.5 (until 1.0) and 0 (idle since 2.0)
    tr = trace_from_lists([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], block_size=16, timestamp=[0, 500, 3000])
    res = cluster_replay(from_trace(tr), ClusterSpec(1, Capacity(100), "least_loaded", load=LoadModel(64)))
    assert res.queue_delay_s == pytest.approx((0.0, 0.5, 0.0))
    assert res.prefill_tokens == (64, 64, 64)
    s = res.summary()
    assert s["busy_s_per_replica"] == pytest.approx([3.0]) and s["queue_delay_p99_s"] == pytest.approx(0.49)


def test_chunked_queue_changes_delays_not_routing():
    # the same three prompts of 64 tokens at 0, 0.5 and 3 s on one replica at 64 tokens/s, in steps of 32 tokens
    # of which one prompt gets at most 16: alone, the first takes 16 a step (0.25 s); from 0.5 both take 16 a
    # step (0.5 s): the first is done at 1.5, the second then alone at 2.0; the third is alone again
    tr = trace_from_lists([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], block_size=16, timestamp=[0, 500, 3000])
    chunked = PrefillQueue("chunked", 32, 16)
    spec = ClusterSpec(1, Capacity(100), "least_loaded", load=LoadModel(64, chunked))
    res = cluster_replay(from_trace(tr), spec)
    assert res.queue_delay_s == pytest.approx((0.5, 0.5, 0.0))
    s = res.summary()
    assert (s["prefill_queue"], s["prefill_step_tokens"], s["prefill_chunk_tokens"]) == ("chunked", 32, 16)
    # on a real trace: the very same decisions and hits under both queues; each result gives the other's delays
    reqs = from_trace(load_trace(HEAD))
    fcfs, chunk = (
        cluster_replay(reqs, ClusterSpec(3, Capacity(40), "prefix_balanced", load=LoadModel(2_000, q)))
        for q in (PrefillQueue(), chunked)
    )
    assert fcfs.replica == chunk.replica and fcfs.run.totals() == chunk.run.totals()
    assert fcfs.arrival_s == chunk.arrival_s and fcfs.prefill_tokens == chunk.prefill_tokens
    assert list(chunk.queue_delay_s) == fcfs.delays(chunked)
    assert list(fcfs.queue_delay_s) == chunk.delays(PrefillQueue())
    assert fcfs.summary(chunked) == chunk.summary() and chunk.summary(PrefillQueue()) == fcfs.summary()
    assert max(fcfs.queue_delay_s) > 0 and fcfs.queue_delay_s != chunk.queue_delay_s
    busy: dict[int, float] = {}  # fcfs by hand: a request starts when its replica's earlier work is done
    for r, a, n, d in zip(fcfs.replica, fcfs.arrival_s, fcfs.prefill_tokens, fcfs.queue_delay_s):
        start = max(a, busy.get(r, 0.0))
        assert d == pytest.approx(start - a)
        busy[r] = start + n / 2_000


def test_least_loaded_uses_outstanding_work_not_counts():
    # one long request then two short ones, all at t=0 on 2 replicas: the long one occupies replica 0, so
    # both short ones go to replica 1 (request counts would alternate)
    tr = trace_from_lists([[1] * 1 + list(range(2, 11)), [20], [30]], block_size=16, timestamp=[0, 0, 0])
    res = cluster_replay(from_trace(tr), ClusterSpec(2, Capacity(100), "least_loaded", load=LoadModel(16)))
    assert res.replica == (0, 1, 1)


def test_prefix_routers_follow_the_history_and_balance_work():
    sc = load_scenario(ROOT / "scenarios" / "chat.yaml")
    reqs = from_scenario(sc, 16)
    rr = cluster_replay(reqs, ClusterSpec(2, Capacity(200), "round_robin")).summary()
    pb = cluster_replay(reqs, ClusterSpec(2, Capacity(200), "prefix_balanced")).summary()
    bound = global_bound(reqs, ClusterSpec(2, Capacity(200))).totals()
    assert rr["token_hit_rate"] < pb["token_hit_rate"] <= bound["token_hit_rate"] + 1e-12
    assert pb["reasons"].get("prefix", 0) > 0


def test_near_reaches_the_router():
    # request 0 (10 blocks) is cold and lands on replica 0; long after (both idle) request 1 shares only its
    # first block with it: 1 of 11 blocks is short of min_match. near = 0: the least loaded in turn (replica
    # 1, nothing cached); the default near: the idle replica holding that block (replica 0, 16 tokens cached)
    tr = trace_from_lists([list(range(1, 11)), [1, *range(20, 30)]], block_size=16, timestamp=[0, 10_000_000])
    plain = cluster_replay(from_trace(tr), ClusterSpec(2, Capacity(100), near=0.0))
    assert plain.replica == (0, 1) and plain.reason == ("cold", "short")
    assert [row.cached_tokens for row in plain.run.rows] == [0, 0]
    spec = ClusterSpec(2, Capacity(100))
    assert spec.near == DEFAULT_NEAR_TOKENS == 3_000.0
    near = cluster_replay(from_trace(tr), spec)
    assert near.replica == (0, 0) and near.reason == ("cold", "short")
    assert [row.cached_tokens for row in near.run.rows] == [0, 16]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "3000", True])
def test_cluster_spec_rejects_a_bad_near(bad):
    with pytest.raises(ValueError, match="near"):
        ClusterSpec(2, Capacity(100), near=bad)


@pytest.mark.parametrize(
    ("name", "rr_rate", "bound_rate"),
    [("mooncake_conversation_trace.jsonl.gz", 0.091, 0.216)],  # issue 11's independent replay: 9.1% and 21.6%
)
def test_mooncake_round_robin_and_bound_match_the_reference(traces_dir, name, rr_rate, bound_rate):
    reqs = from_trace(load_trace(traces_dir / name))
    spec = ClusterSpec(4, Capacity(2500), "round_robin")
    assert round(cluster_replay(reqs, spec).summary()["token_hit_rate"], 3) == rr_rate
    assert round(global_bound(reqs, spec).totals()["token_hit_rate"], 3) == bound_rate


def test_simulate_replicas_cli_and_report(tmp_path):
    out = tmp_path / "cluster.json"
    r = CliRunner().invoke(
        app,
        [
            "simulate",
            str(HEAD),
            "--replicas",
            "2",
            "--capacity-blocks",
            "50",
            "--no-progress",
            "--json",
            str(out),
            "--html",
            str(tmp_path / "c.html"),
        ],
    )
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())
    assert [x["router"] for x in rec["routers"]] == ["round_robin", "least_loaded", "prefix", "prefix_balanced"]
    assert all(sum(x["requests_per_replica"]) == 200 for x in rec["routers"])
    assert "data:image/png;base64," in (tmp_path / "c.html").read_text()
    r = CliRunner().invoke(app, ["report", str(out)])
    assert r.exit_code == 0 and "prefix_balanced" in r.output
    assert rec["settings"]["near_tokens"] == 3_000.0
    r = CliRunner().invoke(app, ["simulate", str(HEAD), "--replicas", "2", "-c", "51200", "-c", "102400"])
    assert r.exit_code == 2 and "one capacity" in r.output
    r = CliRunner().invoke(app, ["simulate", str(HEAD), "--replicas", "2", "--capacity-blocks", "9", "--router", "x"])
    assert r.exit_code == 2 and "unknown" in r.output


def test_simulate_near_tokens_option(tmp_path):
    out = tmp_path / "cluster.json"
    base = ["simulate", str(HEAD), "--replicas", "2", "--capacity-blocks", "50", "--no-progress"]
    r = CliRunner().invoke(app, [*base, "--router", "prefix_balanced", "--near-tokens", "0", "--json", str(out)])
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())
    assert rec["settings"]["near_tokens"] == 0.0
    r = CliRunner().invoke(app, ["report", str(out), "--markdown", str(tmp_path / "c.md")])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "c.md").read_text()  # the Settings table, beside the guard, formatted for people
    assert "| guard | abs threshold: 131,072, rel threshold: 1.5 |" in md and "| near tokens | 0 |" in md
    for bad in ("-1", "nan"):
        r = CliRunner().invoke(app, [*base, "--near-tokens", bad])
        assert r.exit_code == 2 and "--near-tokens" in r.output, r.output


def test_simulate_prefill_queue_option(tmp_path):
    base = ["simulate", str(HEAD), "--replicas", "2", "--capacity-blocks", "50", "--no-progress"]
    chunk = ["--prefill-queue", "chunked", "--prefill-step-tokens", "4096", "--prefill-chunk-tokens", "512"]
    recs = {}
    for q, flags, label in (
        ("fcfs", [], "fcfs queue"),
        ("chunked", chunk, "chunked (512 of 4,096 tokens a step) queue"),
        (
            "nocap",
            ["--prefill-queue", "chunked", "--prefill-chunk-tokens", "0"],
            "chunked (8,192 tokens a step, no cap)",
        ),
    ):
        out = tmp_path / f"{q}.json"
        r = CliRunner().invoke(app, [*base, "--router", "least_loaded", *flags, "--json", str(out)])
        assert r.exit_code == 0, r.output
        assert label in " ".join(r.output.split()), r.output
        recs[q] = json.loads(out.read_text())
    assert recs["fcfs"]["settings"]["prefill_queue"] == "fcfs"
    assert "prefill_step_tokens" not in recs["fcfs"]["settings"]
    for rec, step, cap in ((recs["chunked"], 4096, 512), (recs["nocap"], 8192, None)):
        for where in (rec["settings"], rec["routers"][0]):
            got = (where["prefill_queue"], where["prefill_step_tokens"], where["prefill_chunk_tokens"])
            assert got == ("chunked", step, cap)
    fcfs, chunked = (recs[q]["routers"][0] for q in ("fcfs", "chunked"))
    assert fcfs["requests_per_replica"] == chunked["requests_per_replica"]
    assert fcfs["token_hit_rate"] == chunked["token_hit_rate"]
    for flags, msg in (
        (["--prefill-queue", "lifo"], "--prefill-queue 'lifo': unknown; known: fcfs, chunked"),
        (["--prefill-chunk-tokens", "512"], "--prefill-chunk-tokens applies to --prefill-queue chunked only"),
        (["--prefill-queue", "chunked", "--prefill-step-tokens", "0"], "--prefill-step-tokens 0: must be at least 1"),
        (["--prefill-queue", "chunked", "--prefill-chunk-tokens", "-1"], "--prefill-chunk-tokens -1: must be at"),
    ):
        r = CliRunner().invoke(app, [*base, *flags])
        assert r.exit_code == 2 and msg in r.output, r.output
    r = CliRunner().invoke(app, [*base, "--prefill-queue", "chunked", "--prefill-rate", "-5"])
    assert r.exit_code == 2 and "--prefill-rate: prefill_rate must be a positive number" in r.output, r.output
