"""Prefix-aware routing on Ray Serve: thin glue around ``prefixcache.sim.routing``.

``IndexHolder`` (run as one named Ray actor per deployment) keeps the ``ClusterIndex``: every model replica
publishes its cache events there after each batch, in order (numbered; a replica resends what was not
acknowledged, the holder skips what it has applied). ``PrefixAwareRouter`` is the deployment's Ray Serve
``RequestRouter``: for each request it asks the holder how many leading blocks of the prompt each replica
holds, counts the requests it has outstanding at each replica (``Outstanding``), and lets the routing policy
choose. Ray's own
``PrefixCacheAffinityRouter`` keeps an approximate text tree of what it *sent*; this index holds what the
replicas *cache*, so an eviction is seen as soon as it happens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from engine.names import cache_namespace
from engine.serve.protocol import GenerateCall
from prefixcache.core.events import BlocksRemoved
from prefixcache.sim.routing import (
    CacheEvent,
    ClusterIndex,
    IndexSyncError,
    LoadGuard,
    RoutingConfig,
    make_policy,
    prompt_keys,
)

logger = logging.getLogger("ray.serve")
INDEX_NAMESPACE = "prefixcache"
INDEX_TIMEOUT_S = 2.0  # a routing decision waits this long for the prefix index, then routes by load


class IndexHolder:
    """The cluster index of one deployment, fed by its replicas' cache events (a Ray actor; calls run one at a
    time). ``fingerprint`` is the model's (``engine.names.cache_namespace`` joins it with the caller's name)."""

    def __init__(self, block_size: int, hash_seed: int = 0) -> None:
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.index: ClusterIndex[str] = ClusterIndex()
        self.fingerprint: str | None = None
        self.applied: dict[str, int] = {}  # replica -> last applied batch number
        self._figures: dict[str, dict[str, Any]] = {}
        self._decisions: deque[dict[str, Any]] = deque(maxlen=10_000)
        self.desyncs = 0

    def publish(
        self,
        replica: str,
        fingerprint: str,
        batches: Sequence[tuple[int, Sequence[CacheEvent]]],
        figures: dict[str, Any],
    ) -> int:
        """Apply ``replica``'s event batches numbered above the last one applied, in order; returns the last
        number applied (the replica drops what is acknowledged)."""
        if self.fingerprint is None:
            self.fingerprint = fingerprint
        elif fingerprint != self.fingerprint:
            raise ValueError(f"replica {replica} serves another model ({fingerprint} != {self.fingerprint})")
        last = self.applied.get(replica, 0)
        for number, events in batches:
            if number <= last:
                continue
            if number != last + 1:  # batches were lost: what this replica holds is no longer known
                self._desync(replica, f"batch {number} after {last}")
            for event in events:
                self._apply(replica, event)
            last = number
        self.applied[replica] = last
        self._figures[replica] = figures
        return last

    def _apply(self, replica: str, event: CacheEvent) -> None:
        try:
            self.index.apply(replica, event)
        except IndexSyncError as exc:
            self._desync(replica, str(exc))
            if isinstance(event, BlocksRemoved):  # never claim a block that is gone
                self.index.discard(replica, event.mode, event.namespace, event.keys)

    def _desync(self, replica: str, why: str) -> None:
        """Drop what the index says of ``replica``; it re-learns from its next stores (under-claiming meanwhile)."""
        logger.warning("prefixcache index: replica %s out of sync (%s); forgetting its blocks", replica, why)
        self.desyncs += 1
        self.index.forget(replica)
        self.index.add_replica(replica)

    def match(self, prompt: Sequence[int], namespace: str) -> tuple[dict[str, int], int]:
        """Leading blocks of ``prompt`` (tenant ``namespace``) each replica holds, as its ``match`` would serve,
        and the number of blocks looked up."""
        if self.fingerprint is None or len(prompt) == 0:
            return {}, 0
        space = cache_namespace(self.fingerprint, namespace)
        keys = prompt_keys(prompt, space, block_size=self.block_size, hash_seed=self.hash_seed)
        return self.index.match(keys, space), len(keys)

    def forget(self, replica: str) -> None:
        """A replica is gone: drop its blocks and figures."""
        self.index.forget(replica)
        self.applied.pop(replica, None)
        self._figures.pop(replica, None)

    def record(self, entry: dict[str, Any]) -> None:
        """Log a routed request (see ``PrefixAwareRouter.on_request_routed``)."""
        self._decisions.append(entry)

    def decisions(self) -> list[dict[str, Any]]:
        """The routing decisions recorded so far (the latest 10,000)."""
        return list(self._decisions)

    def figures(self) -> dict[str, dict[str, Any]]:
        """Each replica's figures as of its last publish, with the blocks the index says it holds."""
        return {r: {**f, "index_blocks": self.index.num_blocks(r)} for r, f in self._figures.items()}


