"""Prefill queue disciplines (prefixcache.sim.queueing) against hand-computed queues and brute-force references
written independently: Lindley's recursion unrolled for fcfs, and for shared a step-by-step simulation that
keeps every queued prompt's remaining work (no virtual time)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.sim.cluster import LoadModel
from prefixcache.sim.queueing import QUEUE_DISCIPLINES, queue_delays, replica_delays


def fcfs_reference(arrival, work):
    """Wait of request i: max over j <= i of (a_j + work of j..i-1) - a_i, floored at 0."""
    out = []
    for i, a in enumerate(arrival):
        start = max(arrival[j] + sum(work[j:i]) for j in range(i + 1))
        out.append(max(0.0, start - a))
    return out


def shared_reference(arrival, work):
    """Processor sharing by brute force: between events, every queued prompt loses the same remaining work."""
    remaining: dict[int, float] = {}
    finish: dict[int, float] = {}
    t = 0.0
    nxt = 0
    n = len(arrival)
    while nxt < n or remaining:
        if not remaining:
            t = max(t, arrival[nxt])
        while nxt < n and arrival[nxt] <= t:
            if work[nxt] > 0:
                remaining[nxt] = work[nxt]
            else:
                finish[nxt] = arrival[nxt]
            nxt += 1
        if not remaining:
            continue
        k = len(remaining)
        soonest = min(remaining.values())
        step = soonest * k  # real time until the smallest remaining prompt is done
        if nxt < n and arrival[nxt] < t + step:
            step = arrival[nxt] - t
        for j in list(remaining):
            remaining[j] -= step / k
            if remaining[j] <= 1e-9:
                finish[j] = t + step
                del remaining[j]
        t += step
    return [max(0.0, finish[i] - arrival[i] - work[i]) for i in range(n)]


def test_by_hand():
    # a 4 s prompt at 0, a 1 s prompt at 1. fcfs: the short one waits 3 s. shared: alone until 1, then both at
    # half rate: the short one is done at 3 (1 s late), the long one at 5 (1 s late)
    assert queue_delays([0.0, 1.0], [4.0, 1.0], "fcfs") == pytest.approx([0.0, 3.0])
    assert queue_delays([0.0, 1.0], [4.0, 1.0], "shared") == pytest.approx([1.0, 1.0])
    # three at once (3, 1, 2 s): the 1 s one ends at 3, the 2 s one at 5, the 3 s one at 6
    assert queue_delays([0.0] * 3, [3.0, 1.0, 2.0], "shared") == pytest.approx([3.0, 2.0, 3.0])
    # an idle gap: nothing carries over
    for q in QUEUE_DISCIPLINES:
        assert queue_delays([0.0, 10.0], [2.0, 2.0], q) == pytest.approx([0.0, 0.0])
    # a fully cached request (no prefill) never waits
    assert queue_delays([0.0, 0.5], [2.0, 0.0], "shared") == [0.0, 0.0]
    assert queue_delays([], [], "shared") == []


def test_unknown_discipline_is_refused():
    with pytest.raises(ValueError, match="unknown queue discipline 'lifo'; known: fcfs, shared"):
        queue_delays([0.0], [1.0], "lifo")
    with pytest.raises(ValueError, match="queue must be one of fcfs, shared, got 'lifo'"):
        LoadModel(100.0, "lifo")


jobs = st.lists(
    st.tuples(st.integers(0, 20), st.integers(0, 12)),  # (gap since the previous arrival, work), in ticks
    max_size=25,
)


def _inputs(pairs, scale):
    arrival, t = [], 0.0
    for gap, _ in pairs:
        t += gap * scale
        arrival.append(t)
    return arrival, [w * scale for _, w in pairs]


@settings(max_examples=300, deadline=None)
@given(jobs, st.sampled_from([1.0, 0.25, 0.1]))
def test_against_brute_force(pairs, scale):
    arrival, work = _inputs(pairs, scale)
    assert queue_delays(arrival, work, "fcfs") == pytest.approx(fcfs_reference(arrival, work), abs=1e-9)
    assert queue_delays(arrival, work, "shared") == pytest.approx(shared_reference(arrival, work), abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(jobs)
def test_both_queues_do_the_same_work_in_the_same_time(pairs):
    """Work-conserving: the replica's last prompt ends at the same moment under both queues, and no prompt ends
    before it could (delays >= 0)."""
    arrival, work = _inputs(pairs, 1.0)
    ends = {}
    for q in QUEUE_DISCIPLINES:
        d = queue_delays(arrival, work, q)
        assert all(x >= 0 for x in d)
        ends[q] = max((a + w + x for a, w, x in zip(arrival, work, d) if w > 0), default=0.0)
    assert ends["fcfs"] == pytest.approx(ends["shared"])


@settings(max_examples=100, deadline=None)
@given(jobs, st.lists(st.integers(0, 2), min_size=25, max_size=25), st.sampled_from(QUEUE_DISCIPLINES))
def test_replica_delays_queue_each_replica_on_its_own(pairs, replicas, q):
    arrival, work = _inputs(pairs, 1.0)
    replica = replicas[: len(arrival)]
    got = replica_delays(arrival, work, replica, q)
    for r in set(replica):
        ks = [k for k, x in enumerate(replica) if x == r]
        assert [got[k] for k in ks] == queue_delays([arrival[k] for k in ks], [work[k] for k in ks], q)
