"""The report of a cluster simulation: routers side by side, against one global cache of the same total size.

A cluster record (JSON, ``"command": "simulate-cluster"``) holds the settings, the global bound's totals and
each router's summary (``prefixcache.sim.cluster.ClusterResult.summary``); this module writes and reads it
and renders it with the shared document toolkit.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.core.errors import InputError
from prefixcache.reports import format as fmt
from prefixcache.reports.document import Document, Figure, Section, Table
from prefixcache.reports.output import write_output
from prefixcache.reports.plots import new_figure, png
from prefixcache.sim.queueing import PrefillQueue

COMMAND = "simulate-cluster"
VERSION = 1


def build(
    source: str, settings: dict[str, Any], bound: dict[str, Any], summaries: list[dict[str, Any]]
) -> dict[str, Any]:
    """A cluster record (JSON-ready)."""
    return {
        "version": VERSION,
        "command": COMMAND,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "settings": settings,
        "global_bound": bound,
        "routers": summaries,
    }


def is_cluster_record(raw: Any) -> bool:
    return isinstance(raw, dict) and raw.get("command") == COMMAND


def save(record: dict[str, Any], path: str | Path) -> str:
    """Write the record as JSON ("-": stdout). Returns where it went."""
    return write_output(path, json.dumps(record, indent=1) + "\n")


def check(record: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """Check a decoded cluster record's structure; raise InputError naming the field that is wrong."""
    if record.get("version") != VERSION:
        raise InputError(f"cluster record version {record.get('version')!r} is not supported", path)
    if not isinstance(record.get("global_bound"), dict):
        raise InputError("global_bound: expected an object", path)
    routers = record.get("routers")
    if not isinstance(routers, list) or not all(isinstance(r, dict) for r in routers):
        raise InputError("routers: expected a list of objects", path)
    for k, r in enumerate(routers):
        for key in ("router", "token_hit_rate", "requests_per_replica", "busy_s_per_replica"):
            if key not in r:
                raise InputError(f"routers[{k}]: missing field {key!r}", path)
    return record


def gap_recovered(rate: float, baseline: float | None, bound: float) -> float | None:
    """The share of the gap between ``baseline`` (round robin) and the global bound that ``rate`` closes."""
    if baseline is None or bound <= baseline:
        return None
    return (rate - baseline) / (bound - baseline)


def comparison(record: dict[str, Any]) -> Table:
    """One row per router, then the global bound (block hit rates and prefill max/min: in the JSON)."""
    rs = record["routers"]
    bound = record["global_bound"]["token_hit_rate"]
    rr = next((r["token_hit_rate"] for r in rs if r["router"] == "round_robin"), None)
    s = record["settings"]
    tiered = bool(s.get("shared_tier"))

    def split(t: dict[str, Any]) -> list[str]:  # the pool's and the shared tier's parts of the hit rate
        return [fmt.pct(t.get("pool_token_hit_rate")), fmt.pct(t.get("tier_token_hit_rate"))] if tiered else []

    rows = [
        [
            r["router"],
            fmt.pct(r["token_hit_rate"]),
            *split(r),
            fmt.pct(gap_recovered(r["token_hit_rate"], rr, bound), 1),
            _x(r["requests_max_min"]),
            _x(r["busy_max_min"]),
            fmt.seconds(r["queue_delay_p50_s"]),
            fmt.seconds(r["queue_delay_p99_s"]),
        ]
        for r in rs
    ]
    rows.append([f"one cache of {s['replicas']}x", fmt.pct(bound), *split(record["global_bound"]), "", "", "", "", ""])
    title = (
        f"{s['replicas']} replicas x {fmt.integer(s['capacity_blocks_per_replica'])} blocks"
        + (f" + a shared tier of {s['shared_tier']}" if tiered else "")
        + f", prefill {fmt.integer(int(s['prefill_rate']))} tokens/s per replica, {_queue_label(s)} queue"
    )
    header = ["router", "hit rate", *(["pool hit", "tier hit"] if tiered else [])]
    header += ["gap closed", "req max/min", "busy max/min", "p50 queue", "p99 queue"]
    return Table(header, rows, title)


def _queue_label(settings: dict[str, Any]) -> str:
    """The replicas' queue in words (a record from an older version may name a queue this one lacks)."""
    try:
        return PrefillQueue.from_settings(settings).label
    except (ValueError, KeyError):
        return str(settings.get("prefill_queue"))


def decisions(record: dict[str, Any]) -> Table:
    """Why each router sent its requests where it did (see ``prefixcache.sim.routing.Decision``)."""
    rows = [[r["router"], ", ".join(f"{k} {v:,}" for k, v in sorted(r["reasons"].items()))] for r in record["routers"]]
    return Table(["router", "requests routed by"], rows, "Routing decisions", align="ll")


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def per_replica(record: dict[str, Any]) -> Table:
    """Requests, prefill tokens and busy seconds of every replica, per router."""
    header = ["router", "replica", "requests", "prefill tokens", "busy s"]
    rows = []
    for r in record["routers"]:
        for k, (n, p, b) in enumerate(
            zip(r["requests_per_replica"], r["prefill_tokens_per_replica"], r["busy_s_per_replica"])
        ):
            rows.append([r["router"], str(k), fmt.integer(n), fmt.integer(p), f"{b:,.1f}"])
    return Table(header, rows, "Per replica")


def plot_busy(record: dict[str, Any]) -> bytes:
    """Busy seconds per replica, grouped by router."""
    fig, ax = new_figure()
    rs = record["routers"]
    n = record["settings"]["replicas"]
    width = 0.8 / max(1, len(rs))
    for k, r in enumerate(rs):
        ax.bar(np.arange(n) + k * width, r["busy_s_per_replica"], width, label=r["router"])
    ax.set_xticks(np.arange(n) + width * (len(rs) - 1) / 2, [str(i) for i in range(n)])
    ax.set_xlabel("replica")
    ax.set_ylabel("busy seconds (prefill)")
    ax.set_title("Prefill work per replica")
    ax.legend(fontsize=8)
    return png(fig)


def document(record: dict[str, Any]) -> Document:
    """The cluster report as a Document."""
    s = record["settings"]
    doc = Document(
        f"prefixcache simulate --replicas {s['replicas']}: {Path(str(record.get('source', ''))).name}",
        footer=f"Cluster record created {record.get('created', '?')}.",
    )
    doc.sections.append(Section("", [comparison(record), decisions(record), LOAD_NOTE]))
    doc.sections.append(
        Section(
            "Prefill work per replica",
            [Figure("busy", "busy time per replica", plot_busy(record)), per_replica(record)],
        )
    )
    doc.sections.append(Section("Settings", [Table(["setting", "value"], fmt.setting_rows(s))]))
    return doc


LOAD_NOTE = (
    "Load model: each replica prefills at a fixed rate; a request brings uncached prompt tokens / rate seconds "
    "of prefill, and its queueing delay is its time on the replica beyond that. An fcfs queue prefills one "
    "prompt at a time in arrival order; a chunked queue prefills in engine steps of a fixed token budget, each "
    "prompt given at most a chunk of a step (vLLM's scheduler with --long-prefill-token-threshold), so short "
    "prompts pass long ones. Prefix-affine routing sends a conversation's next turn to the replica holding "
    "its history: under fcfs it waits there behind any long cold prompt; a cap (chunked) lets it pass. "
    "Decoding is not modelled. The last row is one cache of the "
    "cluster's total size fed every request: the bound any routing over separate caches can reach. With a shared "
    "tier, every replica (and that one cache) sits above the same second tier; what it serves is not prefilled."
)
