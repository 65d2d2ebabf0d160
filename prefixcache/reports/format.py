"""Number formatting shared by every report (terminal, HTML, Markdown). "—" stands for "not measured"."""

from __future__ import annotations

NONE = "—"


def pct(x: float | None, digits: int = 2) -> str:
    """0.1234 -> "12.34%"."""
    return NONE if x is None else f"{100 * x:.{digits}f}%"


def integer(x: int | None) -> str:
    """1234567 -> "1,234,567"."""
    return NONE if x is None else f"{x:,}"


def ms(x: float | None) -> str:
    """Seconds as milliseconds: 0.0123 -> "12.3 ms"."""
    return NONE if x is None else f"{1000 * x:.1f} ms"


def seconds(x: float | None) -> str:
    """1.234 -> "1.23 s"."""
    return NONE if x is None else f"{x:.2f} s"


def times(x: float | None) -> str:
    """A ratio: 3.1 -> "3.10×"."""
    return NONE if x is None else f"{x:.2f}×"


def short(n: int | None) -> str:
    """A count with a unit prefix: 1_500_000 -> "1.5M"."""
    if n is None:
        return NONE
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div * 0.9995:  # 999,936 -> "1M", not "1e+03k" (3 significant digits)
            return f"{n / div:.3g}{unit}"
    return str(n)


def gb(x: float | None) -> str:
    """Decimal gigabytes, 3 significant digits below 1,000."""
    return NONE if x is None else (f"{x:.3g}" if x < 1000 else f"{x:,.0f}")
