"""The "Why prefill was not saved" part of a run report, and of ``prefixcache explain``: uncached tokens by cause
per capacity (a table and a stacked bar), the top divergence points, and the fix each cause suggests
(``prefixcache.sim.causes`` defines the causes, ``prefixcache.sim.diagnosis`` ranks and advises). Changes nothing.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prefixcache.reports import format as fmt
from prefixcache.reports.document import Figure, Section, Table
from prefixcache.reports.plots import new_figure, png
from prefixcache.reports.record import RunRecord
from prefixcache.sim.causes import CAUSES
from prefixcache.sim.diagnosis import (
    DivergenceSite,
    Fix,
    cause_totals,
    fixes,
    main_fix,
    measured,
    reuse_capacity,
    sides,
)
from prefixcache.sim.results import CAUSE_FIELDS, Row

TITLE = "Why prefill was not saved"
COLORS = {  # one colour per cause, the same in every report
    "cold": "#9e9e9e",
    "evicted": "#1f77b4",
    "diverged": "#d62728",
    "partial_block": "#ff7f0e",
    "namespace": "#9467bd",
    "not_cached": "#8c564b",
    "no_state": "#17becf",
}
assert set(COLORS) == set(CAUSES)


def capacity_label(record: RunRecord, k: int) -> str:
    run = record.runs[k]
    return "unlimited" if run.capacity.blocks is None else f"{run.capacity_tokens:,} tok"


def analysed(record: RunRecord) -> list[int]:
    """The runs (indices) whose measured rows all carry causes."""
    return [k for k, run in enumerate(record.runs) if measured(run.rows) and cause_totals(run.rows) is not None]


def is_keys(record: RunRecord) -> bool:
    """Whether the record replayed a hash-id trace."""
    return record.settings.get("kind") == "trace"


def cause_table(record: RunRecord) -> Table:
    """Prompt, cached and uncached tokens by cause, one column per analysed capacity (share of prompt tokens)."""
    runs = analysed(record)
    cols = []
    for k in runs:
        rows = measured(record.runs[k].rows)
        totals = cause_totals(rows)
        assert totals is not None
        cols.append((sum(r.prompt_tokens for r in rows), sum(r.cached_tokens for r in rows), totals))

    def cell(n: int, whole: int) -> str:
        return f"{n:,} ({fmt.pct(n / whole if whole else 0.0, 1)})"

    body = [["prompt tokens", *(fmt.integer(p) for p, _, _ in cols)]]
    body.append(["cached", *(cell(c, p) for p, c, _ in cols)])
    body.append(["uncached", *(cell(p - c, p) for p, c, _ in cols)])
    for cause in CAUSES:
        if any(t[cause] for _, _, t in cols):
            body.append([f"  {cause}", *(cell(t[cause], p) for p, _, t in cols)])
    return Table(["tokens", *(capacity_label(record, k) for k in runs)], body, "Uncached tokens by cause")


def sites_table(sites: list[DivergenceSite] | tuple[DivergenceSite, ...], top: int = 10) -> Table:
    """The top divergence points, most costly first, each with an example request and the earlier one."""
    rows = []
    for k, s in enumerate(sites[:top], 1):
        this, other = sides(s, 24, 16)
        rows.append(
            [
                str(k),
                fmt.integer(s.position),
                fmt.integer(s.requests),
                fmt.integer(s.tokens),
                f"{s.example} vs {s.partner}",
                this,
                other,
            ]
        )
    return Table(
        ["#", "position", "requests", "tokens lost", "e.g. request", "this request", "the earlier request"],
        rows,
        "Top divergence points (by the prefill tokens they cost)",
        "rrrrrll",
    )


def run_fixes(record: RunRecord) -> list[tuple[str, Fix]]:
    """(capacity label, fix) for every analysed run, each distinct advice once (most tokens first per run)."""
    out: list[tuple[str, Fix]] = []
    seen: set[str] = set()
    for k in analysed(record):
        for f in fixes(record.runs[k], record.divergences, keys=is_keys(record)):
            if f.advice not in seen:
                seen.add(f.advice)
                out.append((capacity_label(record, k), f))
    return out


BY_CAPACITY = ("evicted", "not_cached", "no_state")  # the causes whose counts depend on the capacity


def fix_lines(record: RunRecord) -> list[str]:
    """One line per fix: "cause (tokens[ at capacity]): advice"."""
    several = len(analysed(record)) > 1
    return [
        f"{f.cause} ({f.tokens:,} tokens{' at ' + label if several and f.cause in BY_CAPACITY else ''}): {f.advice}"
        for label, f in run_fixes(record)
    ]


def headline(record: RunRecord) -> str | None:
    """The largest avoidable loss (all causes but cold), per capacity when it differs; None when there is none."""
    parts = []
    for k in analysed(record):
        rows = measured(record.runs[k].rows)
        f = main_fix(fixes(record.runs[k], record.divergences, keys=is_keys(record)))
        if f is not None:
            prompt = sum(r.prompt_tokens for r in rows)
            share = fmt.pct(f.tokens / prompt, 1)
            parts.append((capacity_label(record, k), f"{f.cause}, {f.tokens:,} tokens ({share} of prompt tokens)"))
    if not parts:
        return None
    if len({p for _, p in parts}) == 1:
        return f"Largest avoidable loss: {parts[0][1]}"
    return "Largest avoidable loss: " + "; ".join(f"at {label}: {p}" for label, p in parts)


def plot_causes(record: RunRecord) -> bytes | None:
    """A stacked bar of uncached tokens by cause, one bar per analysed capacity; None when nothing was analysed."""
    runs = analysed(record)
    if not runs:
        return None
    totals = [cause_totals(record.runs[k].rows) or {} for k in runs]
    labels = [capacity_label(record, k) for k in runs]
    fig, ax = new_figure(height=max(2.6, 0.6 * len(runs) + 1.9))
    left = [0] * len(runs)
    for cause in CAUSES:
        vals = [t.get(cause, 0) for t in totals]
        if any(vals):
            ax.barh(labels, vals, left=left, color=COLORS[cause], label=cause)
            left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("uncached prompt tokens")
    ax.set_title("Uncached tokens by cause")
    ax.invert_yaxis()
    ax.legend(fontsize=8, ncol=len(CAUSES), loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
    return png(fig)


def section(record: RunRecord, top: int = 10) -> Section | None:
    """The report section, or None when no run carries causes (records written before they existed)."""
    if not analysed(record):
        return None
    blocks: list[str | Table | Figure] = [cause_table(record)]
    line = headline(record)
    if line is not None:
        blocks.append(line)
    data = plot_causes(record)
    if data is not None:
        blocks.append(Figure("causes", "Uncached tokens by cause", data))
    if record.divergences:
        blocks.append(sites_table(record.divergences, top))
    elif is_keys(record):
        blocks.append(
            "Hash-id traces carry no tokens: a divergence cannot be told from new content, so it counts as cold."
        )
    blocks += fix_lines(record)
    return Section(TITLE, blocks)


# ---- one request, and everything as JSON (prefixcache explain) ---------------------------------------------------
def request_rows(record: RunRecord, k: int) -> list[tuple[str, Row]]:
    """(capacity label, row) of request ``k`` in every run that served it."""
    out = []
    for j, run in enumerate(record.runs):
        row = next((r for r in run.rows if r.index == k), None)
        if row is not None:
            out.append((capacity_label(record, j), row))
    return out


def request_table(record: RunRecord, k: int) -> Table:
    """Request ``k``'s prompt, cached tokens and uncached tokens by cause, one column per capacity."""
    cols = request_rows(record, k)
    body = [["prompt tokens", *(fmt.integer(r.prompt_tokens) for _, r in cols)]]
    body.append(["cached", *(fmt.integer(r.cached_tokens) for _, r in cols)])
    for cause, f in CAUSE_FIELDS.items():
        vals = [getattr(r, f) for _, r in cols]
        if any(vals):
            body.append([f"  {cause}", *(fmt.integer(v) for v in vals)])
    if any(r.reuse_blocks for _, r in cols):
        bs = record.block_size or 1
        body.append(
            [
                "capacity that keeps its evicted tokens (LRU)",
                *(fmt.NONE if r.reuse_blocks is None else f"{r.reuse_blocks * bs:,} tok" for _, r in cols),
            ]
        )
    return Table(["tokens", *(label for label, _ in cols)], body, f"Request {k}")


