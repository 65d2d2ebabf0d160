"""Rendering a capacity Plan: a rich table, JSON, Markdown (+ PNG beside it) and self-contained HTML.

matplotlib is imported only when a plot is drawn (Agg backend, no display).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table as RichTable

from prefixcache.reports import format as fmt
from prefixcache.reports.document import Document, Figure, Section, Table, rich_table
from prefixcache.reports.output import write_output
from prefixcache.reports.plots import png
from prefixcache.sim.plan import Plan, TierPoint

CURVE_LABELS = {"optimal": "optimal bound", "lru": "LRU", "fifo": "FIFO", "lfu": "LFU", "priority": "priority"}


def _label(name: str) -> str:
    return CURVE_LABELS.get(name, name)


def title(plan: Plan) -> str:
    return f"Capacity plan: {Path(plan.trace).name or 'trace'}"


def settings(plan: Plan) -> list[tuple[str, str]]:
    """(name, value) lines describing how the plan was computed."""
    m = plan.model
    lines = [
        ("trace", plan.trace),
        ("requests", f"{plan.requests:,} ({plan.measured_requests:,} measured, warm-up {plan.warmup:g})"),
        ("order", plan.order + (" (stable sort by timestamp)" if plan.order == "timestamp" else "")),
        (
            "hit rate",
            "token-weighted (cached prompt tokens / prompt tokens)"
            if plan.weight == "tokens"
            else "block-weighted (hit blocks / looked-up blocks)",
        ),
        ("block size", f"{plan.block_size} tokens"),
        (
            "working set",
            f"{plan.working_set_blocks:,} blocks ({fmt.short(plan.working_set_blocks * plan.block_size)} tokens)",
        ),
        ("achievable hit rate", f"{plan.unlimited_rate:.2%} (unlimited capacity)"),
    ]
    if m is not None:
        lines.append(
            (
                "model KV",
                f"{m.name}: {m.layers_text()} x {m.dtype} = {m.bytes_per_token:,} B/token, "
                f"{m.bytes_per_block(plan.block_size):,} B/block",
            )
        )
        if m.hybrid:
            lines.append(("recurrent state", f"one snapshot: {m.state_text()}"))
            lines.append(("snapshots", snapshot_rule(plan)))
    if plan.keep_for is not None:
        lines.append(("retention", f"every request keeps its prefix {plan.keep_for:g} s (priority policy)"))
    if "optimal" in plan.rates:
        lines.append(
            (
                "optimal bound",
                "Belady's rule adapted to prefix caching: exact in blocks without warm-up; "
                "an upper bound with warm-up or token weighting",
            )
        )
    return lines


def snapshot_rule(plan: Plan) -> str:
    """How a hybrid model's snapshots were counted (see ``prefixcache.sim.plan``)."""
    if plan.fixed_snapshots is not None:
        return f"{plan.fixed_snapshots:,} at every capacity (--snapshots); GB = KV blocks + snapshots"
    sites, w = plan.snapshot_sites or 0, plan.working_set_blocks
    return (
        f"one per snapshot site the cache holds (a block where a request's path ends or paths part): {sites:,} in "
        f"the working set's {w:,} blocks, so capacity x {sites:,} / {w:,}, rounded up; GB = KV blocks + snapshots"
    )


def _hybrid(plan: Plan) -> bool:
    return plan.model is not None and plan.model.hybrid


# ---- tables ---------------------------------------------------------------------------------------------
def curve_rows(plan: Plan) -> Table:
    """Hit rate of every curve at the grid capacities (and, for a hybrid model, the snapshots in its GB)."""
    sizes = (["snapshots"] if _hybrid(plan) else []) + (["GB"] if plan.model is not None else [])
    header = ["blocks", "tokens", *sizes] + [_label(n) for n in plan.curve_names]
    rows = []
    for k, c in enumerate(plan.grid):
        row = [f"{c:,}", fmt.short(c * plan.block_size)]
        if _hybrid(plan):
            row.append(f"{plan.snapshots(c):,}")
        if plan.model is not None:
            row.append(fmt.gb(plan.gb(c)))
        rows.append(row + [f"{plan.rates[n][k]:.2%}" for n in plan.curve_names])
    return Table(header, rows, f"{plan.weight[:-1].capitalize()}-weighted hit rate by capacity")


