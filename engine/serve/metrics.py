"""Prometheus metrics of the server (prometheus-client), in a registry of their own.

Request-level series are counted where requests enter (the app): requests by endpoint and status, prompt /
cached / completion tokens as served, and a time-to-first-token histogram. Cache- and engine-level series come
from a snapshot per replica (one process: replica "local"), read at scrape time: hit rate, evictions, pool
occupancy, waiting and running requests, steps and their tokens, preemptions (or, for the batched-generate
fallback, batches formed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

Snapshot = Mapping[str, Mapping[str, Any]]  # replica -> its figures (keys below)

# name, kind, help, the snapshot key it reads
_REPLICA_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("prefixcache_cache_token_hit_rate", "gauge", "Prompt tokens served from cache / prompt tokens", "token_hit_rate"),
    ("prefixcache_cache_prompt_tokens", "counter", "Prompt tokens looked up in the cache", "prompt_tokens"),
    ("prefixcache_cache_cached_tokens", "counter", "Prompt tokens served from the cache", "cached_tokens"),
    ("prefixcache_cache_lookups", "counter", "Cache lookups (one per request)", "lookups"),
    ("prefixcache_cache_evicted_blocks", "counter", "Blocks evicted from the KV pool", "blocks_evicted"),
    ("prefixcache_cache_blocks_used", "gauge", "KV pool blocks holding cached prefixes", "blocks_used"),
    ("prefixcache_cache_blocks_capacity", "gauge", "KV pool size in blocks", "blocks_capacity"),
    ("prefixcache_cache_pool_occupancy", "gauge", "Fraction of the KV pool in use", "pool_occupancy"),
    ("prefixcache_queue_length", "gauge", "Requests waiting (for a step, or a batch)", "queue_length"),
    ("prefixcache_running_requests", "gauge", "Requests running now", "running"),
    # the engine
    ("prefixcache_engine_steps", "counter", "Engine steps run", "steps"),
    ("prefixcache_engine_step_tokens", "counter", "Tokens computed in engine steps", "step_tokens"),
    ("prefixcache_engine_step_requests", "counter", "Requests in engine steps (per step: the batch)", "step_requests"),
    (
        "prefixcache_engine_prefill_tokens",
        "counter",
        "Prompt tokens computed (not served from cache)",
        "prefill_tokens",
    ),
    ("prefixcache_engine_decode_tokens", "counter", "Decode tokens computed", "decode_tokens"),
    ("prefixcache_engine_preemptions", "counter", "Requests preempted when the pool ran short", "preemptions"),
    ("prefixcache_engine_largest_step_tokens", "gauge", "Most tokens computed in one step", "largest_step"),
    ("prefixcache_engine_most_step_requests", "gauge", "Most requests in one step", "most_requests"),
    ("prefixcache_engine_busy_seconds", "counter", "Time in engine steps", "busy_s"),
    ("prefixcache_engine_schedule_seconds", "counter", "Of which: scheduling", "schedule_s"),
    ("prefixcache_engine_forward_seconds", "counter", "Of which: the model's forward", "forward_s"),
    ("prefixcache_engine_attention_seconds", "counter", "Of the forward: attention over the pool", "attention_s"),
    ("prefixcache_engine_linears_seconds", "counter", "Of the forward: the packed linear layers", "linears_s"),
    ("prefixcache_engine_decode_path_seconds", "counter", "Of attention: the C kernel's decode path", "decode_path_s"),
    (
        "prefixcache_engine_decode_path_bytes",
        "counter",
        "Cached K/V bytes the decode path's queries read (each query's keys once)",
        "decode_path_bytes",
    ),
    (
        "prefixcache_engine_prefill_path_seconds",
        "counter",
        "Of attention: the C kernel's prefill path",
        "prefill_path_s",
    ),
    ("prefixcache_engine_prefill_path_flops", "counter", "FLOPs the prefill path computed", "prefill_path_flops"),
    ("prefixcache_engine_finish_seconds", "counter", "Of which: sampling, streaming, caching blocks", "finish_s"),
    (
        "prefixcache_engine_between_steps_seconds",
        "counter",
        "Engine thread between steps: cache figures, handing out tokens",
        "between_steps_s",
    ),
    ("prefixcache_engine_idle_seconds", "counter", "Engine thread waiting for work", "idle_s"),
    # the second tier (disk or shared), when there is one
    ("prefixcache_tier_hit_blocks", "counter", "Blocks served by the second tier", "tier_hit_blocks"),
    ("prefixcache_tier_cached_tokens", "counter", "Prompt tokens served by the second tier", "tier_cached_tokens"),
    ("prefixcache_tier_loaded_blocks", "counter", "Blocks read from the tier into the pool", "tier_loaded_blocks"),
    ("prefixcache_tier_written_blocks", "counter", "Blocks written to the tier", "tier_written_blocks"),
    ("prefixcache_tier_write_skipped", "counter", "Tier writes skipped (queue full, store down)", "tier_write_skipped"),
    ("prefixcache_tier_write_errors", "counter", "Tier writes that failed (e.g. a full disk)", "tier_write_errors"),
    ("prefixcache_tier_read_errors", "counter", "Tier lookups or reads that failed", "tier_read_errors"),
    (
        "prefixcache_tier_corrupt_blocks",
        "counter",
        "Tier entries refused (torn, corrupt, foreign)",
        "tier_corrupt_blocks",
    ),
    ("prefixcache_tier_evicted_blocks", "counter", "Blocks evicted from the tier for room", "tier_evicted_blocks"),
    ("prefixcache_tier_blocks", "gauge", "Blocks the local tier holds", "tier_blocks"),
    ("prefixcache_tier_queued_bytes", "gauge", "K/V bytes waiting for the tier's writer", "tier_queued_bytes"),
    # the batched-generate fallback
    ("prefixcache_batches", "counter", "Batched generate calls run", "batches"),
    ("prefixcache_batch_rows", "counter", "Requests run in those batches", "batch_rows"),
    ("prefixcache_max_batch_size", "gauge", "Largest batch formed so far", "max_batch_size"),
)


class _ReplicaCollector(Collector):
    """Yields the per-replica series from ``snapshot()`` at each scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        for name, kind, doc, key in _REPLICA_SERIES:
            family: GaugeMetricFamily | CounterMetricFamily
            if kind == "gauge":
                family = GaugeMetricFamily(name, doc, labels=["replica"])
            else:
                family = CounterMetricFamily(name, doc, labels=["replica"])
            for replica, figures in sorted(snap.items()):
                if key in figures:
                    family.add_metric([replica], float(figures[key]))
            yield family


