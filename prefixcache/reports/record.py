"""The run record: what ``simulate`` and ``replay`` measured, as a typed value and as versioned JSON.

JSON layout, version 4 (``report`` renders it; version 1 files, whose rows were a list of objects, version 2
files, without the second tier, and version 3 files, without ``no_state_tokens``, still load)::

    {"version": 4, "command": "simulate"|"replay", "partial": bool, "created": ISO time, "source": path,
     "settings": {...},                                  # what the run was asked to do
     "totals": [ {capacity_tokens, capacity_blocks, pool_blocks, block_size, requests, prompt_tokens,
                  cached_tokens, token_hit_rate, block_hit_rate, ...}, ... ],   # one per capacity
     "runs": [ {"capacity_tokens", "capacity_blocks", "pool_blocks", "block_size", "partial",
                "tier": null | {"capacity_blocks": int | null},   # the second tier below the pool, if any
                "rows": {"index": [...], "namespace": [...], ...}}, ... ],  # rows column by column
     "divergences": [ {position, requests, tokens, example, partner, before, this, other}, ... ]}

A row is one request (``prefixcache.sim.results.Row``); times are seconds, null when not measured;
``capacity_*`` are null for an unlimited capacity. ``totals`` are derived from the rows (they are written
for other readers and recomputed on load). Rows say why their uncached tokens missed (``cold_tokens`` ...
``shared_with``, see ``prefixcache.sim.causes``); ``divergences`` lists the top divergence points of the run
(``prefixcache.sim.diagnosis.DivergenceSite``; they do not depend on the capacity). Files written before
these existed load with null causes and no divergences. Version 3 adds the second tier: a run's ``tier``
(absent or null: none) and the row columns ``tier_tokens``, ``tier_blocks``, ``tier_used_blocks`` (null without
a tier; a row's ``cached_tokens`` and ``hit_blocks`` count pool and tier together, so the tier's part is at most
them). Version 4 adds the miss cause ``no_state_tokens`` (a hybrid model's cached KV that no recurrent-state
snapshot reached); rows of older files load with 0 there (null where they carry no causes).
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from prefixcache.core.errors import InputError, shown
from prefixcache.reports.output import write_output
from prefixcache.sim.diagnosis import DivergenceSite
from prefixcache.sim.policy import Capacity
from prefixcache.sim.results import CAUSE_FIELDS, ROW_FIELDS, Row, RunResult
from prefixcache.workload.files import input_file, read_text

VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
MAX_RECORD_BYTES = 2**33  # 8 GiB: a bound for a pipe that never ends, far above any real record
TOP_SITES = 50  # divergence points a record keeps


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class RunRecord:
    """One command's results: a run per capacity, plus what the command was asked to do."""

    command: str
    source: str
    settings: dict[str, Any]
    runs: tuple[RunResult, ...]
    partial: bool = False
    created: str = field(default_factory=_now)
    divergences: tuple[DivergenceSite, ...] = ()  # the top divergence points, most costly first

    def totals(self) -> list[dict[str, Any]]:
        """Each run's totals (see ``prefixcache.sim.results.totals``)."""
        return [r.totals() for r in self.runs]

    @property
    def block_size(self) -> int | None:
        return self.runs[0].block_size if self.runs else None


def build_record(
    command: str,
    source: str,
    settings: dict[str, Any],
    results: list[RunResult],
    *,
    partial: bool = False,
    divergences: Sequence[DivergenceSite] = (),
) -> RunRecord:
    """The record of one command; ``partial`` also when any run was interrupted."""
    return RunRecord(
        command,
        source,
        settings,
        tuple(results),
        bool(partial or any(r.partial for r in results)),
        divergences=tuple(divergences),
    )


def to_json(record: RunRecord) -> dict[str, Any]:
    """The record as a JSON-ready dict (layout in the module docstring)."""
    runs = []
    for r in record.runs:
        runs.append(
            {
                "capacity_tokens": r.capacity_tokens,
                "capacity_blocks": r.capacity.blocks,
                "pool_blocks": r.pool_blocks,
                "block_size": r.block_size,
                "partial": r.partial,
                "tier": None if r.tier is None else {"capacity_blocks": r.tier.blocks},
                "rows": {name: list(col) for name, col in r.columns.items()},
            }
        )
    return {
        "version": VERSION,
        "command": record.command,
        "partial": record.partial,
        "created": record.created,
        "source": record.source,
        "settings": record.settings,
        "totals": record.totals(),
        "runs": runs,
        "divergences": [asdict(d) for d in record.divergences],
    }


