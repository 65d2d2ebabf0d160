"""Argument checks shared by the core: integers (numpy integers welcome, bools refused), numbers, names, sizes."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np


def check_int(value: Any, name: str, *, minimum: int | None = None, type_error: type[Exception] = TypeError) -> int:
    """``value`` as a Python int. Accepts ``int`` and numpy integers, refuses bools and anything else with
    ``type_error``; raises ValueError when below ``minimum``. The message names ``name`` and the value."""
    if type(value) is int:  # the common case, checked first
        out = value
    elif isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise type_error(f"{name} must be an int, got {type(value).__name__} {value!r}")
    else:
        out = int(value)
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {out}")
    return out


def check_str(value: Any, name: str) -> str:
    """``value`` if it is a str; TypeError naming ``name`` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(value: Any, where: str = "size") -> int:
    """A size in bytes: an int > 0 or a string like ``50G``, ``512MiB``, ``1.5T`` (K, M, G, T are powers of
    1024). Raises ValueError naming ``where``."""
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected a size in bytes such as 50G, got {value!r}")
    if isinstance(value, int):
        number = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9][0-9_,]*(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", str(value).lower())
        if m is None:
            raise ValueError(f"{where}: expected a size in bytes such as 50G or 512M, got {value!r}")
        number = float(m.group(1).replace("_", "").replace(",", "")) * _UNITS[m.group(2)]
    if not math.isfinite(number) or number < 1:
        raise ValueError(f"{where}: must be at least 1 byte, got {value!r}")
    return int(number)
