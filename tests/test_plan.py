"""make_plan's numbers against independent replays, and the `prefixcache plan` command on real sample files."""

from __future__ import annotations

import itertools
import json
import math
import random

import numpy as np
import pytest
from test_curves_lru import slice_lines
from typer.testing import CliRunner

from prefixcache import CacheConfig, PrefixCache
from prefixcache.sim.kv_size import PRESETS
from prefixcache.sim.node_trace import canonical_blocks
from prefixcache.sim.optimal import optimal_hits
from prefixcache.sim.plan import make_plan
from prefixcache.workload.trace import load_trace, trace_from_lists


def rate(trace, policy: str, capacity: int, weight: str, warmup: float = 0.0, keep_for=None) -> float:
    """Independent replay through the real cache (clock = timestamp in seconds)."""
    now = [0.0]
    cache = PrefixCache(
        CacheConfig(num_blocks=capacity, block_size=trace.block_size, eviction=policy), clock=lambda: now[0]
    )
    start = int(np.floor(warmup * len(trace)))
    hit = total = 0
    for i in range(len(trace)):
        now[0] = float(trace.timestamp[i]) / 1000
        keys = trace.hash_ids(i).tolist()
        m = cache.match_keys(keys, trace.namespace[i], num_tokens=int(trace.input_length[i]))
        if i >= start:
            hit += m.cached_blocks if weight == "blocks" else m.cached_tokens
            total += len(keys) if weight == "blocks" else int(trace.input_length[i])
        cache.commit_keys(m.handle, keep_for=keep_for)
        cache.release(m.handle)
    return hit / total


@pytest.fixture
def conv_slice(traces_dir, tmp_path):
    return slice_lines(traces_dir / "mooncake_conversation_trace.jsonl.gz", tmp_path / "conv.jsonl", 1000, 250)


@pytest.mark.parametrize("weight,warmup", [("tokens", 0.0), ("blocks", 0.2)])
def test_plan_matches_replays(conv_slice, weight, warmup):
    tr = load_trace(conv_slice)
    plan = make_plan(
        tr,
        policies=["lru", "fifo", "priority"],
        weight=weight,
        warmup=warmup,
        points=6,
        model=PRESETS["small"],
        keep_for=30.0,
    )
    W = plan.working_set_blocks
    assert plan.unlimited_rate == pytest.approx(rate(tr, "lru", W + 10, weight, warmup))
    for k, c in enumerate(plan.grid):
        assert plan.rates["lru"][k] == pytest.approx(rate(tr, "lru", c, weight, warmup))
        assert plan.rates["fifo"][k] == pytest.approx(rate(tr, "fifo", c, weight, warmup))
        assert plan.rates["priority"][k] == pytest.approx(rate(tr, "priority", c, weight, warmup, keep_for=30.0))
        assert plan.rates["optimal"][k] >= max(plan.rates[p][k] for p in ("lru", "fifo", "priority")) - 1e-12
    for a in plan.answers:
        if a.curve == "lru":  # exact: the smallest capacity that reaches the target
            assert rate(tr, "lru", a.capacity_blocks, weight, warmup) >= a.target_rate - 1e-12
            if a.capacity_blocks > 1:
                assert rate(tr, "lru", a.capacity_blocks - 1, weight, warmup) < a.target_rate
        if a.curve == "fifo" and a.capacity_blocks is not None:  # first grid point reaching it
            assert a.capacity_blocks in plan.grid
            assert rate(tr, "fifo", a.capacity_blocks, weight, warmup) >= a.target_rate - 1e-12
        assert a.gb == pytest.approx(a.capacity_blocks * PRESETS["small"].bytes_per_block(512) / 1e9)
    opt = {a.fraction: a.capacity_blocks for a in plan.answers if a.curve == "optimal"}
    lru = {a.fraction: a.capacity_blocks for a in plan.answers if a.curve == "lru"}
    assert all(opt[f] <= lru[f] for f in opt)


