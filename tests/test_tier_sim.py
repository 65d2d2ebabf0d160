"""The second tier, model-free: TierIndex against a list model, the two-tier replay (and a cluster's shared tier)
against an independent two-level simulation written here, the CLI's --tier-capacity, and plan's tier answer."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import pytest
from cli_testutil import one_line_error
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from prefixcache.cli import app
from prefixcache.core.tier import TierIndex
from prefixcache.sim.cluster import ClusterSpec, cluster_replay, global_bound
from prefixcache.sim.kv_size import PRESETS
from prefixcache.sim.plan import TierRates, make_plan
from prefixcache.sim.policy import Capacity
from prefixcache.sim.replay import replay
from prefixcache.sim.requests import CacheRequests, from_trace
from prefixcache.sim.results import CAUSE_FIELDS
from prefixcache.workload.trace import load_trace, trace_from_lists


# ---- a list model of TierIndex ----------------------------------------------------------------------------------
class ListTier:
    """What TierIndex's docstrings promise, on a plain list (least recent first)."""

    def __init__(self, cap: int | None) -> None:
        self.cap, self.items = cap, []
        self.hit_blocks = self.stored = self.evicted = self.discarded = 0

    def _touch(self, k) -> None:
        self.items.remove(k)
        self.items.append(k)

    def lookup(self, keys, start, stop) -> int:
        for k in keys[:start]:
            if k in self.items:
                self._touch(k)
        n = 0
        for k in keys[start:stop]:
            if k not in self.items:
                break
            self._touch(k)
            n += 1
        self.hit_blocks += n if start < stop else 0
        return n

    def add(self, keys, count: bool = True) -> list:
        for k in reversed(keys):
            if k in self.items:
                self._touch(k)
            else:
                self.items.append(k)
                self.stored += count
        out = []
        while self.cap is not None and len(self.items) > self.cap:
            out.append(self.items.pop(0))
        self.evicted += len(out) if count else 0
        return out

    def restore(self, keys) -> list:
        for k in keys:  # oldest first, as a store lists them
            if k in self.items:
                self._touch(k)
            else:
                self.items.append(k)
        out = []
        while self.cap is not None and len(self.items) > self.cap:
            out.append(self.items.pop(0))
        return out

    def discard(self, k) -> bool:
        if k in self.items:
            self.items.remove(k)
            self.discarded += 1
            return True
        return False


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 9), max_size=6)),
        st.tuples(st.just("restore"), st.lists(st.integers(0, 9), max_size=6)),
        st.tuples(st.just("lookup"), st.lists(st.integers(0, 9), max_size=6), st.integers(0, 6), st.integers(0, 7)),
        st.tuples(st.just("discard"), st.integers(0, 9)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(1, 6)), ops)
def test_tier_index_is_the_list_model(cap, program):
    tier, model = TierIndex(cap), ListTier(cap)
    for op in program:
        if op[0] == "add":
            assert tier.add(op[1]) == model.add(op[1])
        elif op[0] == "restore":
            assert tier.restore(op[1]) == model.restore(op[1])
        elif op[0] == "lookup":
            assert tier.lookup(op[1], op[2], op[3]) == model.lookup(op[1], op[2], op[3])
        else:
            assert tier.discard(op[1]) == model.discard(op[1])
        assert tier.keys() == model.items and len(tier) == len(model.items)
        tier.check_integrity()
    s = tier.stats
    assert (s.hit_blocks, s.stored_blocks, s.evicted_blocks, s.discarded_blocks) == (
        model.hit_blocks,
        model.stored,
        model.evicted,
        model.discarded,
    )


def test_tier_index_refuses_a_capacity_below_one_block():
    for bad in (0, -3):
        with pytest.raises(ValueError, match="capacity_blocks"):
            TierIndex(bad)


