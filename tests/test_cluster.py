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
from prefixcache.sim.routing import LoadGuard
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
    # on a real trace, under both queues: the routing equals the brute-force reference (which knows no queue:
    # the load it routes by is the same under both), and each queue's delays equal its by-hand reference
    trace = load_trace(HEAD).take(list(range(120)))
    rate, guard = 2_000, LoadGuard(4_000, 1.5)
    ref = _prefix_balanced_by_hand(trace, 3, 40, rate, guard)
    assert {"prefix", "load", "cold"} <= set(ref.reason)  # every branch of the policy is taken
    for queue in (PrefillQueue(), chunked):
        spec = ClusterSpec(3, Capacity(40), "prefix_balanced", guard=guard, load=LoadModel(rate, queue), near=0.0)
        res = cluster_replay(from_trace(trace), spec)
        assert list(res.replica) == ref.replica and list(res.reason) == ref.reason
        assert list(res.prefill_tokens) == ref.work
        for r in range(3):
            mine = [k for k, x in enumerate(ref.replica) if x == r]
            arrival = [ref.arrival[k] for k in mine]
            work = [ref.work[k] for k in mine]
            want = (
                _fcfs_by_hand(arrival, work, rate)
                if queue == PrefillQueue()
                else _chunked_by_hand(arrival, work, rate, 32, 16)
            )
            assert [res.queue_delay_s[k] for k in mine] == pytest.approx(want, abs=1e-9)
        assert max(res.queue_delay_s) > 0


class _Routed:
    """The brute-force reference's decisions: per request the replica, the reason, its prefill work and arrival."""

    def __init__(self) -> None:
        self.replica: list[int] = []
        self.reason: list[str] = []
        self.work: list[int] = []
        self.arrival: list[float] = []