class Outstanding:
    """The load the router balances: requests it sent to each replica and has not yet seen complete. A choice
    counts at once (so that the requests of a burst see each other rather than the same stale queue lengths),
    moves to the replica Ray actually used when routed, and ends when Ray reports the request completed; a
    choice never routed (its caller gave up) lapses after ``lapse_s``. Exact when one router sends everything
    (one ingress, as ``prefixcache serve`` runs it)."""

    def __init__(self, lapse_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.lapse_s = lapse_s
        self.clock = clock
        self._chosen: dict[str, tuple[str, float]] = {}  # request -> (replica, when), not routed yet
        self._routed: dict[str, str] = {}  # request -> replica, not completed yet

    def chose(self, request: str, replica: str) -> None:
        self._chosen[request] = (replica, self.clock())

    def routed(self, request: str, replica: str) -> None:
        self._chosen.pop(request, None)
        self._routed[request] = replica

    def completed(self, request: str) -> None:
        self._chosen.pop(request, None)
        self._routed.pop(request, None)

    def loads(self, replicas: Sequence[str]) -> dict[str, float]:
        """Outstanding requests per replica (0 for each of ``replicas`` with none)."""
        now = self.clock()
        for request in [q for q, (_, t) in self._chosen.items() if now - t > self.lapse_s]:
            del self._chosen[request]
        loads = dict.fromkeys(replicas, 0.0)
        for replica in (*(r for r, _ in self._chosen.values()), *self._routed.values()):
            loads[replica] = loads.get(replica, 0.0) + 1
        return loads


def call_of(pending: PendingRequest | None) -> GenerateCall | None:
    """The ``GenerateCall`` a pending request carries (its first argument), if any."""
    if pending is None or not pending.args:
        return None
    arg = pending.args[0]
    return arg if isinstance(arg, GenerateCall) else None


class PrefixAwareRouter(RequestRouter):
    """Ray Serve request router: the replica the prefixcache routing policy picks, then the others by load.

    ``request_router_kwargs``: ``index_name`` (the ``IndexHolder`` actor), ``policy`` (a name in
    ``prefixcache.sim.routing.ROUTING_POLICIES``), ``abs_threshold`` / ``rel_threshold`` (the load guard) and
    ``min_match`` (see ``RoutingConfig``).
    """

    def initialize_state(  # type: ignore[override]  # Ray passes request_router_kwargs by name
        self,
        index_name: str,
        policy: str = "prefix_balanced",
        abs_threshold: float = 64,
        rel_threshold: float = 1.5,
        min_match: float = 0.3,
    ) -> None:
        import ray

        self._index = ray.get_actor(index_name, namespace=INDEX_NAMESPACE)
        self._policy = make_policy(policy, RoutingConfig(LoadGuard(abs_threshold, rel_threshold), min_match))
        self._decided: dict[str, dict[str, Any]] = {}  # request id -> what the policy saw and chose
        self._index_errors = 0
        self._outstanding = Outstanding()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        call = call_of(pending_request)
        if call is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = sorted(by_id)
        matched: dict[str, int] = {}
        blocks = None
        if self._policy.uses_index:
            try:  # an index that does not answer in time is routed around (by load), never a failed request
                matched, blocks = await asyncio.wait_for(
                    asyncio.shield(self._index.match.remote(call.prompt, call.namespace)), INDEX_TIMEOUT_S
                )
            except Exception as exc:  # Ray's actor errors, a timeout
                self._index_errors += 1
                if self._index_errors in (1, 10, 100, 1000):
                    logger.warning("prefixcache router: the prefix index did not answer (%r); routing by load", exc)
                matched, blocks = {}, None
        # no await from here on: a burst of requests is decided one after the other, each seeing the others
        loads = self._outstanding.loads(order)
        decision = self._policy.choose(order, matched, loads, blocks=blocks)
        assert pending_request is not None
        self._outstanding.chose(pending_request.metadata.internal_request_id, str(decision.replica))
        self._decided[call.request_id] = {
            "request_id": call.request_id,
            "namespace": call.namespace,
            "blocks": blocks,
            "matched": matched,
            "loads": loads,
            "chosen": str(decision.replica),
            "matched_blocks": decision.matched_blocks,
            "reason": decision.reason,
        }
        if len(self._decided) > 10_000:  # requests abandoned before Ray routed them
            del self._decided[next(iter(self._decided))]
        chosen = str(decision.replica)
        rest = sorted((r for r in order if r != chosen), key=lambda r: loads.get(r, 0.0))
        return [[by_id[chosen]], [by_id[r] for r in rest]]  # the others, by load, if the chosen one is full

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        """Log where the request went (the policy's choice, or a fallback when that replica was full), with what
        the policy saw: the request's blocks, each replica's held prefix and load, and its reason."""
        self._outstanding.routed(pending_request.metadata.internal_request_id, replica_id.unique_id)
        call = call_of(pending_request)
        entry = self._decided.pop(call.request_id, None) if call is not None else None
        if entry is not None:
            self._index.record.remote({**entry, "replica": replica_id.unique_id})

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self._outstanding.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.forget.remote(replica_id.unique_id)
