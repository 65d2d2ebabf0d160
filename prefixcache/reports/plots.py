"""matplotlib helpers shared by the reports: a figure on the Agg backend (no display) and PNG bytes of it.

matplotlib is imported only when a plot is drawn, so commands that write no plot do not pay for it.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any


def new_figure(width: float = 7.5, height: float = 3.8, dpi: int = 100) -> tuple[Any, Any]:
    """A (figure, axes) pair with a light grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height), dpi=dpi)
    ax.grid(True, alpha=0.3)
    return fig, ax


def png(fig: Any) -> bytes:
    """The figure as PNG bytes; closes it."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


# one (line style, marker) per series of a plot, so that series that coincide stay told apart
STYLES = (("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ((0, (5, 1, 1, 1)), "v"), ((0, (1, 1)), "P"))
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


@dataclass(frozen=True)
class Series:
    """One drawn series: what a plot shows, as data (tests read it; ``draw`` puts it on axes).

    ``line``: a line style, or None for markers only; ``marker`` drawn at about a dozen points of a line (every
    point without a line); ``faint``: a light, thin line (a moving window under its cumulative line)."""

    label: str | None
    x: tuple[float, ...]
    y: tuple[float, ...]
    color: str
    line: Any = "-"
    marker: str | None = None
    faint: bool = False
    zorder: float = 2.0
    mark_from: float = 0.0  # where along the line its markers start, as a share of their spacing (staggered)
    size: float = 4.0  # marker size: series drawn later get smaller ones, so that coinciding markers show as rings


def draw(ax: Any, series: list[Series]) -> None:
    """Put every series on ``ax`` (in order; ``zorder`` decides what lies on top)."""
    for s in series:
        kw: dict[str, Any] = {"color": s.color, "label": s.label, "zorder": s.zorder}
        if s.line is None:
            kw.update(ls="none", marker=s.marker or ".", ms=s.size)
        else:
            kw.update(ls=s.line, lw=0.8 if s.faint else 1.6, alpha=0.3 if s.faint else 1.0)
            if s.marker is not None:
                step = max(1, len(s.x) // 12)
                kw.update(marker=s.marker, ms=s.size, markevery=(int(s.mark_from * step) % step, step))
        ax.plot(s.x, s.y, **kw)