def save_record(record: RunRecord, path: str | Path) -> str:
    """Write the record as compact JSON ("-": standard output; orjson: a Mooncake record is megabytes of row
    columns, 5x faster than the stdlib encoder). Changes the file at ``path``; returns where it went."""
    doc = to_json(record)
    try:
        data: str | bytes = orjson.dumps(doc, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS)
    except TypeError:  # an integer beyond 64 bits (a capacity of 10**18 blocks, in tokens): the stdlib writes any
        data = json.dumps(doc, separators=(",", ":")) + "\n"
    return write_output(path, data)


# ---- reading ---------------------------------------------------------------------------------------------
def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 2**63  # NaN and inf fail too


_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an integer >= 0", _is_count),
    "str": ("a string", lambda v: isinstance(v, str)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "num": ("a finite number", _is_num),
    "seconds": ("a finite number >= 0", lambda v: _is_num(v) and v >= 0),
}
# field -> (kind, may be null)
_ROW_SPEC: dict[str, tuple[str, bool]] = {
    "index": ("int", False),
    "namespace": ("str", False),
    "prompt_tokens": ("int", False),
    "cached_tokens": ("int", False),
    "blocks": ("int", False),
    "hit_blocks": ("int", False),
    "inserted_blocks": ("int", False),
    "evicted_blocks": ("int", False),
    "pool_used_blocks": ("int", False),
    "warmup": ("bool", False),
    "timestamp": ("num", True),
    "output_tokens": ("int", True),
    "ttft_cached_s": ("seconds", True),
    "total_cached_s": ("seconds", True),
    "ttft_uncached_s": ("seconds", True),
    "total_uncached_s": ("seconds", True),
    "outputs_match": ("bool", True),
    "cold_tokens": ("int", True),
    "evicted_tokens": ("int", True),
    "diverged_tokens": ("int", True),
    "partial_block_tokens": ("int", True),
    "namespace_tokens": ("int", True),
    "not_cached_tokens": ("int", True),
    "no_state_tokens": ("int", True),
    "reuse_blocks": ("int", True),
    "shared_tokens": ("int", True),
    "shared_with": ("int", True),
    "tier_tokens": ("int", True),
    "tier_blocks": ("int", True),
    "tier_used_blocks": ("int", True),
}
# (part, whole): a row's part can never exceed its whole
_ROW_BOUNDS = (
    ("cached_tokens", "prompt_tokens"),
    ("hit_blocks", "blocks"),
    ("tier_tokens", "cached_tokens"),
    ("tier_blocks", "hit_blocks"),
)
# totals fields checked against the rows (the rest are derived and recomputed on load)
_TOTALS_CHECKED = ("requests", "prompt_tokens", "cached_tokens")
_ROW_DEFAULTS = Row._field_defaults
assert set(_ROW_SPEC) == set(ROW_FIELDS)
_SITE_SPEC: dict[str, str] = {
    "position": "int",
    "requests": "int",
    "tokens": "int",
    "example": "int",
    "partner": "int",
    "before": "str",
    "this": "str",
    "other": "str",
}
assert set(_SITE_SPEC) == set(DivergenceSite.__dataclass_fields__)


