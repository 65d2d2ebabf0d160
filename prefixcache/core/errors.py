"""Errors every layer may raise: InputError for bad user input, and :func:`shown` to quote a bad value."""

from __future__ import annotations

import reprlib
from pathlib import Path


class InputError(ValueError):
    """Bad user input (file, YAML, JSON line, option). The message names where: ``file:line: what``."""

    def __init__(self, message: str, path: str | Path | None = None, line: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.message, self.path, self.line = message, path, line


class _Brief(reprlib.Repr):
    """reprlib's bounded repr, also for dict and list subclasses (e.g. YAML mappings that remember lines)."""

    def repr1(self, x: object, level: int) -> str:
        if isinstance(x, dict) and type(x) is not dict:
            return self.repr_dict(x, level)
        if isinstance(x, list) and type(x) is not list:
            return self.repr_list(x, level)
        return super().repr1(x, level)


_BRIEF = _Brief()
_BRIEF.maxlevel, _BRIEF.maxlist, _BRIEF.maxdict, _BRIEF.maxtuple, _BRIEF.maxset = 2, 5, 3, 5, 5
_BRIEF.maxstring, _BRIEF.maxlong, _BRIEF.maxother = 60, 40, 60


def shown(value: object) -> str:
    """A short repr of a user's value for an error message: bounded in size and time, even for a YAML
    alias bomb (a list that refers to itself a billion times) or a 4000-digit integer."""
    text = _BRIEF.repr(value)
    return text if len(text) <= 120 else text[:119] + "…"