class ServeMetrics:
    """The server's metrics. ``snapshot()`` returns each replica's figures (see ``replica_figures``)."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("prefixcache_requests", "Requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("prefixcache_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.cached_tokens = Counter(
            "prefixcache_cached_tokens", "Prompt tokens of answered requests served from cache", registry=r
        )
        self.completion_tokens = Counter("prefixcache_completion_tokens", "Tokens generated", registry=r)
        self.rejected = Counter(
            "prefixcache_requests_rejected",
            "Requests refused at admission: queue_full (429), draining (503); 400s are in prefixcache_requests",
            ["reason"],
            registry=r,
        )
        self.aborted = Counter(
            "prefixcache_requests_aborted", "Requests whose client went away before the reply was complete", registry=r
        )
        self.in_flight = Gauge("prefixcache_requests_in_flight", "Requests admitted and not yet answered", registry=r)
        self.ttft = Histogram(
            "prefixcache_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
        r.register(_ReplicaCollector(snapshot))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def replica_figures(cache_stats: Mapping[str, Any], batcher_stats: Mapping[str, Any]) -> dict[str, Any]:
    """One replica's snapshot from ``ModelRuntime.cache_stats()`` and its worker's ``stats()``."""
    cap = cache_stats.get("blocks_capacity") or 0
    figures = {
        k: cache_stats[k] for k in ("token_hit_rate", "prompt_tokens", "cached_tokens", "lookups") if k in cache_stats
    }
    figures.update(
        blocks_evicted=cache_stats.get("blocks_evicted", 0),
        blocks_used=cache_stats.get("blocks_used", 0),
        blocks_capacity=cap,
        pool_occupancy=(cache_stats.get("blocks_used", 0) / cap) if cap else 0.0,
    )
    figures.update({k: v for k, v in cache_stats.items() if k.startswith("tier_") and isinstance(v, (int, float))})
    figures.update(batcher_stats)
    return figures