def curve_table(plan: Plan) -> RichTable:
    """The curve table for the terminal."""
    t = curve_rows(plan)
    return rich_table(Table(t.header, t.rows, f"{title(plan)} - {plan.weight[:-1]}-weighted hit rate"))


def answer_rows(plan: Plan) -> Table:
    """Header and rows: capacity needed for each fraction of the achievable hit rate, per curve."""
    header = ["curve", "share of achievable", "hit rate", "blocks", "tokens"]
    if _hybrid(plan):
        header.append("snapshots")
    if plan.model is not None:
        header.append("GB")
    rows = []
    for a in plan.answers:
        approx = "" if a.exact else "<= "
        row = [
            _label(a.curve),
            f"{a.fraction:.0%}",
            f"{a.target_rate:.2%}",
            "not reached" if a.capacity_blocks is None else f"{approx}{a.capacity_blocks:,}",
            "-" if a.capacity_tokens is None else f"{approx}{fmt.short(a.capacity_tokens)}",
        ]
        if _hybrid(plan):
            row.append("-" if a.snapshots is None else f"{approx}{a.snapshots:,}")
        if plan.model is not None:
            row.append("-" if a.gb is None else f"{approx}{fmt.gb(a.gb)}")
        rows.append(row)
    return Table(header, rows, "Capacity for a share of the achievable hit rate")


def answer_table(plan: Plan) -> RichTable:
    """The answers for the terminal."""
    t = answer_rows(plan)
    title_ = (
        f"Capacity for a share of the achievable hit rate ({plan.unlimited_rate:.2%}); "
        "'<=' = first grid point reaching it"
    )
    return rich_table(Table(t.header, t.rows, title_))


def tier_rows(plan: Plan) -> Table | None:
    """RAM and disk for each share of the achievable hit rate: per pool size, the smallest tier, the split of
    the hit rate and the estimated TTFT (None without a tier plan)."""
    tp = plan.tiers
    if tp is None:
        return None
    gb = plan.model is not None

    def size(blocks: int) -> str:  # GB with a model, else tokens
        return fmt.gb(plan.gb(blocks)) if gb else fmt.short(blocks * plan.block_size)

    unit = "GB" if gb else "tokens"
    header = [f"RAM: pool {unit}", "share", f"disk: tier {unit}", "pool hit", "tier hit", "miss", "TTFT mean"]
    header.append("TTFT p50")
    rows = []
    for k, pool in enumerate(tp.pools):
        alone = tp.pool_only[k]
        rows.append([size(pool), "pool alone", "-", *_split(alone), *_ttft(alone)])
        for a in (a for a in tp.answers if a.pool_blocks == pool):
            p = a.point
            if p is None:
                rows.append([size(pool), f"{a.fraction:.0%}", "not reached", "", "", "", "", ""])
            else:
                disk = size(p.tier_blocks) if p.tier_blocks else "none needed"
                rows.append([size(pool), f"{a.fraction:.0%}", disk, *_split(p), *_ttft(p)])
    rows.append(["no cache", "", "", "", "", "100.0%", *_ttft(tp.no_cache)])
    r = tp.rates
    read = f"{r.tokens_per_s:,.0f} tokens/s"
    if r.read_bytes is not None:
        read = f"{fmt.short(int(r.read_bytes))}B/s ({read} at {r.bytes_per_token:,} B/token)"
    title_ = (
        f"RAM and disk for a share of the achievable hit rate ({plan.unlimited_rate:.2%}); estimated TTFT: "
        f"{r.prefill_rate:,.0f} prefill tokens/s, tier read {read}"
    )
    return Table(header, rows, title_)


def _split(p: TierPoint) -> list[str]:
    return [fmt.pct(p.pool_rate, 1), fmt.pct(p.tier_rate, 1), fmt.pct(p.miss_rate, 1)]


