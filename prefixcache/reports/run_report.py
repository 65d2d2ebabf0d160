"""Turning run records into tables (rich), Markdown (+ PNG plots beside it) and self-contained HTML.

Plots (matplotlib, Agg): hit rate over the run, cumulative prefill tokens saved, TTFT cached vs uncached
(replays with timings), and hit rate against capacity (sweeps). Nothing here changes the record.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.table import Table

from prefixcache.reports.record import Row, rows_of


# ---- numbers -----------------------------------------------------------------------------------------------
def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.2f}%"


def _int(x) -> str:
    return "—" if x is None else f"{x:,}"


def _ms(x) -> str:
    return "—" if x is None else f"{1000 * x:.1f} ms"


def _x(x) -> str:
    return "—" if x is None else f"{x:.2f}×"


def capacity_label(t: dict) -> str:
    """A capacity's column header: its size in tokens, or "unlimited"."""
    return "unlimited" if t.get("capacity_tokens") is None else f"{t['capacity_tokens']:,} tok"


SUMMARY_ROWS: list[tuple[str, Callable[[dict], str]]] = [
    ("pool blocks", lambda t: _int(t["pool_blocks"])),
    ("requests", lambda t: _int(t["requests"])),
    ("prompt tokens", lambda t: _int(t["prompt_tokens"])),
    ("cached tokens", lambda t: _int(t["cached_tokens"])),
    ("token hit rate", lambda t: _pct(t["token_hit_rate"])),
    ("block hit rate", lambda t: _pct(t["block_hit_rate"])),
    ("requests with any hit", lambda t: _pct(t["hit_request_share"])),
    ("prefill tokens saved", lambda t: _int(t["prefill_tokens_saved"])),
    ("evicted blocks", lambda t: _int(t["evicted_blocks"])),
    ("peak pool occupancy", lambda t: _pct(t["peak_pool_occupancy"])),
]
TIMING_ROWS: list[tuple[str, Callable[[dict], str]]] = [
    (
        "TTFT p50 cached / uncached",
        lambda t: f"{_ms(t.get('ttft_cached_p50_s'))} / {_ms(t.get('ttft_uncached_p50_s'))}",
    ),
    (
        "TTFT p90 cached / uncached",
        lambda t: f"{_ms(t.get('ttft_cached_p90_s'))} / {_ms(t.get('ttft_uncached_p90_s'))}",
    ),
    (
        "TTFT p99 cached / uncached",
        lambda t: f"{_ms(t.get('ttft_cached_p99_s'))} / {_ms(t.get('ttft_uncached_p99_s'))}",
    ),
    ("TTFT speedup (p50)", lambda t: _x(t.get("ttft_speedup_p50"))),
    ("total time cached / uncached", lambda t: f"{_sec(t.get('time_cached_s'))} / {_sec(t.get('time_uncached_s'))}"),
    (
        "outputs match",
        lambda t: (
            f"{t['outputs_checked'] - t['outputs_mismatched']}/{t['outputs_checked']}"
            if t.get("outputs_checked")
            else "not checked"
        ),
    ),
]


def _sec(x) -> str:
    return "—" if x is None else f"{x:.2f} s"


