"""The run-level diagnosis (prefixcache.sim.diagnosis) on rows built by hand: the divergence points ranked by the
prefill they cost, the fixes ordered by tokens with cold last, warm-up rows left out of every total, and the
capacity advice at its exact 90% boundary. Every expected value is computed here from the rows."""

from __future__ import annotations

from prefixcache.sim.causes import Fork
from prefixcache.sim.diagnosis import cause_totals, divergence_sites, fixes, main_fix, reuse_capacity
from prefixcache.sim.policy import Capacity
from prefixcache.sim.results import Row, RunResult

BS = 4


def row(i: int, *, warmup: bool = False, prompt: int = 40, **causes: int) -> Row:
    """A row of ``prompt`` tokens whose uncached tokens are ``causes`` (the rest cached)."""
    fields = {f"{c}_tokens": causes.get(c, 0) for c in ("cold", "evicted", "diverged", "partial_block", "namespace")}
    fields["not_cached_tokens"] = causes.get("not_cached", 0)
    fields["no_state_tokens"] = causes.get("no_state", 0)
    uncached = sum(fields.values())
    return Row(
        i,
        "default",
        prompt,
        prompt - uncached,
        prompt // BS,
        (prompt - uncached) // BS,
        0,
        0,
        0,
        warmup=warmup,
        reuse_blocks=causes.get("reuse"),
        shared_tokens=0,
        **fields,
    )


def fork(position: int, partner: int, place: tuple[int, ...]) -> Fork:
    return Fork(position, partner, (1, 2), (3,), (4,), place)


def test_divergence_points_most_costly_first_warmup_left_out():
    # place X: rows 1 and 2 (8 + 8 = 16 diverged tokens, first difference at 9); place Y: row 3 (20 tokens, at
    # 30); place Z: row 4 and warm-up row 0 (4 measured tokens, at 5; row 0's 100 tokens do not count)
    rows = [
        row(0, warmup=True, prompt=120, diverged=100),
        row(1, diverged=8),
        row(2, diverged=8),
        row(3, diverged=20),
        row(4, diverged=4),
        row(5, cold=12),  # no fork: not a divergence point
    ]
    forks = {
        0: fork(5, 9, (0, 7)),
        1: fork(11, 0, (2, 7, 7)),
        2: fork(9, 1, (2, 7, 7)),
        3: fork(30, 1, (5,)),
        4: fork(6, 2, (0, 7)),
    }
    sites = divergence_sites(rows, forks)
    assert [(s.tokens, s.requests, s.position, s.example, s.partner) for s in sites] == [
        (20, 1, 30, 3, 1),
        (16, 2, 9, 2, 1),  # the group's first position, and the request that differs there
        (4, 1, 6, 4, 2),
    ]
    assert [s.tokens for s in divergence_sites(rows, forks, top=2)] == [20, 16]
    # a tie in tokens: the earlier position first
    tie = divergence_sites([row(1, diverged=8), row(2, diverged=8)], {1: fork(20, 0, (1,)), 2: fork(3, 0, (2,))})
    assert [s.position for s in tie] == [3, 20]


def test_fixes_by_tokens_with_cold_last_and_warmup_left_out():
    rows = (
        row(0, warmup=True, evicted=30, reuse=50),  # warm-up: counted nowhere
        row(1, cold=25, partial_block=3),
        row(2, cold=20, namespace=6, evicted=2, reuse=7),
        row(3, evicted=4, reuse=9, partial_block=1),
    )
    run = RunResult(Capacity(10), 10, BS, rows)
    assert cause_totals(rows) == {
        "cold": 45,
        "evicted": 6,
        "diverged": 0,
        "partial_block": 4,
        "namespace": 6,
        "not_cached": 0,
        "no_state": 0,
    }
    found = fixes(run)
    # most tokens first among the avoidable ones (evicted and namespace tie at 6: either order), cold last
    # although it has the most
    assert [f.tokens for f in found] == [6, 6, 4, 45]
    assert {f.cause for f in found[:2]} == {"evicted", "namespace"}
    assert [f.cause for f in found[2:]] == ["partial_block", "cold"]
    assert main_fix(found) is found[0] and main_fix(found).cause != "cold"
    assert main_fix([f for f in found if f.cause == "cold"]) is None
    # the capacity advice: rows 2 and 3 hold the evicted tokens (2 at 7 blocks, 4 at 9); 90% of 6 is 5.4: only
    # 9 blocks reach it
    evicted = next(f for f in found if f.cause == "evicted")
    assert "36 tokens (9 blocks)" in evicted.advice


def test_reuse_capacity_at_the_exact_boundary():
    # evicted tokens 9 at 10 blocks and 1 at 20: 9 of 10 is exactly 90%, so 10 blocks suffice
    rows = [row(1, evicted=9, reuse=10), row(2, evicted=1, reuse=20)]
    assert reuse_capacity(rows) == 10
    # just below 90% (8 of 10 at 10 blocks), the next capacity is needed
    assert reuse_capacity([row(1, evicted=8, reuse=10), row(2, evicted=2, reuse=20)]) == 20
    assert reuse_capacity(rows, share=1.0) == 20
    assert reuse_capacity([row(1, evicted=9, reuse=10, warmup=True), row(2, evicted=1, reuse=20)]) == 20
    assert reuse_capacity([row(1, cold=5)]) is None