# ---- an independent two-level simulation ------------------------------------------------------------------------
class BrutePool:
    """An LRU pool of blocks with prefix semantics (a block is its whole prefix: a tuple). Recency: a request's
    path, deepest first, so a parent is more recent than its child; eviction takes the least recent unpinned
    block that has no child in the pool."""

    def __init__(self, cap: int | None) -> None:
        self.cap, self.lru = cap, OrderedDict()

    def leading(self, ids, limit) -> int:
        n = 0
        while n < limit and ids[n] in self.lru:
            n += 1
        return n

    def insert(self, ids, start, stop, pinned) -> int:
        """Cache ids[start:stop] (ids[:start] are cached and pinned); returns how many fit."""
        want = stop - start
        free = want if self.cap is None else self.cap - len(self.lru)
        while free < want:
            parents = {b[:-1] for b in self.lru}
            victim = next((b for b in self.lru if b not in pinned and b not in parents), None)
            if victim is None:
                break
            del self.lru[victim]
            free += 1
        fit = min(want, free)
        for b in ids[start : start + fit]:
            self.lru[b] = None
        return fit

    def touch(self, ids, n) -> None:
        for b in reversed(ids[:n]):
            self.lru.move_to_end(b)


def brute_two_tier(requests, pools, tier_cap, route=lambda i: 0):
    """requests: (pool ids, tier keys, lookup limit, prompt tokens, block size); pools: one BrutePool per replica.
    Returns per request (blocks served, tier blocks, cached tokens)."""
    tier = ListTier(tier_cap)
    out = []
    for i, (ids, keys, limit, n, bs) in enumerate(requests):
        pool = pools[route(i)]
        p = pool.leading(ids, limit)
        t = tier.lookup(keys, p, limit) if tier_cap != 0 else 0
        if t:
            t = pool.insert(ids, p, p + t, set(ids[:p]))
        start = pool.leading(ids, len(ids))
        fit = pool.insert(ids, start, len(ids), set(ids[:start]))
        pool.touch(ids, start + fit)
        if tier_cap != 0:
            tier.add(keys[: start + fit])
        out.append((p + t, t, min((p + t) * bs, n)))
    return out


