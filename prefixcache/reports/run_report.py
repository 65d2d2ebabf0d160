"""The report of a run record: a summary table (one column per capacity), why prefill was not saved
(``causes_report``), plots, settings.

Plots (matplotlib, Agg): hit rate over the run, cumulative prefill tokens saved, TTFT cached vs uncached
(replays with timings), and hit rate against capacity (sweeps). Nothing here changes the record.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from prefixcache.reports import format as fmt
from prefixcache.reports.causes_report import section as causes_section
from prefixcache.reports.document import Document, Figure, Section, Table
from prefixcache.reports.plots import COLORS, STYLES, Series, draw, new_figure, png
from prefixcache.reports.record import RunRecord
from prefixcache.sim.results import Row

Totals = dict[str, Any]


def capacity_label(t: Totals) -> str:
    """A capacity's column header: its size in tokens, or "unlimited"."""
    return "unlimited" if t.get("capacity_tokens") is None else f"{t['capacity_tokens']:,} tok"


SUMMARY_ROWS: list[tuple[str, Callable[[Totals], str]]] = [
    ("pool blocks", lambda t: "unlimited" if t["capacity_blocks"] is None else fmt.integer(t["pool_blocks"])),
    ("requests", lambda t: fmt.integer(t["requests"])),
    ("prompt tokens", lambda t: fmt.integer(t["prompt_tokens"])),
    ("cached tokens", lambda t: fmt.integer(t["cached_tokens"])),
    ("token hit rate", lambda t: fmt.pct(t["token_hit_rate"])),
    ("block hit rate", lambda t: fmt.pct(t["block_hit_rate"])),
    ("requests with any hit", lambda t: fmt.pct(t["hit_request_share"])),
    ("prefill tokens saved", lambda t: fmt.integer(t["prefill_tokens_saved"])),
    ("evicted blocks", lambda t: fmt.integer(t["evicted_blocks"])),
    ("peak pool occupancy", lambda t: fmt.pct(t["peak_pool_occupancy"])),
]
TIER_ROWS: list[tuple[str, Callable[[Totals], str]]] = [  # runs with a second tier (``totals`` "tier")
    (
        "tier blocks",
        lambda t: "unlimited" if t["tier_capacity_blocks"] is None else fmt.integer(t["tier_capacity_blocks"]),
    ),
    ("pool hit rate (tokens)", lambda t: fmt.pct(t["pool_token_hit_rate"])),
    ("tier hit rate (tokens)", lambda t: fmt.pct(t["tier_token_hit_rate"])),
    ("miss rate (tokens)", lambda t: fmt.pct(1 - t["token_hit_rate"] if t["prompt_tokens"] else 0.0)),
    ("tokens from the pool / tier", lambda t: f"{fmt.integer(t['pool_tokens'])} / {fmt.integer(t['tier_tokens'])}"),
    ("peak tier occupancy", lambda t: fmt.integer(t["peak_tier_blocks"]) + " blocks"),
]
TIMING_ROWS: list[tuple[str, Callable[[Totals], str]]] = [
    (
        f"TTFT p{q} cached / uncached",
        lambda t, q=q: f"{fmt.ms(t.get(f'ttft_cached_p{q}_s'))} / {fmt.ms(t.get(f'ttft_uncached_p{q}_s'))}",
    )
    for q in (50, 90, 99)
] + [
    ("TTFT speedup (p50)", lambda t: fmt.times(t.get("ttft_speedup_p50"))),
    (
        "total time cached / uncached",
        lambda t: f"{fmt.seconds(t.get('time_cached_s'))} / {fmt.seconds(t.get('time_uncached_s'))}",
    ),
    (
        "outputs match",
        lambda t: (
            f"{t['outputs_checked'] - t['outputs_mismatched']}/{t['outputs_checked']}"
            if t.get("outputs_checked")
            else "not checked"
        ),
    ),
]