def _ttft(p: TierPoint) -> list[str]:
    return [_time(p.ttft_mean_s), _time(p.ttft_p50_s)]


def _time(seconds: float) -> str:
    return fmt.ms(seconds) if seconds < 1 else fmt.seconds(seconds)


def tier_table(plan: Plan) -> RichTable | None:
    """The tier answers for the terminal (None without a tier plan)."""
    t = tier_rows(plan)
    return None if t is None else rich_table(t)


def _tier_dict(plan: Plan) -> dict[str, Any] | None:
    tp = plan.tiers
    if tp is None:
        return None
    r = tp.rates
    return {
        "prefill_rate": r.prefill_rate,
        "read_bytes_per_s": r.read_bytes,
        "read_tokens_per_s": r.tokens_per_s,
        "bytes_per_token": r.bytes_per_token,
        "pools_blocks": list(tp.pools),
        "pool_only": [asdict(p) for p in tp.pool_only],
        "answers": [
            {
                "fraction": a.fraction,
                "target_rate": a.target_rate,
                "pool_blocks": a.pool_blocks,
                "tier_blocks": None if a.point is None else a.point.tier_blocks,
                "pool_gb": plan.gb(a.pool_blocks),
                "tier_gb": None if a.point is None else plan.gb(a.point.tier_blocks),
                "point": None if a.point is None else asdict(a.point),
            }
            for a in tp.answers
        ],
        "no_cache": asdict(tp.no_cache),
        "replays": tp.replays,
    }


# ---- JSON -----------------------------------------------------------------------------------------------
def to_dict(plan: Plan, full_curve_points: int = 512) -> dict[str, Any]:
    """A JSON-ready dict: settings, grid rates, answers, and the LRU curve at ``full_curve_points`` log points."""
    W = max(1, plan.working_set_blocks)
    caps = np.unique(np.round(np.geomspace(1, W, num=min(W, full_curve_points))).astype(np.int64))
    lru = plan.lru.rates(plan.weight)
    m = plan.model
    out: dict[str, Any] = {
        "trace": plan.trace,
        "order": plan.order,
        "weight": plan.weight,
        "warmup": plan.warmup,
        "block_size": plan.block_size,
        "requests": plan.requests,
        "measured_requests": plan.measured_requests,
        "working_set_blocks": plan.working_set_blocks,
        "unlimited_rate": plan.unlimited_rate,
        "keep_for": plan.keep_for,
        "model": None
        if m is None
        else {
            "name": m.name,
            "layers": m.layers,
            "kv_heads": m.kv_heads,
            "head_dim": m.head_dim,
            "dtype": m.dtype,
            "bytes_per_token": m.bytes_per_token,
            "bytes_per_block": m.bytes_per_block(plan.block_size),
        },
        "grid_blocks": list(plan.grid),
        "rates": {k: list(v) for k, v in plan.rates.items()},
        "lru_curve": {"blocks": caps.tolist(), "rate": [float(lru[c - 1]) for c in caps]},
        "answers": [
            {
                "curve": a.curve,
                "fraction": a.fraction,
                "target_rate": a.target_rate,
                "blocks": a.capacity_blocks,
                "tokens": a.capacity_tokens,
                "gb": a.gb,
                "exact": a.exact,
            }
            for a in plan.answers
        ],
        "tiers": _tier_dict(plan),
        "seconds": plan.seconds,
    }
    if m is not None and (m.hybrid or m.latent_dim):  # keys pure-attention plans never had
        out["model"].update(latent_dim=m.latent_dim, total_layers=m.total_layers, recurrent_layers=m.recurrent_layers)
    if m is not None and m.hybrid:
        out["model"]["state_bytes"] = m.state_bytes
        out["snapshots"] = {"sites": plan.snapshot_sites, "fixed": plan.fixed_snapshots}
        for entry, a in zip(out["answers"], plan.answers):
            entry["snapshots"] = a.snapshots
    return out


def write_json(plan: Plan, path: str | Path) -> str:
    """Write the plan as JSON ("-": standard output). Returns where it went."""
    return write_output(path, json.dumps(to_dict(plan), indent=1) + "\n")