def token_case(prompts, replies, namespaces, bs) -> tuple[CacheRequests, list]:
    """Token requests (prompt, then prompt + reply committed) and their brute-force form."""
    from prefixcache.core.hashing import block_keys

    ps = [np.asarray(p, dtype=np.int32) for p in prompts]
    cs = [np.asarray(p + r, dtype=np.int32) for p, r in zip(prompts, replies)]
    reqs = CacheRequests(
        mode="tokens",
        block_size=bs,
        namespace=list(namespaces),
        prompt_tokens=[len(p) for p in ps],
        lookup_blocks=[-(-len(p) // bs) for p in ps],
        timestamp=[None] * len(ps),
        output_tokens=[len(r) for r in replies],
        prompts=ps,
        commits=cs,
    )
    brute = []
    for p, c, ns in zip(prompts, cs, namespaces):
        seq = [int(x) for x in c]
        k = len(seq) // bs
        ids = [(ns, tuple(seq[: (j + 1) * bs])) for j in range(k)]
        brute.append((ids, block_keys(c, ns, block_size=bs), (len(p) - 1) // bs, len(p), bs))
    return reqs, brute


def key_case(paths, namespaces, bs, lengths) -> tuple[CacheRequests, list]:
    """Hash-id requests: ``paths`` of symbols, each distinct prefix given its own id (chained ids, as a trace's)."""
    ids_of: dict[tuple, int] = {}
    hash_ids = [[ids_of.setdefault(tuple(p[: j + 1]), len(ids_of)) for j in range(len(p))] for p in paths]
    n_tokens = [max(1, len(h) * bs - cut) for h, cut in zip(hash_ids, lengths)]
    reqs = from_trace(trace_from_lists(hash_ids, block_size=bs, namespace=namespaces, input_length=n_tokens))
    brute = [
        ([(ns, tuple(h[: j + 1])) for j in range(len(h))], [(ns, x) for x in h], len(h), n, bs)
        for h, ns, n in zip(hash_ids, namespaces, n_tokens)
    ]
    return reqs, brute


segments = [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 1, 2], [5, 6], [1, 2, 7], [3, 3, 3, 3, 3]]


@st.composite
def token_workloads(draw):
    n = draw(st.integers(1, 12))
    prompts, replies, namespaces = [], [], []
    for _ in range(n):
        segs = draw(st.lists(st.sampled_from(segments), min_size=1, max_size=4))
        prompts.append([t for s in segs for t in s] + draw(st.lists(st.integers(0, 3), max_size=3)))
        replies.append(draw(st.lists(st.integers(0, 3), max_size=6)))
        namespaces.append(draw(st.sampled_from(["a", "a", "b"])))
    return prompts, replies, namespaces, draw(st.sampled_from([1, 4]))


@st.composite
def key_workloads(draw):
    n = draw(st.integers(1, 14))
    paths = [draw(st.lists(st.integers(0, 2), min_size=1, max_size=6)) for _ in range(n)]
    namespaces = [draw(st.sampled_from(["a", "a", "b"])) for _ in range(n)]
    bs = draw(st.sampled_from([1, 4]))
    return paths, namespaces, bs, [draw(st.integers(0, bs - 1)) for _ in range(n)]


caps = st.one_of(st.none(), st.integers(1, 12))
tier_caps = st.one_of(st.none(), st.integers(1, 24))


def check_rows(rows, want, brute) -> None:
    """Each row serves what the brute force served, split the same way, and its miss causes add up."""
    assert len(rows) == len(want)
    for r, (blocks, tier_blocks, cached), (_ids, _keys, _limit, n, bs) in zip(rows, want, brute):
        assert (r.hit_blocks, r.tier_blocks, r.cached_tokens) == (blocks, tier_blocks, cached), r
        assert r.tier_tokens == cached - min((blocks - tier_blocks) * bs, n)
        assert sum(getattr(r, f) for f in CAUSE_FIELDS.values()) == r.prompt_tokens - r.cached_tokens, r


@settings(max_examples=120, deadline=None)
@given(token_workloads(), caps, tier_caps)
def test_two_tier_replay_tokens_matches_brute_force(workload, cap, tier_cap):
    prompts, replies, namespaces, bs = workload
    reqs, brute = token_case(prompts, replies, namespaces, bs)
    run = replay(reqs, Capacity(cap), tier=Capacity(tier_cap))
    want = brute_two_tier(brute, [BrutePool(cap)], tier_cap)
    check_rows(run.rows, want, brute)
    for r in run.rows:
        assert r.tier_tokens == r.tier_blocks * bs  # full blocks only
    t = run.totals()
    assert t["pool_tokens"] + t["tier_tokens"] == t["cached_tokens"]
    assert t["tier_tokens"] == sum(w[1] for w in want) * bs


@settings(max_examples=120, deadline=None)
@given(key_workloads(), caps, tier_caps)
def test_two_tier_replay_keys_matches_brute_force(workload, cap, tier_cap):
    paths, namespaces, bs, cuts = workload
    reqs, brute = key_case(paths, namespaces, bs, cuts)
    run = replay(reqs, Capacity(cap), tier=Capacity(tier_cap))
    want = brute_two_tier(brute, [BrutePool(cap)], tier_cap)
    check_rows(run.rows, want, brute)
    pool_only = brute_two_tier(brute, [BrutePool(cap)], 0)  # the brute force without a tier is today's replay
    assert [r.cached_tokens for r in replay(reqs, Capacity(cap)).rows] == [w[2] for w in pool_only]


def test_a_tier_that_never_serves_changes_nothing_but_its_columns():
    reqs, _ = key_case([[0, 1, 2], [0, 1], [0, 1, 2, 0], [1]], ["a"] * 4, 4, [0, 1, 2, 3])
    plain = replay(reqs, Capacity(None)).rows
    tiered = replay(reqs, Capacity(None), tier=Capacity(2)).rows  # an unlimited pool keeps everything
    assert [r._replace(tier_tokens=None, tier_blocks=None, tier_used_blocks=None) for r in tiered] == list(plain)
    assert all(r.tier_tokens == 0 and r.tier_blocks == 0 for r in tiered)
    assert all(r.tier_tokens is None for r in plain)
    assert replay(reqs, Capacity(None)).totals()["tier_tokens"] is None


def test_a_pool_of_one_block_reloads_from_the_tier():
    # block size 4, one request repeated: the pool (1 block) keeps only the latest block, the tier keeps all
    prompt = list(range(13))  # 3 servable blocks
    reqs, _ = token_case([prompt] * 3, [[]] * 3, ["a"] * 3, 4)
    rows = replay(reqs, Capacity(1), tier=Capacity(None)).rows
    # the first commit caches only block 0 (the pool's one block): the tier gets only what the pool took
    assert [r.hit_blocks for r in rows] == [0, 1, 1]
    assert [r.tier_blocks for r in rows] == [0, 0, 0]  # the pool cannot hold more than 1 block: nothing loads
    rows = replay(reqs, Capacity(3), tier=Capacity(None)).rows
    assert [r.cached_tokens for r in rows] == [0, 12, 12]


def test_tier_capacity_one_block():
    reqs, brute = key_case([[0, 1], [2], [0, 1], [0, 1]], ["a"] * 4, 1, [0] * 4)
    rows = replay(reqs, Capacity(1), tier=Capacity(1)).rows
    assert [(r.hit_blocks, r.tier_blocks) for r in rows] == [
        (w[0], w[1]) for w in brute_two_tier(brute, [BrutePool(1)], 1)
    ]
    assert max(r.tier_used_blocks for r in rows) == 1


# ---- the shared tier of a cluster -------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(key_workloads(), st.integers(1, 8), tier_caps, st.integers(1, 3))
def test_cluster_shared_tier_matches_brute_force(workload, cap, tier_cap, n):
    paths, namespaces, bs, cuts = workload
    reqs, brute = key_case(paths, namespaces, bs, cuts)
    spec = ClusterSpec(n, Capacity(cap), "round_robin", tier=Capacity(tier_cap))
    result = cluster_replay(reqs, spec)
    assert list(result.replica) == [i % n for i in range(len(reqs))]
    want = brute_two_tier(brute, [BrutePool(cap) for _ in range(n)], tier_cap, route=lambda i: i % n)
    assert [(r.hit_blocks, r.tier_blocks, r.cached_tokens) for r in result.run.rows] == want
    s = result.summary()
    assert s["shared_tier"] and s["tier_tokens"] == sum(r.tier_tokens for r in result.run.rows)
    bound = global_bound(reqs, spec).rows  # one cache of n x cap blocks above the same (fresh) tier
    assert [(r.hit_blocks, r.tier_blocks) for r in bound] == [
        w[:2] for w in brute_two_tier(brute, [BrutePool(cap * n)], tier_cap)
    ]


# ---- the CLI --------------------------------------------------------------------------------------------------
runner = CliRunner()


def test_cli_simulate_with_a_tier(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [f'{{"timestamp": {i}, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}}' for i in range(3)]
    lines.append('{"timestamp": 3, "input_length": 4, "output_length": 1, "hash_ids": [7]}')
    lines += [f'{{"timestamp": {i}, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}}' for i in (4, 5)]
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["simulate", str(trace), "--block-size", "4", "--capacity-blocks", "2",
                            "--tier-capacity", "1k", "--no-progress", "--json", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "tier hit rate" in r.output and "pool hit rate" in r.output
    from prefixcache.reports.record import load_record

    rec = load_record(out)
    t = rec.totals()[0]
    # [1 2] cold, then 8 tokens from the pool twice; [7] evicts block 2 from the pool (2 blocks), so the next
    # [1 2] gets block 1 from the pool and block 2 from the tier; the last one both from the pool
    assert t["tier_capacity_blocks"] == 250 and t["tier_tokens"] == 4 and t["cached_tokens"] == 4 * 8
    assert rec.runs[0].tier == Capacity(250)


@pytest.mark.parametrize(
    "value, fragment",
    [("-5", "--tier-capacity must be > 0, got -5"), ("0", "--tier-capacity must be > 0, got 0"),
     ("lots", "--tier-capacity: expected a number of tokens"), ("3", "--tier-capacity '3'"),
     ("1.5", "--tier-capacity: expected a whole number")],
)  # fmt: skip
def test_cli_refuses_a_bad_tier_capacity(value, fragment):
    r = runner.invoke(app, ["simulate", "scenarios/chat.yaml", f"--tier-capacity={value}", "--no-progress"])
    one_line_error(r, fragment)


# ---- plan: RAM and disk -----------------------------------------------------------------------------------------
def two_conversations(tmp_path):
    """Block size 1, hash ids [1 2 3], [4 5 6], [1 2 3], [4 5 6] (3 tokens each), as a trace file."""
    path = tmp_path / "two.jsonl"
    rows = [[1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6]]
    path.write_text(
        "".join(
            f'{{"timestamp": {i}, "input_length": 3, "output_length": 1, "hash_ids": {json.dumps(h)}}}\n'
            for i, h in enumerate(rows)
        )
    )
    return path


def test_plan_tier_answer_by_hand(tmp_path):
    # Pool of 3 blocks: each request evicts the other's 3 blocks, so the pool alone never hits; a lookup may serve
    # all 3 hash ids of a trace request. The tier adds a path deepest block first (its root ends most recent), so
    # a full tier drops a chain's tail first. Tier of 6: requests 3 and 4 get all 3 blocks from it (6/12, the
    # achievable rate). Tier of 5 (by hand): after
    # requests 1-2 it holds 2 1 6 5 4 (3 was evicted); request 3 gets 1 2; adding 1 2 3 evicts 6; request 4 gets
    # 4 5: 4 of 12 tokens, two thirds of the achievable rate (enough for 50%, not 70%). Tier of 4: request 3
    # gets 1 only, request 4 gets 4 only: a third. So the answers are 5, 6, 6 blocks.
    # TTFT at 1,000 prefill tokens/s and 100 tier tokens/s with the 6-block tier: 3 ms, 3 ms, 30 ms, 30 ms (mean
    # 16.5 ms, p50 16.5 ms, p90 30 ms); no cache 3 ms each.
    tr = load_trace(two_conversations(tmp_path), 1)
    plan = make_plan(
        tr, pools=[3], tier_rates=TierRates(prefill_rate=1000.0, read_bytes=None, read_tokens=100.0), bound=False
    )
    tp = plan.tiers
    assert plan.unlimited_rate == 0.5
    assert tp.pool_only[0].rate == 0.0 and tp.pool_only[0].ttft_mean_s == pytest.approx(0.003)
    assert [a.point.tier_blocks for a in tp.answers] == [5, 6, 6]
    p5, p6 = tp.answers[0].point, tp.answers[1].point
    assert (p5.pool_rate, p5.tier_rate, p5.miss_rate) == pytest.approx((0.0, 4 / 12, 8 / 12))
    assert (p6.pool_rate, p6.tier_rate, p6.miss_rate) == (0.0, 0.5, 0.5)
    assert (p6.ttft_mean_s, p6.ttft_p50_s, p6.ttft_p90_s) == pytest.approx((0.0165, 0.0165, 0.03))
    assert tp.no_cache.ttft_mean_s == pytest.approx(0.003)
    # a pool of 6 needs no tier
    plan = make_plan(
        tr, pools=[6], tier_rates=TierRates(prefill_rate=1000.0, read_bytes=None, read_tokens=100.0), bound=False
    )
    assert [a.point.tier_blocks for a in plan.tiers.answers] == [0, 0, 0]


def test_tier_rates_in_bytes_use_the_model_kv_size():
    small = PRESETS["small"]  # 2 x 12 layers x 12 heads x 64 dims x 4 bytes = 73,728 B/token
    r = TierRates(prefill_rate=1000.0, read_bytes=2e9, bytes_per_token=small.bytes_per_token)
    assert small.bytes_per_token == 73_728
    assert r.ttft_s(500, 73_728) == pytest.approx(0.5 + 73_728 * 73_728 / 2e9)
    for bad in (dict(read_bytes=None), dict(read_tokens=5.0), dict(read_bytes=2e9), dict(prefill_rate=0.0)):
        with pytest.raises(ValueError):
            TierRates(**{"bytes_per_token": None, **bad})


@settings(max_examples=25, deadline=None)
@given(key_workloads(), st.integers(1, 6))
def test_plan_tier_is_the_smallest_that_reaches_the_share(workload, pool):
    paths, namespaces, bs, cuts = workload
    reqs, _ = key_case(paths, namespaces, bs, cuts)
    plan = make_plan(reqs.trace, pools=[pool], tier_rates=TierRates(read_bytes=None, read_tokens=1e4), bound=False)
    for a in plan.tiers.answers:
        rate = lambda t: replay(reqs, Capacity(pool), tier=Capacity(t) if t else None).totals()["token_hit_rate"]  # noqa: E731
        if a.point is None:
            assert rate(plan.working_set_blocks) < a.target_rate - 1e-12
            continue
        t = a.point.tier_blocks
        assert rate(t) >= a.target_rate - 1e-12 and a.point.rate == rate(t)
        if t > 0:
            assert rate(t - 1) < a.target_rate - 1e-12 or t == 1  # rate(0): no tier


def test_cli_plan_with_pool_capacity(tmp_path):
    path = two_conversations(tmp_path)
    out = tmp_path / "plan.json"
    args = ["plan", str(path), "--block-size", "1", "--pool-capacity", "3", "--tier-read-rate", "100 tok"]
    r = runner.invoke(app, [*args, "--no-bound", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "RAM and disk" in r.output
    d = json.loads(out.read_text())["tiers"]
    assert d["read_tokens_per_s"] == 100.0 and [a["tier_blocks"] for a in d["answers"]] == [5, 6, 6]  # by hand: above
    r = runner.invoke(app, ["plan", str(path), "--block-size", "1", "--pool-capacity", "3", "--no-bound"])
    assert r.exit_code == 0 and "small model" in r.output  # bytes/s by default: the small model's KV size


@pytest.mark.parametrize(
    "args, fragment",
    [(["--pool-capacity", "0"], "--pool-capacity must be > 0"),
     (["--pool-capacity", "unlimited"], "--pool-capacity 'unlimited'"),
     (["--pool-capacity", "3", "--tier-read-rate", "fast"], "--tier-read-rate 'fast'"),
     (["--pool-capacity", "3", "--tier-read-rate", "-2G"], "--tier-read-rate '-2G'"),
     (["--pool-capacity", "3", "--prefill-rate", "0"], "--prefill-rate must be a positive")],
)  # fmt: skip
def test_cli_plan_refuses_bad_tier_options(tmp_path, args, fragment):
    r = runner.invoke(app, ["plan", str(two_conversations(tmp_path)), "--block-size", "1", "--no-bound", *args])
    one_line_error(r, fragment)


# ---- the run record ---------------------------------------------------------------------------------------------
def test_run_record_keeps_the_tier(tmp_path):
    from prefixcache.core.errors import InputError
    from prefixcache.reports.record import build_record, load_record, save_record, to_json

    reqs, _ = key_case([[0, 1, 2], [3], [0, 1, 2], [0, 1]], ["a"] * 4, 4, [0, 1, 2, 3])
    run = replay(reqs, Capacity(2), tier=Capacity(5))
    assert sum(r.tier_tokens for r in run.rows) > 0
    rec = build_record("simulate", "x", {}, [run])
    save_record(rec, tmp_path / "r.json")
    back = load_record(tmp_path / "r.json")
    assert back.runs[0].rows == run.rows and back.runs[0].tier == Capacity(5)
    assert back.totals() == rec.totals()
    raw = to_json(rec)
    v2 = to_json(build_record("simulate", "x", {}, [replay(reqs, Capacity(2))]))  # as version 2 wrote it:
    v2["version"] = 2  # no run tier, no tier columns
    del v2["runs"][0]["tier"]
    for f in ("tier_tokens", "tier_blocks", "tier_used_blocks"):
        del v2["runs"][0]["rows"][f]
    (tmp_path / "v2.json").write_text(json.dumps(v2))
    old = load_record(tmp_path / "v2.json").runs[0]
    assert old.tier is None and all(r.tier_tokens is None for r in old.rows)
    bad = json.loads(json.dumps(raw))
    k = next(i for i, v in enumerate(bad["runs"][0]["rows"]["tier_tokens"]) if v)
    bad["runs"][0]["rows"]["tier_tokens"][k] = bad["runs"][0]["rows"]["cached_tokens"][k] + 1
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(InputError, match=rf"tier_tokens\[{k}\]: .* is more than cached_tokens"):
        load_record(tmp_path / "bad.json")
    bad = json.loads(json.dumps(raw))
    bad["runs"][0]["tier"] = None
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(InputError, match="set, but the run has no tier"):
        load_record(tmp_path / "bad.json")


def test_cli_cluster_with_a_shared_tier(tmp_path):
    trace = tmp_path / "t.jsonl"
    paths = [[1, 2], [3], [1, 2], [3], [1, 2], [1, 2]]
    trace.write_text(
        "".join(
            f'{{"timestamp": {i}, "input_length": {4 * len(h)}, "output_length": 1, "hash_ids": {json.dumps(h)}}}\n'
            for i, h in enumerate(paths)
        )
    )
    out = tmp_path / "c.json"
    args = ["simulate", str(trace), "--block-size", "4", "--capacity-blocks", "2", "--replicas", "2"]
    r = runner.invoke(
        app, [*args, "--tier-capacity", "1k", "--router", "round_robin", "--no-progress"] + ["--json", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert "shared tier of 1,000 tokens (250 blocks)" in r.output
    rec = json.loads(out.read_text())
    # round robin: replica 0 gets [1 2] three times, replica 1 gets [3], [3], [1 2]: its [1 2] comes from the tier
    (rr,) = rec["routers"]
    assert rr["tier_tokens"] == 8 and rr["cached_tokens"] == 8 + 8 + 4 + 8
    assert rec["settings"]["shared_tier_blocks"] == 250
