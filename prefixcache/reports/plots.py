"""matplotlib helpers shared by the reports: a figure on the Agg backend (no display) and PNG bytes of it.

matplotlib is imported only when a plot is drawn, so commands that write no plot do not pay for it.
"""

from __future__ import annotations

import io
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