def _prefix_balanced_by_hand(trace, n: int, cap: int, rate: float, guard: LoadGuard, min_match: float = 0.3):
    """prefix_balanced (near 0) from its documented rules, with no index and no load model of the code's: what
    replica r would serve of request i is found by replaying r's own requests so far, then i, through a fresh
    cache of ``cap`` blocks; r's load is the prefill it has not finished at i's arrival (one prompt at a time)."""
    out = _Routed()
    free_at = [0.0] * n
    turn = 0

    def pick(tied: list[int]) -> int:
        nonlocal turn
        if len(tied) == 1:
            return tied[0]
        turn += 1
        return tied[(turn - 1) % len(tied)]

    def least(cands: list[int], loads: list[float]) -> int:
        low = min(loads[r] for r in cands)
        return pick([r for r in cands if loads[r] == low])

    for i in range(len(trace)):
        now = float(trace.timestamp[i]) / 1000
        loads = [max(0.0, free_at[r] - now) * rate for r in range(n)]
        served = []
        for r in range(n):
            mine = [k for k, x in enumerate(out.replica) if x == r]
            served.append(replay(from_trace(trace.take([*mine, i])), Capacity(cap)).rows[-1].cached_tokens)
        bs = trace.block_size
        held = [c // bs for c in served]
        blocks = len(trace.hash_ids(i))
        hi, lo = max(loads), min(loads)
        if hi - lo > guard.abs_threshold and hi > lo * guard.rel_threshold:
            r, why = least(list(range(n)), loads), "load"
        elif max(held) == 0:
            r, why = least(list(range(n)), loads), "cold"
        elif max(held) < min_match * blocks:
            r, why = least(list(range(n)), loads), "short"
        else:
            r, why = least([x for x in range(n) if held[x] == max(held)], loads), "prefix"
        work = int(trace.input_length[i]) - served[r]
        free_at[r] = max(now, free_at[r]) + work / rate
        out.replica.append(r)
        out.reason.append(why)
        out.work.append(work)
        out.arrival.append(now)
    return out


def _fcfs_by_hand(arrival: list[float], work: list[int], rate: float) -> list[float]:
    """One prompt at a time in arrival order: each waits until the replica's earlier work is done."""
    done, out = 0.0, []
    for a, w in zip(arrival, work):
        out.append(max(0.0, done - a))
        done = max(a, done) + w / rate
    return out


def _chunked_by_hand(arrival: list[float], work: list[int], rate: float, step: int, cap: int) -> list[float]:
    """Steps of at most ``step`` tokens, each prompt at most ``cap`` of a step, started prompts first (in the order
    they started), then arrived ones in arrival order; a step lasts its tokens / rate; a prompt's delay is its
    finish - arrival - work / rate."""
    left = {k: w for k, w in enumerate(work)}
    started: list[int] = []
    queue: list[int] = []
    out = [0.0] * len(work)
    t, k = 0.0, 0
    while k < len(work) or started or queue:
        if not started and not queue and arrival[k] > t:
            t = arrival[k]
        while k < len(work) and arrival[k] <= t:
            queue.append(k)
            k += 1
        used = 0
        for j in [*started, *queue]:
            if used == step and j in queue:
                break
            give = min(left[j], cap, step - used)
            if j in queue:
                queue.remove(j)
                started.append(j)
            left[j] -= give
            used += give
        t += used / rate
        for j in [j for j in started if left[j] == 0]:
            started.remove(j)
            out[j] = max(0.0, t - arrival[j] - work[j] / rate)
    return out


def test_guard_loads_are_tokens_of_unfinished_prefill():
    # replica 0 serves A (10 blocks, 160 tokens, cold) at t=0; B at t=0 holds A's 10 blocks + 1 there; at 16
    # tokens/s replica 0 then has 160 tokens (10 s) of prefill to do, replica 1 none. A guard of 159 tokens finds
    # that unbalanced (B goes by load to replica 1), one of 160 does not (B follows its prefix, 160 cached)
    tr = trace_from_lists([list(range(1, 11)), list(range(1, 12))], block_size=16, timestamp=[0, 0])
    for abs_tokens, replicas, reasons, cached in (
        (159, (0, 1), ("cold", "load"), [0, 0]),
        (160, (0, 0), ("cold", "prefix"), [0, 160]),
    ):
        spec = ClusterSpec(2, Capacity(100), guard=LoadGuard(abs_tokens, 1.5), load=LoadModel(16), near=0.0)
        res = cluster_replay(from_trace(tr), spec)
        assert (res.replica, res.reason) == (replicas, reasons), abs_tokens
        assert [row.cached_tokens for row in res.run.rows] == cached


def test_cache_hits_are_not_prefilled():
    # B shares A's first 3 of 4 blocks: it prefills 16 tokens (0.25 s at 64 tokens/s), not 64; C arrives at 1.2 s
    # while B (queued behind A until 1.0) runs until 1.25
    tr = trace_from_lists([[1, 2, 3, 4], [1, 2, 3, 9], [20]], block_size=16, timestamp=[0, 500, 1200])
    res = cluster_replay(from_trace(tr), ClusterSpec(1, Capacity(100), "least_loaded", load=LoadModel(64)))
    assert res.prefill_tokens == (64, 16, 16)
    assert res.queue_delay_s == pytest.approx((0.0, 0.5, 0.05))
    assert res.summary()["busy_s_per_replica"] == pytest.approx([1.5])


def test_backlog_counts_from_the_arrival_after_an_idle_gap_and_adds_up_when_busy():
    # 2 replicas, least loaded, 64 tokens/s; loads by hand (tokens left at each arrival), ties in turn:
    # A t=0 128 tok: (0, 0) tie -> 0 | B t=0 64: (128, 0) -> 1 | C t=10 64: (0, 0) tie -> 1 (its turn)
    # D t=10 32: (0, 64) -> 0 | E t=10 16: (32, 64) -> 0 (replica 1's work from t=10, not from its idle t=1)
    tr = trace_from_lists(
        [list(range(1, 9)), list(range(10, 14)), list(range(20, 24)), [30, 31], [40]],
        block_size=16,
        timestamp=[0, 0, 10_000, 10_000, 10_000],
    )
    res = cluster_replay(from_trace(tr), ClusterSpec(2, Capacity(100), "least_loaded", load=LoadModel(64)))
    assert res.replica == (0, 1, 1, 0, 0)
    assert res.queue_delay_s == pytest.approx((0.0, 0.0, 0.0, 0.0, 0.5))
    # all at t=0: A 48 -> 0 | B 16: (48, 0) -> 1 | C, D 16: (48, 16), (48, 32) -> 1 | E: (48, 48) tie -> 1 (turn 1)
    # | F: (48, 64) -> 0: replica 1's queue adds up (a load of its last prompt alone would keep F there)
    tr = trace_from_lists([[1, 2, 3], [4], [5], [6], [7], [8]], block_size=16, timestamp=[0] * 6)
    res = cluster_replay(from_trace(tr), ClusterSpec(2, Capacity(100), "least_loaded", load=LoadModel(16)))
    assert res.replica == (0, 1, 1, 1, 1, 0)


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
