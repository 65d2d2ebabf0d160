"""Prefill queue disciplines (prefixcache.sim.queueing) against hand-computed queues and brute-force references
written independently: Lindley's recursion unrolled for fcfs; for chunked, an engine that hands out a step's
budget one token at a time, and its two limits (one-token steps are fcfs; one-token chunks are processor
sharing, simulated with every queued prompt's remaining work)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.sim.cluster import LoadModel
from prefixcache.sim.queueing import PrefillQueue, queue_delays, replica_delays

FCFS = PrefillQueue()


def chunked(step, chunk):
    return PrefillQueue("chunked", step, chunk)


def fcfs_reference(arrival, work):
    """Wait of request i: max over j <= i of (a_j + work of j..i-1) - a_i, floored at 0 (work in seconds)."""
    out = []
    for i, a in enumerate(arrival):
        start = max(arrival[j] + sum(work[j:i]) for j in range(i + 1))
        out.append(max(0.0, start - a))
    return out


def token_engine_reference(arrival, tokens, rate, step, cap):
    """A step's budget handed out one token at a time: each token to the first prompt, started ones first (in
    the order they started) then waiting ones (in arrival order), that still needs one and has had fewer than
    ``cap`` this step. A prompt that arrived by the step's start may take part; it is done at its step's end."""
    n = len(arrival)
    left = list(tokens)
    started: list[int] = []
    finish = [0.0] * n
    done = [False] * n
    t = 0.0
    while not all(done):
        present = [j for j in range(n) if not done[j] and arrival[j] <= t]
        if not present:
            t = min(arrival[j] for j in range(n) if not done[j])
            continue
        order = [j for j in started if j in present] + [j for j in present if j not in started]
        got = dict.fromkeys(order, 0)
        used = 0
        for _ in range(step):
            pick = next((j for j in order if left[j] > got[j] and got[j] < cap), None)
            if pick is None:
                break
            got[pick] += 1
            used += 1
        # a waiting prompt takes part (starts) if the step still had room when its turn came, even with nothing
        # to prefill (fully cached); the ones before it took their tokens first
        seated, before = [], 0
        for j in order:
            if j in started or before < step:
                seated.append(j)
            before += got[j]
        started += [j for j in seated if j not in started]
        t += used / rate
        for j in seated:
            left[j] -= got[j]
            if left[j] == 0:
                done[j] = True
                finish[j] = t
    return [max(0.0, finish[i] - arrival[i] - tokens[i] / rate) for i in range(n)]


def sharing_reference(arrival, work):
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
        dt = soonest * k  # real time until the smallest remaining prompt is done
        if nxt < n and arrival[nxt] < t + dt:
            dt = arrival[nxt] - t
        for j in list(remaining):
            remaining[j] -= dt / k
            if remaining[j] <= 1e-9:
                finish[j] = t + dt
                del remaining[j]
        t += dt
    return [max(0.0, finish[i] - arrival[i] - work[i]) for i in range(n)]


def test_by_hand():
    # at 1 token/s: an 8-token prompt at 0, a 2-token prompt at 1. fcfs: the short one waits until 8
    assert queue_delays([0.0, 1.0], [8, 2], 1.0, FCFS) == pytest.approx([0.0, 7.0])
    # chunked, steps of 4, at most 2 a prompt: [0, 2) the long one alone (2 tokens); [2, 6) 2 + the short
    # one's 2: it is done at 6 (3 s late); then 2 tokens a step for the long one: done at 10 (2 s late)
    assert queue_delays([0.0, 1.0], [8, 2], 1.0, chunked(4, 2)) == pytest.approx([2.0, 3.0])
    # no cap: the long one takes each whole step, as under fcfs but for the step boundary
    # ([0, 4), [4, 8): the short one waits for the long one's last step, then [8, 10))
    assert queue_delays([0.0, 1.0], [8, 2], 1.0, chunked(4, None)) == pytest.approx([0.0, 7.0])
    # three at once (6, 2, 4 tokens), steps of 3, 1 each: all three advance a token a step: the 2-token one
    # ends with step 2 (t = 6), the 4-token one with step 4 (t = 10, then 2 tokens a step), the 6 with t = 12
    assert queue_delays([0.0] * 3, [6, 2, 4], 1.0, chunked(3, 1)) == pytest.approx([6.0, 4.0, 6.0])
    # an idle gap: nothing carries over; the rate scales time
    for q in (FCFS, chunked(4, 2)):
        assert queue_delays([0.0, 10.0], [4, 4], 2.0, q) == pytest.approx([0.0, 0.0])
    # a fully cached request (no prefill) arriving at an idle replica does not wait; on a busy one it is seated
    # at the next step with room, and done when that step ends (the long one's steps are [0, 2), [2, 4), ...)
    assert queue_delays([0.0], [0], 1.0, chunked(4, 2)) == [0.0]
    assert queue_delays([0.0, 0.5], [8, 0], 1.0, chunked(4, 2)) == pytest.approx([0.0, 3.5])
    assert queue_delays([], [], 1.0, chunked(4, 2)) == []


def test_bad_queues_are_refused():
    with pytest.raises(ValueError, match="queue must be one of fcfs, chunked, got 'lifo'"):
        PrefillQueue("lifo")
    for field, bad in (("step_tokens", 0), ("step_tokens", 2.5), ("chunk_tokens", 0), ("chunk_tokens", True)):
        with pytest.raises(ValueError, match=f"{field} must be an integer >= 1, got {bad!r}"):
            PrefillQueue("chunked", **{field: bad})
    with pytest.raises(TypeError, match="queue must be a PrefillQueue, got 'fcfs'"):
        LoadModel(100.0, "fcfs")  # type: ignore[arg-type]


def test_labels_and_settings_round_trip():
    assert FCFS.label == "fcfs" and FCFS.settings() == {"prefill_queue": "fcfs"}
    q = chunked(8192, 2048)
    assert q.label == "chunked (2,048 of 8,192 tokens a step)"
    assert chunked(8192, None).label == "chunked (8,192 tokens a step, no cap)"
    for x in (FCFS, q, chunked(512, None)):
        assert PrefillQueue.from_settings(x.settings()) == x
    assert PrefillQueue.from_settings({}) == FCFS
    with pytest.raises(ValueError, match="got 'shared'"):
        PrefillQueue.from_settings({"prefill_queue": "shared"})


jobs = st.lists(
    st.tuples(st.integers(0, 20), st.integers(0, 12)),  # (gap since the previous arrival in ticks, tokens)
    max_size=25,
)
RATES = st.sampled_from([1.0, 4.0, 10.0])


def _arrivals(pairs, rate):
    arrival, t = [], 0
    for gap, _ in pairs:
        t += gap
        arrival.append(t / rate)  # on the token grid: a whole number of tokens' time
    return arrival, [n for _, n in pairs]


@settings(max_examples=300, deadline=None)
@given(jobs, RATES)
def test_fcfs_against_lindley(pairs, rate):
    arrival, tokens = _arrivals(pairs, rate)
    work = [n / rate for n in tokens]
    assert queue_delays(arrival, tokens, rate, FCFS) == pytest.approx(fcfs_reference(arrival, work), abs=1e-9)


@settings(max_examples=300, deadline=None)
@given(jobs, RATES, st.integers(1, 10), st.one_of(st.none(), st.integers(1, 10)))
def test_chunked_against_a_token_by_token_engine(pairs, rate, step, cap):
    arrival, tokens = _arrivals(pairs, rate)
    want = token_engine_reference(arrival, tokens, rate, step, cap or step)
    assert queue_delays(arrival, tokens, rate, chunked(step, cap)) == pytest.approx(want, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(jobs, RATES, st.one_of(st.none(), st.integers(1, 10)))
def test_one_token_steps_are_fcfs(pairs, rate, cap):
    """With a step of one token, the prompt that started first takes every token until it is done (a fully
    cached prompt, which takes none, waits for the end of the step it is seated in: not compared)."""
    arrival, tokens = _arrivals(pairs, rate)
    got = queue_delays(arrival, tokens, rate, chunked(1, cap))
    want = queue_delays(arrival, tokens, rate, FCFS)
    assert [g for g, n in zip(got, tokens) if n] == pytest.approx([w for w, n in zip(want, tokens) if n], abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(jobs, RATES)
def test_one_token_chunks_approach_processor_sharing(pairs, rate):
    """A chunk of one token and a step with room for every queued prompt: each advances a token a step, so all
    share the rate; the step boundaries make a prompt late by at most two steps."""
    arrival, tokens = _arrivals(pairs, rate)
    step = max(1, len(pairs))
    got = queue_delays(arrival, tokens, rate, chunked(step, 1))
    want = sharing_reference(arrival, [n / rate for n in tokens])
    for g, w in zip(got, want):
        assert abs(g - w) <= 2 * step / rate + 1e-9


@settings(max_examples=200, deadline=None)
@given(jobs, st.integers(1, 10), st.one_of(st.none(), st.integers(1, 10)))
def test_both_queues_do_the_same_work_in_the_same_time(pairs, step, cap):
    """Work-conserving: with arrivals on the step grid, the replica's last prompt ends at the same moment under
    both queues, and no prompt ends before it could (delays >= 0)."""
    arrival, tokens = _arrivals([(gap * step, n) for gap, n in pairs], 1.0)
    ends = {}
    for q in (FCFS, chunked(step, cap)):
        d = queue_delays(arrival, tokens, 1.0, q)
        assert all(x >= 0 for x in d)
        ends[q.discipline] = max((a + n + x for a, n, x in zip(arrival, tokens, d) if n > 0), default=0.0)
    assert ends["fcfs"] == pytest.approx(ends["chunked"])


@settings(max_examples=100, deadline=None)
@given(jobs, st.lists(st.integers(0, 2), min_size=25, max_size=25), st.sampled_from([FCFS, chunked(4, 2)]))
def test_replica_delays_queue_each_replica_on_its_own(pairs, replicas, q):
    arrival, tokens = _arrivals(pairs, 1.0)
    replica = replicas[: len(arrival)]
    got = replica_delays(arrival, tokens, replica, 1.0, q)
    for r in set(replica):
        ks = [k for k, x in enumerate(replica) if x == r]
        assert [got[k] for k in ks] == queue_delays([arrival[k] for k in ks], [tokens[k] for k in ks], 1.0, q)