def summary(record: RunRecord) -> Table:
    """The summary: one metric per row, one column per capacity."""
    ts = record.totals()
    spec = SUMMARY_ROWS[:]
    if any(t.get("tier") for t in ts):  # a record has a tier in every run or in none
        spec[6:6] = TIER_ROWS  # after the (pool + tier) hit rates
    spec += TIMING_ROWS if any("ttft_cached_p50_s" in t for t in ts) else []
    return Table(
        ["metric", *(capacity_label(t) for t in ts)], [[name, *(f(t) for t in ts)] for name, f in spec], title(record)
    )


def title(record: RunRecord) -> str:
    s = record.settings
    bits = [f"prefixcache {record.command}: {Path(record.source).name}"]
    if s.get("model"):
        bits.append(f"model {s['model']}")
    bits.append(f"block size {record.block_size if record.block_size is not None else '?'}")
    if s.get("warmup"):
        bits.append(f"warm-up {s['warmup']:.0%}")
    if record.partial:
        bits.append("PARTIAL (interrupted)")
    return " · ".join(bits)


# ---- plots -------------------------------------------------------------------------------------------------
def _measured(rows: tuple[Row, ...]) -> list[Row]:
    return [r for r in rows if not r.warmup]


def _labels(record: RunRecord) -> list[str]:
    return [capacity_label(t) for t in record.totals()]


MIN_WINDOW = 5  # requests in the smallest moving window drawn (runs of fewer than 2x that get none)