# ---- plot -----------------------------------------------------------------------------------------------
def plot_png(plan: Plan) -> bytes:
    """The curves against capacity (log x, blocks below and GB or tokens above) as PNG bytes."""
    import matplotlib.ticker

    from prefixcache.reports.plots import new_figure

    fig, ax = new_figure(8, 4.5, 110)
    W = max(1, plan.working_set_blocks)
    caps = np.unique(np.round(np.geomspace(1, W, num=min(W, 2000))).astype(np.int64))
    ax.plot(caps, plan.lru.rates(plan.weight)[caps - 1], label="LRU (every capacity)", color="C0", lw=1.8)
    styles = {"optimal": dict(color="k", ls="--", marker="", lw=1.6)}
    for k, name in enumerate(n for n in plan.curve_names if n != "lru"):
        st = styles.get(name, dict(color=f"C{k + 1}", ls="-", marker="o", ms=3.5, lw=1.2))
        ax.plot(plan.grid, plan.rates[name], label=_label(name), **st)
    ax.axhline(plan.unlimited_rate, color="grey", lw=0.8, ls=":", label=f"unlimited ({plan.unlimited_rate:.1%})")
    ax.set_xscale("log")
    ax.set_xlim(1, W * 1.05)
    ax.set_ylim(0, min(1.0, max(0.05, plan.unlimited_rate * 1.1)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel(f"cache capacity (blocks of {plan.block_size} tokens)")
    ax.set_ylabel(f"{plan.weight[:-1]}-weighted hit rate")
    ax.grid(True, which="both", alpha=0.25)
    m = plan.model
    if m is not None:
        per = m.bytes_per_block(plan.block_size) / 1e9
        what = f"GB of KV ({m.name}, {m.dtype})"
        if m.hybrid and plan.fixed_snapshots is None:  # snapshots grow with the capacity: per block, on average
            per += m.state_bytes * (plan.snapshot_sites or 0) / max(1, plan.working_set_blocks) / 1e9
            what = f"GB of KV and snapshots ({m.name}, {m.dtype})"
        elif m.hybrid:
            what = f"GB of KV ({m.name}, {m.dtype}; + {fmt.gb(m.gb(0, 1, plan.fixed_snapshots or 0))} of snapshots)"
        sec = ax.secondary_xaxis("top", functions=(lambda b: b * per, lambda g: g / per))
        sec.set_xlabel(what)
    else:
        bs = plan.block_size
        sec = ax.secondary_xaxis("top", functions=(lambda b: b * bs, lambda t: t / bs))
        sec.set_xlabel("tokens")
    ax.set_title(title(plan), fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return png(fig)


# ---- document -------------------------------------------------------------------------------------------
def document(plan: Plan) -> Document:
    """The plan as a Document (rendered to HTML or Markdown by prefixcache.reports.document)."""
    doc = Document(title(plan))
    doc.sections.append(Section("", [Figure("plot", "hit rate against capacity", plot_png(plan))]))
    doc.sections.append(Section("Settings", [Table(["setting", "value"], [list(kv) for kv in settings(plan)])]))
    answers = answer_rows(plan)
    doc.sections.append(
        Section(
            answers.title,
            [Table(answers.header, answers.rows), "'<=': the first grid capacity that reaches it (replayed policies)."],
        )
    )
    tiers = tier_rows(plan)
    if tiers is not None:
        doc.sections.append(Section("RAM and disk", [tiers, TIER_NOTE]))
    curves = curve_rows(plan)
    doc.sections.append(Section(curves.title, [Table(curves.header, curves.rows)]))
    return doc


TIER_NOTE = (
    "Each row is one replay of the trace through a pool of the given size above a second tier (written through: "
    "every block the pool takes is also stored below; a lookup that stops in the pool goes on in the tier, whose "
    "blocks are loaded into the pool). The tier is the smallest, to the block, that reaches the share (bisected "
    "over replays); 0 when the pool alone does. TTFT per request = uncached tokens / prefill rate + tier tokens / "
    "tier read rate (a model-free estimate: the pool's own hits and decoding cost nothing)."
)
