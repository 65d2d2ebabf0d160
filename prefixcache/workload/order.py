"""Request order of a workload: as written ("file") or stably sorted by timestamp ("timestamp")."""

from __future__ import annotations

from dataclasses import replace
from typing import overload

from prefixcache.workload.scenario import Scenario
from prefixcache.workload.trace import Trace

ORDERS = ("file", "timestamp")


@overload
def ordered(workload: Trace, order: str = "file") -> Trace: ...
@overload
def ordered(workload: Scenario, order: str = "file") -> Scenario: ...
def ordered(workload: Trace | Scenario, order: str = "file") -> Trace | Scenario:
    """``workload`` (a Trace or a Scenario) in ``order``; requests without a timestamp sort last. Changes nothing.

    Raises ValueError for an unknown order."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if order == "file":
        return workload
    if isinstance(workload, Trace):
        return workload.by_timestamp()
    if workload.trace is not None:
        return replace(workload, trace=workload.trace.by_timestamp())
    reqs = workload.requests
    index = sorted(range(len(reqs)), key=lambda i: (reqs[i].timestamp is None, reqs[i].timestamp or 0.0))
    return replace(workload, requests=tuple(reqs[i] for i in index))