def window_size(n: int) -> int | None:
    """Requests in the moving window of a run of ``n`` measured requests (about 2% of them), or None."""
    return max(MIN_WINDOW, n // 50) if n >= 2 * MIN_WINDOW else None


def hit_rate_series(record: RunRecord) -> tuple[list[Series], int | None]:
    """The hit-rate plot as data: per capacity its cumulative token hit rate (each capacity its own colour, line
    style and staggered markers, so that capacities that cache alike stay visible) and, under it, a faint moving
    window; and the window's size (None when no window is drawn)."""
    out: list[Series] = []
    windows: set[int] = set()
    runs = [(run, label) for run, label in zip(record.runs, _labels(record)) if _measured(run.rows)]
    for k, (run, label) in enumerate(runs):
        rows = _measured(run.rows)
        prompt = np.array([r.prompt_tokens for r in rows], dtype=float)
        cached = np.array([r.cached_tokens for r in rows], dtype=float)
        x = np.arange(1, len(rows) + 1, dtype=float)
        color = COLORS[k % len(COLORS)]
        line, marker = STYLES[k % len(STYLES)]
        cumulative = np.cumsum(cached) / np.maximum(np.cumsum(prompt), 1)
        out.append(
            Series(
                label,
                tuple(x),
                tuple(cumulative),
                color,
                line,
                marker,
                zorder=3 + k,
                mark_from=k / len(runs),
                size=max(3.0, 8.0 - 2 * k),
            )
        )
        w = window_size(len(rows))
        if w is not None:
            windows.add(w)
            pw, cw = np.convolve(prompt, np.ones(w), "valid"), np.convolve(cached, np.ones(w), "valid")
            out.append(Series(None, tuple(x[w - 1 :]), tuple(cw / np.maximum(pw, 1)), color, line, faint=True))
    return out, (windows.pop() if len(windows) == 1 else max(windows, default=None))


def hit_rate_title(window: int | None) -> str:
    """The hit-rate plot's title: it mentions the moving window only when one is drawn."""
    if window is None:
        return "Hit rate over the run (cumulative)"
    return f"Hit rate over the run (cumulative; faint: moving window of {window} requests)"


def plot_hit_rate(record: RunRecord) -> bytes:
    """Cumulative token hit rate and a faint moving window against request number, per capacity."""
    series, window = hit_rate_series(record)
    fig, ax = new_figure()
    draw(ax, series)
    ax.set_xlabel("request")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(hit_rate_title(window))
    ax.legend(fontsize=8)
    return png(fig)


def plot_saved(record: RunRecord) -> bytes:
    """Cumulative prefill tokens saved against request number, per capacity."""
    fig, ax = new_figure()
    for k, (run, label) in enumerate(zip(record.runs, _labels(record))):
        rows = _measured(run.rows)
        if rows:
            x = np.arange(1, len(rows) + 1)
            ax.plot(x, np.cumsum([r.cached_tokens for r in rows]), label=label)
            ax.plot(
                x,
                np.cumsum([r.prompt_tokens for r in rows]),
                ls=":",
                color="gray",
                label="prompt tokens" if k == 0 else None,
            )
    ax.set_xlabel("request")
    ax.set_ylabel("tokens")
    ax.set_title("Cumulative prefill tokens saved")
    ax.legend(fontsize=8)
    return png(fig)


def ttft_series(record: RunRecord) -> list[Series]:
    """The TTFT scatter as data: per capacity, cached (dots) and uncached (crosses) TTFT in ms per request, in
    that capacity's colour, as the summary table has a cached and an uncached figure per column; empty without
    timings."""
    out: list[Series] = []
    for k, (run, label) in enumerate(zip(record.runs, _labels(record))):
        rows = _measured(run.rows)
        x = tuple(float(r.index) for r in rows)
        color = COLORS[k % len(COLORS)]
        for name, marker, field in (("cached", "o", "ttft_cached_s"), ("uncached", "x", "ttft_uncached_s")):
            values: list[float | None] = [getattr(r, field) for r in rows]
            if any(v is not None for v in values):
                y = tuple(np.nan if v is None else 1000 * v for v in values)
                out.append(Series(f"{name}, {label}", x, y, color, None, marker, zorder=3 + k))
    return out


def plot_ttft(record: RunRecord) -> bytes | None:
    """TTFT per request, cached and uncached, at every capacity of the run; None without timings."""
    series = ttft_series(record)
    if not any(s.label is not None and s.label.startswith("cached") for s in series):
        return None
    fig, ax = new_figure()
    draw(ax, series)
    ax.set_xlabel("request")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT cached vs uncached")
    ax.legend(fontsize=8)
    return png(fig)


def plot_capacity(record: RunRecord) -> bytes | None:
    """Token and block hit rate against capacity (sweeps with >= 2 finite capacities), else None."""
    all_t = record.totals()
    ts = sorted((t for t in all_t if t.get("capacity_tokens") is not None), key=lambda t: t["capacity_tokens"])
    if len(ts) < 2:
        return None
    fig, ax = new_figure()
    x = [t["capacity_tokens"] for t in ts]
    ax.plot(x, [t["token_hit_rate"] for t in ts], "o-", label="token hit rate")
    ax.plot(x, [t["block_hit_rate"] for t in ts], "s--", label="block hit rate")
    unl = [t for t in all_t if t.get("capacity_tokens") is None]
    if unl:
        ax.axhline(unl[0]["token_hit_rate"], color="gray", ls=":", label="unlimited (token)")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (tokens)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.set_title("Hit rate against capacity")
    ax.legend(fontsize=8)
    return png(fig)


PLOTS: list[tuple[str, str, Callable[[RunRecord], bytes | None]]] = [
    ("hit_rate", "Hit rate over the run", plot_hit_rate),
    ("tokens_saved", "Cumulative prefill tokens saved", plot_saved),
    ("ttft", "TTFT cached vs uncached", plot_ttft),
    ("capacity", "Hit rate against capacity", plot_capacity),
]


def figures(record: RunRecord) -> list[Figure]:
    """Every plot that applies to the record (none for a record without requests)."""
    if not any(run.rows for run in record.runs):
        return []
    out = []
    for stem, caption, plot in PLOTS:
        data = plot(record)
        if data is not None:
            out.append(Figure(stem, caption, data))
    return out


def document(record: RunRecord) -> Document:
    """The whole report as a Document (rendered by prefixcache.reports.document)."""
    doc = Document(title(record), footer=f"Run record created {record.created}.")
    if record.partial:
        doc.warning = "This run was interrupted: the figures cover the requests served so far."
    summary_table = summary(record)
    doc.sections.append(Section("", [Table(summary_table.header, summary_table.rows)]))
    why = causes_section(record)
    if why is not None:
        doc.sections.append(why)
    doc.sections += [Section(f.caption, [f]) for f in figures(record)]
    doc.sections.append(Section("Settings", [Table(["setting", "value"], fmt.setting_rows(record.settings))]))
    return doc
