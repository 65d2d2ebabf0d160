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


def setting(value: object) -> str:
    """A setting's value for people: True -> "yes", None -> "—", 4096 and 4096.0 -> "4,096", 0.5 -> "0.5",
    "torch.float32" -> "float32", a list -> its items joined by ", ", a dict -> "key: value" pairs."""
    if value is None:
        return NONE
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{int(value):,}" if value.is_integer() and abs(value) < 1e15 else f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(setting(v) for v in value) if value else NONE
    if isinstance(value, dict):
        return ", ".join(f"{setting_name(str(k))}: {setting(v)}" for k, v in value.items()) if value else NONE
    text = str(value)
    return text.removeprefix("torch.") if text.startswith("torch.") else text


def setting_name(key: str) -> str:
    """A setting's key for people: "block_size" -> "block size"."""
    return key.replace("_", " ")


def setting_rows(settings: dict[str, object]) -> list[list[str]]:
    """A settings dict as rows of a two-column table, formatted for people."""
    return [[setting_name(k), setting(v)] for k, v in settings.items()]
