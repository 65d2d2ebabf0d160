"""The run record: what ``simulate`` and ``replay`` measured, as versioned JSON that ``report`` renders.

Layout (``"version": 1``)::

    {"version": 1, "command": "simulate"|"replay", "partial": bool, "created": ISO time, "source": path,
     "settings": {...},                      # what the run was asked to do
     "totals": [ {capacity_tokens, capacity_blocks, block_size, requests, prompt_tokens, cached_tokens,
                  token_hit_rate, block_hit_rate, ...}, ... ],   # one per capacity (a sweep has several)
     "runs": [ {"capacity_tokens", "capacity_blocks", "block_size", "rows": [Row, ...]}, ... ]}

A row is one request (see :class:`Row`); times are seconds, None when not measured.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from prefixcache.core.errors import InputError

VERSION = 1


@dataclass(frozen=True)
class Row:
    """One request's outcome at one capacity."""

    index: int
    namespace: str
    prompt_tokens: int
    cached_tokens: int
    blocks: int  # blocks looked up (hash ids of a trace; ceil(prompt / block_size) for token prompts)
    hit_blocks: int
    inserted_blocks: int
    evicted_blocks: int  # evicted while serving this request
    pool_used_blocks: int  # cached blocks in the pool after this request's commit
    warmup: bool = False  # True: served to warm the cache, left out of the totals
    timestamp: float | None = None
    output_tokens: int | None = None
    ttft_cached_s: float | None = None
    total_cached_s: float | None = None
    ttft_uncached_s: float | None = None
    total_uncached_s: float | None = None
    outputs_match: bool | None = None


ROW_FIELDS = tuple(f.name for f in fields(Row))


@dataclass(frozen=True)
class RunResult:
    """The rows of one replay at one capacity; ``partial`` when it was stopped early."""

    capacity_blocks: int
    block_size: int
    rows: tuple[Row, ...]
    partial: bool = False
    unlimited: bool = False

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    def totals(self) -> dict:
        return totals(self.rows, self.capacity_blocks, self.block_size, self.unlimited)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0  # linear interpolation, like numpy's default
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def totals(rows: Iterable[Row], capacity_blocks: int, block_size: int, unlimited: bool = False) -> dict:
    """Sums and rates over the measured (non-warm-up) rows."""
    rows = [r for r in rows if not r.warmup]
    prompt = sum(r.prompt_tokens for r in rows)
    cached = sum(r.cached_tokens for r in rows)
    blocks = sum(r.blocks for r in rows)
    hit_blocks = sum(r.hit_blocks for r in rows)
    with_hit = sum(1 for r in rows if r.hit_blocks > 0)
    peak = max((r.pool_used_blocks for r in rows), default=0)
    t: dict[str, Any] = {
        "capacity_tokens": None if unlimited else capacity_blocks * block_size,
        "capacity_blocks": None if unlimited else capacity_blocks,
        "pool_blocks": capacity_blocks,
        "block_size": block_size,
        "requests": len(rows),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "blocks": blocks,
        "hit_blocks": hit_blocks,
        "block_hit_rate": hit_blocks / blocks if blocks else 0.0,
        "requests_with_hit": with_hit,
        "hit_request_share": with_hit / len(rows) if rows else 0.0,
        "prefill_tokens_saved": cached,
        "inserted_blocks": sum(r.inserted_blocks for r in rows),
        "evicted_blocks": sum(r.evicted_blocks for r in rows),
        "peak_pool_blocks": peak,
        "peak_pool_occupancy": peak / capacity_blocks if capacity_blocks else 0.0,
    }
    ttft_c = [r.ttft_cached_s for r in rows if r.ttft_cached_s is not None]
    ttft_u = [r.ttft_uncached_s for r in rows if r.ttft_uncached_s is not None]
    if ttft_c or ttft_u:
        for name, vals in (("cached", ttft_c), ("uncached", ttft_u)):
            for q in (50, 90, 99):
                t[f"ttft_{name}_p{q}_s"] = _percentile(vals, q)
        for name, key in (("cached", "total_cached_s"), ("uncached", "total_uncached_s")):
            vals = [getattr(r, key) for r in rows if getattr(r, key) is not None]
            t[f"time_{name}_s"] = sum(vals) if vals else None
        c50, u50 = t["ttft_cached_p50_s"], t["ttft_uncached_p50_s"]
        t["ttft_speedup_p50"] = u50 / c50 if c50 and u50 else None
        checked = [r.outputs_match for r in rows if r.outputs_match is not None]
        t["outputs_checked"] = len(checked)
        t["outputs_mismatched"] = sum(1 for ok in checked if not ok)
    return t


def build_record(command: str, source: str, settings: dict, results: list[RunResult], *, partial: bool = False) -> dict:
    """The JSON-ready run record of one command."""
    return {
        "version": VERSION,
        "command": command,
        "partial": bool(partial or any(r.partial for r in results)),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "settings": settings,
        "totals": [r.totals() for r in results],
        "runs": [
            {
                "capacity_tokens": None if r.unlimited else r.capacity_tokens,
                "capacity_blocks": None if r.unlimited else r.capacity_blocks,
                "pool_blocks": r.capacity_blocks,
                "block_size": r.block_size,
                "partial": r.partial,
                "rows": [asdict(row) for row in r.rows],
            }
            for r in results
        ],
    }


def save_record(record: dict, path: str | Path) -> None:
    """Write the record as JSON (creates parent folders). Changes the file at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    big = sum(len(r.get("rows", ())) for r in record.get("runs", ())) > 5_000
    text = json.dumps(record, separators=(",", ":")) if big else json.dumps(record, indent=1)  # big: compact
    tmp.write_text(text + "\n", encoding="utf-8")
    tmp.replace(path)


def load_record(path: str | Path) -> dict:
    """Read and check a run record. Raises InputError naming the file (and line for bad JSON)."""
    path = Path(path)
    if not path.is_file():
        raise InputError("no such run record", path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON ({exc.msg}, column {exc.colno})", path, exc.lineno) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read: {exc}", path) from None
    if not isinstance(record, dict) or "version" not in record:
        raise InputError("not a prefixcache run record (no 'version')", path)
    if record["version"] != VERSION:
        raise InputError(f"run record version {record['version']!r} is not supported (this is version {VERSION})", path)
    for key in ("command", "settings", "totals", "runs"):
        if key not in record:
            raise InputError(f"run record lacks {key!r}", path)
    for run in record["runs"]:
        for i, row in enumerate(run.get("rows", [])):
            unknown = set(row) - set(ROW_FIELDS)
            if unknown:
                raise InputError(f"row {i} has unknown key {sorted(unknown)[0]!r}", path)
    return record


def rows_of(run: dict) -> list[Row]:
    """A saved run's rows as Row values."""
    return [Row(**row) for row in run["rows"]]