class _Reader:
    """Checks a decoded record field by field; errors name the file and the field path (e.g. runs[0].rows)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, message: str) -> InputError:
        return InputError(f"{where}: {message}", self.path)

    def get(self, d: dict[str, Any], key: str, where: str, kind: str, nullable: bool = False) -> Any:
        if key not in d:
            raise self.fail(where, f"missing field {key!r}")
        v = d[key]
        what, ok = _KINDS[kind]
        if not (ok(v) or (nullable and v is None)):
            raise self.fail(f"{where}.{key}", f"expected {what}{' or null' if nullable else ''}, got {shown(v)}")
        return v

    def rows(self, raw: Any, where: str, version: int) -> tuple[Row, ...]:
        if version == 1:  # a list of row objects
            if not isinstance(raw, list):
                raise self.fail(where, f"expected a list of rows, got {type(raw).__name__}")
            cols: dict[str, list[Any]] = {}
            for i, row in enumerate(raw):
                if not isinstance(row, dict):
                    raise self.fail(f"{where}[{i}]", f"expected an object, got {type(row).__name__}")
                unknown = set(row) - set(ROW_FIELDS)
                if unknown:
                    raise self.fail(f"{where}[{i}]", f"unknown key {sorted(unknown)[0]!r}")
            for name in ROW_FIELDS:
                cols[name] = [r.get(name, _ROW_DEFAULTS.get(name, _MISSING)) for r in raw]
            raw = cols
        if not isinstance(raw, dict):
            raise self.fail(where, f"expected an object of columns, got {type(raw).__name__}")
        unknown = set(raw) - set(ROW_FIELDS)
        if unknown:
            raise self.fail(where, f"unknown column {sorted(unknown)[0]!r}")
        n: int | None = None
        columns: list[list[Any]] = []
        for name in ROW_FIELDS:
            col = raw.get(name)
            if (
                name == "no_state_tokens"
                and version < 4
                and (col is None or (isinstance(col, list) and all(v is None for v in col)))
            ):
                # written before this cause: 0 wherever the row carries causes (the cold column is read already)
                col = [None if c is None else 0 for c in columns[ROW_FIELDS.index("cold_tokens")]]
            if col is None and name in _ROW_DEFAULTS:
                col = [_ROW_DEFAULTS[name]] * (n or 0) if n is not None else None
            if not isinstance(col, list):
                raise self.fail(f"{where}.{name}", "missing or not a list")
            if n is None:
                n = len(col)
            elif len(col) != n:
                raise self.fail(f"{where}.{name}", f"has {len(col)} values, the other columns {n}")
            kind, nullable = _ROW_SPEC[name]
            what, ok = _KINDS[kind]
            for i, v in enumerate(col):
                if not (ok(v) or (nullable and v is None)):
                    got = "missing" if v is _MISSING else shown(v)
                    raise self.fail(
                        f"{where}.{name}[{i}]", f"expected {what}{' or null' if nullable else ''}, got {got}"
                    )
            columns.append(col)
        rows = tuple(Row(*values) for values in zip(*columns))
        for part, whole in _ROW_BOUNDS:
            bad = next((k for k, r in enumerate(rows) if (getattr(r, part) or 0) > getattr(r, whole)), None)
            if bad is not None:
                p, w = getattr(rows[bad], part), getattr(rows[bad], whole)
                raise self.fail(f"{where}.{part}[{bad}]", f"{p} is more than {whole} {w}")
        for k, r in enumerate(rows):  # miss causes: all set and adding up to the uncached tokens, or all null
            causes = [getattr(r, f) for f in CAUSE_FIELDS.values()]
            if all(c is None for c in causes):
                continue
            if any(c is None for c in causes) or sum(causes) != r.prompt_tokens - r.cached_tokens:
                raise self.fail(
                    f"{where}[{k}]", "miss causes must all be set and add up to the uncached tokens, or all be null"
                )
        return rows

    def run(self, raw: Any, where: str, version: int) -> RunResult:
        if not isinstance(raw, dict):
            raise self.fail(where, f"expected an object, got {type(raw).__name__}")
        blocks = self.get(raw, "capacity_blocks", where, "int", nullable=True)
        if blocks is not None and blocks < 1:
            raise self.fail(f"{where}.capacity_blocks", f"must be >= 1, got {blocks}")
        bs = self.get(raw, "block_size", where, "int")
        if bs < 1:
            raise self.fail(f"{where}.block_size", f"must be >= 1, got {bs}")
        pool = self.get(raw, "pool_blocks", where, "int") if "pool_blocks" in raw or blocks is None else blocks
        if pool < 1:
            raise self.fail(f"{where}.pool_blocks", f"must be >= 1, got {pool}")
        partial = self.flag(raw, where)
        tier = self.tier(raw, where)
        rows = self.rows(raw.get("rows"), f"{where}.rows", version)
        given = [k for k, r in enumerate(rows) if r.tier_tokens is not None]
        if tier is None and given:
            raise self.fail(f"{where}.rows.tier_tokens[{given[0]}]", "set, but the run has no tier")
        return RunResult(Capacity(blocks), pool, bs, rows, partial, tier)

    def tier(self, raw: dict[str, Any], where: str) -> Capacity | None:
        """A run's optional second tier: null (or absent) for none, else ``{"capacity_blocks": int | null}``."""
        t = raw.get("tier")
        if t is None:
            return None
        if not isinstance(t, dict):
            raise self.fail(f"{where}.tier", f"expected an object or null, got {shown(t)}")
        blocks = self.get(t, "capacity_blocks", f"{where}.tier", "int", nullable=True)
        if blocks is not None and blocks < 1:
            raise self.fail(f"{where}.tier.capacity_blocks", f"must be >= 1, got {blocks}")
        return Capacity(blocks)

    def flag(self, d: dict[str, Any], where: str) -> bool:
        """The optional ``partial`` flag (default false)."""
        return "partial" in d and bool(self.get(d, "partial", where, "bool"))

    def totals(self, raw: Any, runs: tuple[RunResult, ...]) -> None:
        """Check the written totals: one object per run, agreeing with the rows on the counts."""
        if len(raw) != len(runs):
            raise self.fail("record.totals", f"has {len(raw)} entries, the runs {len(runs)}")
        for k, (t, run) in enumerate(zip(raw, runs)):
            where = f"totals[{k}]"
            if not isinstance(t, dict):
                raise self.fail(where, f"expected an object, got {type(t).__name__}")
            derived = run.totals()
            for key in _TOTALS_CHECKED:
                v = self.get(t, key, where, "int")
                if v != derived[key]:
                    raise self.fail(f"{where}.{key}", f"is {v} but runs[{k}].rows give {derived[key]}")

    def settings(self, raw: Any) -> dict[str, Any]:
        """The settings object; the values a report formats are checked."""
        if not isinstance(raw, dict):
            raise self.fail("record.settings", f"expected an object, got {type(raw).__name__}")
        if "warmup" in raw:
            self.get(raw, "warmup", "record.settings", "seconds")
        return raw

    def record(self, raw: Any) -> RunRecord:
        if not isinstance(raw, dict) or "version" not in raw:
            raise InputError("not a prefixcache run record (no 'version')", self.path)
        if not _is_count(raw["version"]) or raw["version"] not in READABLE_VERSIONS:
            raise InputError(
                f"run record version {shown(raw['version'])} is not supported (this reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))})",
                self.path,
            )
        version = raw["version"]
        command = self.get(raw, "command", "record", "str")
        settings = self.settings(raw.get("settings"))
        for key in ("totals", "runs"):
            if not isinstance(raw.get(key), list):
                raise self.fail(f"record.{key}", f"expected a list, got {type(raw.get(key)).__name__}")
        runs = tuple(self.run(r, f"runs[{k}]", version) for k, r in enumerate(raw["runs"]))
        self.totals(raw["totals"], runs)
        sites = raw.get("divergences", [])
        if not isinstance(sites, list):
            raise self.fail("record.divergences", f"expected a list, got {type(sites).__name__}")
        divergences = tuple(self.site(d, f"divergences[{k}]") for k, d in enumerate(sites))
        source = raw.get("source")
        return RunRecord(
            command,
            "" if source is None else str(source),
            settings,
            runs,
            self.flag(raw, "record"),
            str(raw.get("created", "?")),
            divergences,
        )

    def site(self, raw: Any, where: str) -> DivergenceSite:
        if not isinstance(raw, dict):
            raise self.fail(where, f"expected an object, got {type(raw).__name__}")
        return DivergenceSite(**{key: self.get(raw, key, where, kind) for key, kind in _SITE_SPEC.items()})


_MISSING: Any = object()


def read_json(path: str | Path) -> Any:
    """The decoded JSON of a record file. Raises InputError naming the file (and line, for bad JSON)."""
    path = input_file(path, "run record")
    text = read_text(path, "run record", MAX_RECORD_BYTES)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON ({exc.msg}, column {exc.colno})", path, exc.lineno) from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise InputError(f"not valid JSON ({exc})", path) from None
    except RecursionError:
        raise InputError("not a run record (JSON nested too deeply)", path) from None
    return raw


def record_from_json(raw: Any, path: str | Path) -> RunRecord:
    """Check a decoded run record; raise InputError naming the file and the field that is wrong."""
    return _Reader(Path(path)).record(raw)


def load_record(path: str | Path) -> RunRecord:
    """Read and check a run record. Raises InputError naming the file and the field (or line, for bad JSON)."""
    return record_from_json(read_json(path), path)