def sessions_trace(seed: int, sessions: int = 4, turns: int = 15):
    """kv-tester-like: sessions one after another in the file, their timestamps interleaved (5 s apart); each
    request extends a random prefix of an earlier request of its session (or starts afresh), blocks of 4."""
    rng = random.Random(seed)
    reqs, stamps, namespaces = [], [], []
    for s in range(sessions):
        mine: list[list[int]] = []
        fresh = itertools.count()
        for k in range(turns):
            base = rng.choice(mine)[: rng.randint(0, 8)] if mine and rng.random() < 0.8 else []
            mine.append(base + [next(fresh) for _ in range(rng.randint(0 if base else 1, 4))])
            reqs.append(mine[-1])
            stamps.append((k * sessions + s) * 5_000)
            namespaces.append(f"session-{s}")
    return trace_from_lists(reqs, block_size=4, timestamp=stamps, namespace=namespaces)


def test_priority_plan_matches_its_replays_where_it_differs_from_lru():
    # In file order the clock jumps back at each new session, so the retention of later-stamped sessions (kept
    # until timestamp + keep_for), not recency, decides what is evicted: priority is not LRU here.
    tr = sessions_trace(0)
    plan = make_plan(tr, policies=["lru", "priority"], weight="tokens", points=8, keep_for=30.0, bound=False)
    lru = [rate(tr, "lru", c, "tokens") for c in plan.grid]
    kept = [rate(tr, "priority", c, "tokens", keep_for=30.0) for c in plan.grid]
    assert sum(a != b for a, b in zip(lru, kept)) >= 2  # the case really tells the two apart
    assert plan.rates["lru"] == pytest.approx(lru)
    assert plan.rates["priority"] == pytest.approx(kept)


def test_optimal_answer_is_the_smallest_capacity():
    tr = trace_from_lists([[1, 2], [3], [1, 2, 4], [3, 5], [1, 2], [3, 5, 6], [1, 2, 4]], block_size=1)
    plan = make_plan(tr, weight="blocks", points=4)
    nt = canonical_blocks(tr)
    unl = plan.lru.hits(plan.working_set_blocks)
    for a in (a for a in plan.answers if a.curve == "optimal"):
        need = a.fraction * unl
        assert optimal_hits(nt, a.capacity_blocks).hit_blocks >= need
        assert a.capacity_blocks == 1 or optimal_hits(nt, a.capacity_blocks - 1).hit_blocks < need


def test_order_timestamp_interleaves_sessions():
    # two sessions, each resending its history; file order = one after another
    a = [[1], [1, 2], [1, 2, 3]]
    b = [[10], [10, 11], [10, 11, 12]]
    tr = trace_from_lists(a + b, block_size=1, timestamp=[0, 2, 4, 1, 3, 5], namespace=["a"] * 3 + ["b"] * 3)
    by_file = make_plan(tr, weight="blocks", points=3, order="file")
    by_time = make_plan(tr, weight="blocks", points=3, order="timestamp")
    # With 2 blocks, by hand. One session after another: a hits 1 + 2, then b hits 1 + 2 = 6 blocks.
    # Interleaved: [1] [10] [1,2] (hit 1, evicts 10) [10,11] (miss) [1,2,3] (miss) [10,11,12] (miss) = 1.
    assert by_file.lru.hits(2) == 6 == rate_hits(tr, 2)
    assert by_time.lru.hits(2) == 1 == rate_hits(tr.by_timestamp(), 2)


def rate_hits(trace, capacity: int) -> int:
    cache = PrefixCache(CacheConfig(num_blocks=capacity, block_size=trace.block_size))
    hits = 0
    for i in range(len(trace)):
        m = cache.match_keys(trace.hash_ids(i).tolist(), trace.namespace[i])
        hits += m.cached_blocks
        cache.commit_keys(m.handle)
        cache.release(m.handle)
    return hits


