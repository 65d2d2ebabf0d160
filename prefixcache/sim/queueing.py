"""Queueing delays of the replicas' prefill queues, in time (the cluster simulation's load model).

Each replica prefills at one fixed rate; a request brings ``work`` seconds of prefill at its arrival. Two
queue disciplines, both work-conserving (a replica is never idle while work is queued, so the work it has
not finished at any moment, which is what the router sees as its load, is the same under both):

* ``fcfs``: one prompt at a time, in arrival order: a long prompt holds up every prompt behind it. This is
  what a scheduler does that hands each step's token budget to the requests in arrival order, so a long
  prompt prefilled in chunks takes the whole budget until it is done (vLLM's default);
* ``shared``: every queued prompt advances at an equal share of the rate (processor sharing): a short prompt
  behind a long one finishes early. An idealised chunked prefill that caps what one prompt may take of a
  step (e.g. vLLM's ``--long-prefill-token-threshold``) and so interleaves the waiting prompts.

A request's queueing delay is the time it spends on the replica beyond its own prefill: finish - arrival -
work (under ``fcfs``, the wait before it starts).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

QUEUE_DISCIPLINES = ("fcfs", "shared")


def queue_delays(arrival: Sequence[float], work: Sequence[float], discipline: str) -> list[float]:
    """The queueing delay of each request of ONE replica, given in arrival order (``arrival`` non-decreasing,
    seconds; ``work`` >= 0, seconds of prefill). Raises ValueError for an unknown discipline."""
    if discipline == "fcfs":
        return _fcfs(arrival, work)
    if discipline == "shared":
        return _shared(arrival, work)
    raise ValueError(f"unknown queue discipline {discipline!r}; known: {', '.join(QUEUE_DISCIPLINES)}")


def replica_delays(
    arrival: Sequence[float], work: Sequence[float], replica: Sequence[int], discipline: str
) -> list[float]:
    """:func:`queue_delays` of a cluster's requests (in arrival order), each queued on its ``replica``."""
    by_replica: dict[int, list[int]] = {}
    for k, r in enumerate(replica):
        by_replica.setdefault(r, []).append(k)
    out = [0.0] * len(replica)
    for ks in by_replica.values():
        for k, d in zip(ks, queue_delays([arrival[k] for k in ks], [work[k] for k in ks], discipline)):
            out[k] = d
    return out


def _fcfs(arrival: Sequence[float], work: Sequence[float]) -> list[float]:
    free_at = 0.0  # when the replica finishes the work queued so far
    out = []
    for a, w in zip(arrival, work):
        start = max(a, free_at)
        out.append(float(start - a))
        free_at = start + w
    return out


def _shared(arrival: Sequence[float], work: Sequence[float]) -> list[float]:
    """Processor sharing through virtual time: with k prompts queued, virtual time runs at 1/k of real time and
    a prompt of work w arriving at virtual time v finishes when virtual time reaches v + w."""
    out = [0.0] * len(arrival)
    queued: list[tuple[float, int]] = []  # (virtual finish, request), soonest first
    t = v = 0.0  # real and virtual time

    def run_until(until: float) -> None:
        nonlocal t, v
        while queued:
            k = len(queued)
            end_v = queued[0][0]
            end_t = t + (end_v - v) * k
            if end_t > until:
                v += (until - t) / k
                break
            t, v = end_t, end_v
            while queued and queued[0][0] <= v:
                _, j = heapq.heappop(queued)
                out[j] = max(0.0, t - arrival[j] - work[j])
        t = max(t, until)

    for i, (a, w) in enumerate(zip(arrival, work)):
        run_until(a)
        if w > 0:
            heapq.heappush(queued, (v + w, i))
    run_until(float("inf"))
    return out
