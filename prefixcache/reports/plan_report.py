"""Rendering a capacity Plan: a rich table, JSON, Markdown (+ PNG beside it) and self-contained HTML.

matplotlib is imported only when a plot is drawn (Agg backend, no display).
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np
from rich.table import Table

from prefixcache.sim.plan import Plan

CURVE_LABELS = {"optimal": "optimal bound", "lru": "LRU", "fifo": "FIFO", "lfu": "LFU", "priority": "priority"}


def _label(name: str) -> str:
    return CURVE_LABELS.get(name, name)


def _tokens(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _gb(x: float | None) -> str:
    return "-" if x is None else (f"{x:.3g}" if x < 1000 else f"{x:,.0f}")


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
            f"{plan.working_set_blocks:,} blocks ({_tokens(plan.working_set_blocks * plan.block_size)} tokens)",
        ),
        ("achievable hit rate", f"{plan.unlimited_rate:.2%} (unlimited capacity)"),
    ]
    if m is not None:
        lines.append(
            (
                "model KV",
                f"{m.name}: {m.layers} layers x {m.kv_heads} KV heads x {m.head_dim} dims x "
                f"{m.dtype} = {m.bytes_per_token:,} B/token, "
                f"{m.bytes_per_block(plan.block_size):,} B/block",
            )
        )
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


# ---- terminal -------------------------------------------------------------------------------------------
def curve_table(plan: Plan) -> Table:
    """Hit rate of every curve at the grid capacities."""
    t = Table(title=f"{title(plan)} - {plan.weight[:-1]}-weighted hit rate", title_justify="left")
    t.add_column("blocks", justify="right")
    t.add_column("tokens", justify="right")
    if plan.model is not None:
        t.add_column("GB", justify="right")
    for name in plan.curve_names:
        t.add_column(_label(name), justify="right")
    for k, c in enumerate(plan.grid):
        row = [f"{c:,}", _tokens(c * plan.block_size)]
        if plan.model is not None:
            row.append(_gb(plan.gb(c)))
        row += [f"{plan.rates[n][k]:.2%}" for n in plan.curve_names]
        t.add_row(*row)
    return t


def answer_rows(plan: Plan) -> tuple[list[str], list[list[str]]]:
    """Header and rows: capacity needed for each fraction of the achievable hit rate, per curve."""
    header = ["curve", "share of achievable", "hit rate", "blocks", "tokens"]
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
            "-" if a.capacity_tokens is None else f"{approx}{_tokens(a.capacity_tokens)}",
        ]
        if plan.model is not None:
            row.append("-" if a.gb is None else f"{approx}{_gb(a.gb)}")
        rows.append(row)
    return header, rows


def answer_table(plan: Plan) -> Table:
    header, rows = answer_rows(plan)
    t = Table(
        title=f"Capacity for a share of the achievable hit rate ({plan.unlimited_rate:.2%}); "
        "'<=' = first grid point reaching it",
        title_justify="left",
    )
    for h in header:
        t.add_column(h, justify="left" if h == "curve" else "right")
    for r in rows:
        t.add_row(*r)
    return t


# ---- JSON -----------------------------------------------------------------------------------------------
def to_dict(plan: Plan, full_curve_points: int = 512) -> dict:
    """A JSON-ready dict: settings, grid rates, answers, and the LRU curve at ``full_curve_points`` log points."""
    W = max(1, plan.working_set_blocks)
    caps = np.unique(np.round(np.geomspace(1, W, num=min(W, full_curve_points))).astype(np.int64))
    lru = plan.lru.rates(plan.weight)
    m = plan.model
    return {
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
        "seconds": plan.seconds,
    }


def write_json(plan: Plan, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_dict(plan), indent=1), encoding="utf-8")
    return path


# ---- plot -----------------------------------------------------------------------------------------------
def plot_png(plan: Plan) -> bytes:
    """The curves against capacity (log x, blocks below and GB or tokens above) as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
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
    if plan.model is not None:
        per = plan.model.bytes_per_block(plan.block_size) / 1e9
        sec = ax.secondary_xaxis("top", functions=(lambda b: b * per, lambda g: g / per))
        sec.set_xlabel(f"GB of KV ({plan.model.name}, {plan.model.dtype})")
    else:
        bs = plan.block_size
        sec = ax.secondary_xaxis("top", functions=(lambda b: b * bs, lambda t: t / bs))
        sec.set_xlabel("tokens")
    ax.set_title(title(plan), fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


# ---- Markdown and HTML ----------------------------------------------------------------------------------
def _curve_rows(plan: Plan) -> tuple[list[str], list[list[str]]]:
    header = ["blocks", "tokens"] + (["GB"] if plan.model is not None else []) + [_label(n) for n in plan.curve_names]
    rows = []
    for k, c in enumerate(plan.grid):
        row = [f"{c:,}", _tokens(c * plan.block_size)] + ([_gb(plan.gb(c))] if plan.model is not None else [])
        rows.append(row + [f"{plan.rates[n][k]:.2%}" for n in plan.curve_names])
    return header, rows


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def to_markdown(plan: Plan, path: str | Path) -> list[Path]:
    """Write ``path`` (Markdown) and the plot beside it (same stem, .png). Returns both paths."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    png = path.with_suffix(".png")
    png.write_bytes(plot_png(plan))
    lines = [f"# {title(plan)}", "", f"![hit rate against capacity]({png.name})", ""]
    lines += [f"- **{k}**: {v}" for k, v in settings(plan)] + [""]
    lines += ["## Capacity for a share of the achievable hit rate", ""]
    lines += _md_table(*answer_rows(plan)) + [
        "",
        "'<=': the first grid capacity that reaches it (replayed policies).",
        "",
    ]
    lines += [f"## {plan.weight[:-1].capitalize()}-weighted hit rate by capacity", ""] + _md_table(*_curve_rows(plan))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [path, png]


_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:62em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .7em}
td:not(:first-child){text-align:right}th{background:#f3f3f3}img{max-width:100%}"""


def _html_table(header: list[str], rows: list[list[str]]) -> str:
    e = html.escape
    return (
        "<table><tr>"
        + "".join(f"<th>{e(h)}</th>" for h in header)
        + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows)
        + "</table>"
    )


def to_html(plan: Plan, path: str | Path) -> Path:
    """Write one self-contained HTML page (the plot embedded as base64 PNG)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    e = html.escape
    img = base64.b64encode(plot_png(plan)).decode("ascii")
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title(plan))}</title>",
        f"<style>{_CSS}</style></head><body><h1>{e(title(plan))}</h1>",
        f"<img alt='hit rate against capacity' src='data:image/png;base64,{img}'>",
        "<h2>Settings</h2>",
        _html_table(["", ""], [list(kv) for kv in settings(plan)]),
        "<h2>Capacity for a share of the achievable hit rate</h2>",
        _html_table(*answer_rows(plan)),
        "<p>'&lt;=': the first grid capacity that reaches it (replayed policies).</p>",
        f"<h2>{e(plan.weight[:-1].capitalize())}-weighted hit rate by capacity</h2>",
        _html_table(*_curve_rows(plan)),
        "</body></html>",
    ]
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