# ---- the command ----------------------------------------------------------------------------------------
def test_cli_plan_writes_reports(conv_slice, tmp_path):
    from prefixcache.cli import app

    out = tmp_path / "out"
    res = CliRunner().invoke(
        app,
        [
            "plan",
            str(conv_slice),
            "--policy",
            "lru",
            "--policy",
            "lfu",
            "--model",
            "small",
            "--dtype",
            "bf16",
            "--points",
            "5",
            "--warmup",
            "0.1",
            "--json",
            str(out / "p.json"),
            "--html",
            str(out / "p.html"),
            "--markdown",
            str(out / "p.md"),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "optimal bound" in res.output and "LRU" in res.output
    doc = json.loads((out / "p.json").read_text())
    tr = load_trace(conv_slice)
    assert doc["model"]["bytes_per_token"] == 2 * 12 * 12 * 64 * 2
    for c, r in zip(doc["grid_blocks"], doc["rates"]["lfu"]):
        assert r == pytest.approx(rate(tr, "lfu", c, "tokens", 0.1))
    html = (out / "p.html").read_text()
    assert "data:image/png;base64," in html and "<table>" in html
    assert (out / "p_plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # figures are named STEM_<plot>.png
    assert "(p_plot.png)" in (out / "p.md").read_text()


def test_cli_plan_errors(conv_slice, tmp_path):
    from prefixcache.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["plan", str(conv_slice), "--policy", "mru"])
    assert res.exit_code == 2 and "mru" in res.output
    res = runner.invoke(app, ["plan", str(conv_slice), "--model", "nope"])
    assert res.exit_code == 2 and "neither a preset" in res.output
    res = runner.invoke(app, ["plan", str(tmp_path / "missing.jsonl")])
    assert res.exit_code == 2 and "no such trace file" in res.output
    sc = tmp_path / "text.yaml"
    sc.write_text("requests:\n  - text: hello\n")
    res = runner.invoke(app, ["plan", str(sc)])
    assert res.exit_code == 2 and "hash-id trace" in res.output


def test_cli_plan_says_which_dtype_it_sized_kv_with(conv_slice):
    from prefixcache.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["plan", str(conv_slice), "--model", "small", "--points", "3", "--no-bound"])
    assert res.exit_code == 0, res.output
    # small: 12 layers x 12 KV heads x head dim 64, K and V, fp32: 2 * 12 * 12 * 64 * 4 = 73,728 bytes per token
    assert "float32 (the default here; --dtype to change) = 73,728 bytes per token" in res.stderr
    res = runner.invoke(app, ["plan", str(conv_slice), "--model", "small", "--dtype", "bf16", "--points", "3"])
    assert res.exit_code == 0, res.output
    assert "bf16 (from --dtype) = 36,864 bytes per token" in res.stderr


# ---- hybrid models: snapshots beside the KV blocks ------------------------------------------------------------
def brute_force_sites(trace) -> int:
    """Snapshot sites by their definition: prefixes (namespace, path) where a request ends, or that two different
    longer prefixes continue."""
    ends, children = set(), {}
    for i in range(len(trace)):
        path = tuple(trace.hash_ids(i).tolist())
        ns = trace.namespace[i]
        ends.add((ns, path))
        for k in range(1, len(path)):
            children.setdefault((ns, path[:k]), set()).add(path[k])
    return len(ends | {node for node, kids in children.items() if len(kids) >= 2})


def test_snapshot_sites_by_hand_and_brute_force():
    from prefixcache.sim.plan import snapshot_sites, snapshots_for

    # paths 1-2-4 and 3-5-6: every block but 1 ends a request, none has two children
    tr = trace_from_lists([[1, 2], [3], [1, 2, 4], [3, 5], [1, 2], [3, 5, 6], [1, 2, 4]], block_size=1)
    assert snapshot_sites(canonical_blocks(tr)) == 5
    # a shared prefix 1-2 that two requests leave: 2 is a site although no request ends there; the same ids in
    # another namespace are other blocks
    tr = trace_from_lists([[1, 2, 3], [1, 2, 4], [1, 2, 3]], block_size=1, namespace=["a", "a", "b"])
    assert snapshot_sites(canonical_blocks(tr)) == 3 + 1
    for seed in range(5):
        tr = sessions_trace(seed)
        assert snapshot_sites(canonical_blocks(tr)) == brute_force_sites(tr)
    assert [snapshots_for(c, 10, 100) for c in (1, 10, 11, 100, 1000)] == [1, 1, 2, 10, 10]


def test_hybrid_plan_counts_snapshots_in_its_gb(conv_slice):
    tr = load_trace(conv_slice)
    hybrid, small = PRESETS["small-hybrid"], PRESETS["small"]
    sites = brute_force_sites(tr)
    plan = make_plan(tr, points=5, model=hybrid)
    W, bs = plan.working_set_blocks, plan.block_size
    assert plan.snapshot_sites == sites and plan.fixed_snapshots is None
    for a in plan.answers:
        snaps = min(sites, math.ceil(a.capacity_blocks * sites / W))
        assert a.snapshots == snaps == plan.snapshots(a.capacity_blocks)
        # 6,144 B of KV per token (3 attention layers), 1,990,656 B per snapshot (9 gated delta nets)
        assert a.gb == pytest.approx((a.capacity_blocks * bs * 6_144 + snaps * 1_990_656) / 1e9)
    assert plan.gb(W) == pytest.approx((W * bs * 6_144 + sites * 1_990_656) / 1e9)
    fixed = make_plan(tr, points=5, model=hybrid, snapshots=64)
    assert [a.capacity_blocks for a in fixed.answers] == [a.capacity_blocks for a in plan.answers]  # same rates
    for a in fixed.answers:
        assert a.snapshots == 64 and a.gb == pytest.approx((a.capacity_blocks * bs * 6_144 + 64 * 1_990_656) / 1e9)
    # a pure-attention model: KV only, as before
    plain = make_plan(tr, points=5, model=small)
    assert plain.snapshot_sites is None and plain.snapshots(10) is None
    assert all(
        a.snapshots is None and a.gb == pytest.approx(a.capacity_blocks * bs * 73_728 / 1e9) for a in plain.answers
    )
    with pytest.raises(ValueError, match="needs a hybrid model"):
        make_plan(tr, points=5, model=small, snapshots=8)
    with pytest.raises(ValueError, match="second tier"):
        make_plan(tr, points=5, model=hybrid, pools=[100])


def test_cli_plan_hybrid(conv_slice, tmp_path):
    from prefixcache.cli import app

    runner = CliRunner()
    args = ["plan", str(conv_slice), "--model", "small-hybrid", "--points", "4", "--no-bound"]
    res = runner.invoke(app, [*args, "--json", str(tmp_path / "p.json"), "--html", str(tmp_path / "p.html")])
    assert res.exit_code == 0, res.output
    assert "3 attention layers (of 12) x 4 KV heads x head dim 64, float32" in res.stderr
    assert "= 6,144 bytes per token" in res.stderr and "= 1,990,656 bytes per snapshot" in res.stderr
    assert "snapshots" in res.stdout
    doc = json.loads((tmp_path / "p.json").read_text())
    sites = brute_force_sites(load_trace(conv_slice))
    assert doc["model"]["state_bytes"] == 1_990_656 and doc["snapshots"] == {"sites": sites, "fixed": None}
    assert all(a["snapshots"] >= 1 for a in doc["answers"] if a["blocks"])
    assert "recurrent state" in (tmp_path / "p.html").read_text()
    res = runner.invoke(app, [*args, "--snapshots", "64", "--json", "-"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["snapshots"] == {"sites": sites, "fixed": 64}
    res = runner.invoke(app, ["plan", str(conv_slice), "--model", "small", "--snapshots", "8"])
    assert res.exit_code == 2 and "hybrid" in res.output
    res = runner.invoke(app, [*args, "--pool-capacity", "64k"])
    assert res.exit_code == 2 and "second tier" in res.output
    res = runner.invoke(app, ["plan", str(conv_slice), "--model", "small", "--points", "3", "--json", "-"])
    assert res.exit_code == 0 and "snapshots" not in json.loads(res.stdout)  # pure attention: as before
