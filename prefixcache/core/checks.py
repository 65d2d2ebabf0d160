"""Argument checks shared by the core: integers (numpy integers welcome, bools refused), numbers, names."""

from __future__ import annotations

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