def request_json(record: RunRecord, k: int, fork: DivergenceSite | None) -> dict[str, Any]:
    """Everything about request ``k``: per capacity its causes; where it leaves history; the fork's texts."""
    cols = request_rows(record, k)
    first = cols[0][1]
    return {
        "request": k,
        "namespace": first.namespace,
        "prompt_tokens": first.prompt_tokens,
        "shared_tokens": first.shared_tokens,
        "shared_with": first.shared_with,
        "divergence": None if fork is None else asdict(fork),
        "runs": [
            {
                "capacity": label,
                "cached_tokens": r.cached_tokens,
                "causes": {c: getattr(r, f) for c, f in CAUSE_FIELDS.items()},
                "reuse_blocks": r.reuse_blocks,
            }
            for label, r in cols
        ],
    }


def explanation_json(record: RunRecord, top: int) -> dict[str, Any]:
    """The explanation of a run: per analysed capacity the tokens by cause and the fixes; the top divergences."""
    runs = []
    for k in analysed(record):
        run = record.runs[k]
        rows = measured(run.rows)
        found = fixes(run, record.divergences, keys=is_keys(record))
        main = main_fix(found)
        runs.append(
            {
                "capacity": capacity_label(record, k),
                "capacity_blocks": run.capacity.blocks,
                "block_size": run.block_size,
                "requests": len(rows),
                "prompt_tokens": sum(r.prompt_tokens for r in rows),
                "cached_tokens": sum(r.cached_tokens for r in rows),
                "causes": cause_totals(rows),
                "reuse_capacity_blocks": reuse_capacity(rows),
                "main_cause": None if main is None else main.cause,
                "fixes": [asdict(f) for f in found],
            }
        )
    return {
        "source": record.source,
        "command": record.command,
        "partial": record.partial,
        "runs": runs,
        "divergences": [asdict(s) for s in record.divergences[:top]],
    }