def summary_rows(record: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the summary: one metric per row, one column per capacity."""
    ts = record["totals"]
    header = ["metric", *(capacity_label(t) for t in ts)]
    spec = SUMMARY_ROWS + (TIMING_ROWS if any("ttft_cached_p50_s" in t for t in ts) else [])
    return header, [[name, *(fmt(t) for t in ts)] for name, fmt in spec]


def title(record: dict) -> str:
    s = record.get("settings", {})
    bits = [f"prefixcache {record['command']}: {Path(str(record.get('source', ''))).name}"]
    if s.get("model"):
        bits.append(f"model {s['model']}")
    bits.append(f"block size {record['totals'][0]['block_size'] if record['totals'] else '?'}")
    if s.get("warmup"):
        bits.append(f"warm-up {s['warmup']:.0%}")
    if record.get("partial"):
        bits.append("PARTIAL (interrupted)")
    return " · ".join(bits)


def summary_table(record: dict) -> Table:
    """The terminal summary as a rich Table."""
    header, rows = summary_rows(record)
    table = Table(title=title(record), title_justify="left")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for r in rows:
        table.add_row(*r)
    return table


# ---- plots -------------------------------------------------------------------------------------------------
def _measured(run: dict) -> list[Row]:
    return [r for r in rows_of(run) if not r.warmup]


def _fig():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=100)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _run_label(record: dict, k: int) -> str:
    return capacity_label(record["totals"][k])


def plot_hit_rate(record: dict) -> bytes:
    """Cumulative token hit rate (solid) and a moving window (faint) against request number, per capacity."""
    fig, ax = _fig()
    for k, run in enumerate(record["runs"]):
        rows = _measured(run)
        if not rows:
            continue
        p = np.cumsum([r.prompt_tokens for r in rows], dtype=float)
        c = np.cumsum([r.cached_tokens for r in rows], dtype=float)
        x = np.arange(1, len(rows) + 1)
        (line,) = ax.plot(x, c / np.maximum(p, 1), label=_run_label(record, k))
        w = max(1, len(rows) // 50)
        if w > 1:
            pw = np.convolve([r.prompt_tokens for r in rows], np.ones(w), "valid")
            cw = np.convolve([r.cached_tokens for r in rows], np.ones(w), "valid")
            ax.plot(x[w - 1 :], cw / np.maximum(pw, 1), color=line.get_color(), alpha=0.25, lw=0.8)
    ax.set_xlabel("request")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.set_title("Hit rate over the run (cumulative; faint: moving window)")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_saved(record: dict) -> bytes:
    """Cumulative prefill tokens saved against request number, per capacity."""
    fig, ax = _fig()
    for k, run in enumerate(record["runs"]):
        rows = _measured(run)
        if rows:
            ax.plot(
                np.arange(1, len(rows) + 1), np.cumsum([r.cached_tokens for r in rows]), label=_run_label(record, k)
            )
            ax.plot(
                np.arange(1, len(rows) + 1),
                np.cumsum([r.prompt_tokens for r in rows]),
                ls=":",
                color="gray",
                label="prompt tokens" if k == 0 else None,
            )
    ax.set_xlabel("request")
    ax.set_ylabel("tokens")
    ax.set_title("Cumulative prefill tokens saved")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_ttft(record: dict) -> bytes | None:
    """TTFT per request: uncached, and cached at every capacity of the run; None without timings."""
    runs = [(k, _measured(run)) for k, run in enumerate(record["runs"])]
    if not any(r.ttft_cached_s is not None for _, rows in runs for r in rows):
        return None
    fig, ax = _fig()
    for k, rows in runs:
        if k == 0 and any(r.ttft_uncached_s is not None for r in rows):
            ax.plot(
                [r.index for r in rows],
                [1000 * r.ttft_uncached_s if r.ttft_uncached_s is not None else np.nan for r in rows],
                ".",
                label="uncached",
                color="tab:red",
                ms=4,
            )
        ax.plot(
            [r.index for r in rows],
            [1000 * r.ttft_cached_s if r.ttft_cached_s is not None else np.nan for r in rows],
            ".",
            label=f"cached, {_run_label(record, k)}",
            ms=4,
        )
    ax.set_xlabel("request")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT cached vs uncached")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_capacity(record: dict) -> bytes | None:
    """Token and block hit rate against capacity (sweeps with >= 2 finite capacities), else None."""
    ts = [t for t in record["totals"] if t.get("capacity_tokens") is not None]
    if len(ts) < 2:
        return None
    ts = sorted(ts, key=lambda t: t["capacity_tokens"])
    fig, ax = _fig()
    x = [t["capacity_tokens"] for t in ts]
    ax.plot(x, [t["token_hit_rate"] for t in ts], "o-", label="token hit rate")
    ax.plot(x, [t["block_hit_rate"] for t in ts], "s--", label="block hit rate")
    unl = [t for t in record["totals"] if t.get("capacity_tokens") is None]
    if unl:
        ax.axhline(unl[0]["token_hit_rate"], color="gray", ls=":", label="unlimited (token)")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (tokens)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.set_title("Hit rate against capacity")
    ax.legend(fontsize=8)
    return _png(fig)


def plots(record: dict) -> list[tuple[str, str, bytes]]:
    """(file stem, caption, PNG) for every plot that applies to the record."""
    out = [
        ("hit_rate", "Hit rate over the run", plot_hit_rate(record)),
        ("tokens_saved", "Cumulative prefill tokens saved", plot_saved(record)),
    ]
    for stem, caption, fn in (
        ("ttft", "TTFT cached vs uncached", plot_ttft),
        ("capacity", "Hit rate against capacity", plot_capacity),
    ):
        png = fn(record)
        if png is not None:
            out.append((stem, caption, png))
    return out


# ---- documents ---------------------------------------------------------------------------------------------
def _settings_lines(record: dict) -> list[tuple[str, str]]:
    return [(k, str(v)) for k, v in record.get("settings", {}).items()]


def to_markdown(record: dict, path: str | Path) -> list[Path]:
    """Write a Markdown report to ``path`` and its plots as PNG files beside it. Returns the files written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header, rows = summary_rows(record)
    lines = [
        f"# {title(record)}",
        "",
        f"Run record version {record['version']}, created {record.get('created', '?')}.",
        "",
    ]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "## Settings", "", "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _settings_lines(record)]
    written = []
    for stem, caption, png in plots(record):
        img = path.with_name(f"{path.stem}_{stem}.png")
        img.write_bytes(png)
        written.append(img)
        lines += ["", f"## {caption}", "", f"![{caption}]({img.name})"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [path, *written]


_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:60em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .7em}
td:not(:first-child){text-align:right}th{background:#f3f3f3}img{max-width:100%}.partial{color:#b00}"""


def to_html(record: dict, path: str | Path) -> Path:
    """Write one self-contained HTML report (plots embedded as base64 PNG) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header, rows = summary_rows(record)
    e = html.escape
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title(record))}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{e(title(record))}</h1>",
    ]
    if record.get("partial"):
        parts.append("<p class='partial'>This run was interrupted: the figures cover the requests served so far.</p>")
    parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
    parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
    parts.append("</table>")
    for _, caption, png in plots(record):
        parts.append(
            f"<h2>{e(caption)}</h2><img alt='{e(caption)}' src='data:image/png;base64,"
            f"{base64.b64encode(png).decode('ascii')}'>"
        )
    parts.append(
        "<h2>Settings</h2><table>"
        + "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in _settings_lines(record))
        + "</table>"
    )
    parts.append(f"<p>Run record version {record['version']}, created {e(str(record.get('created', '?')))}.</p>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
