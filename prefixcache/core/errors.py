"""Errors every layer may raise: InputError for bad user input."""

from __future__ import annotations

from pathlib import Path


class InputError(ValueError):
    """Bad user input (file, YAML, JSON line, option). The message names where: ``file:line: what``."""

    def __init__(self, message: str, path: str | Path | None = None, line: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.message, self.path, self.line = message, path, line
