"""A YAML loader that remembers lines, and a context that turns problems into InputError with file:line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from prefixcache.core.errors import InputError, shown

MAX_FLOW_DEPTH = 100  # [ and { nested deeper are refused: PyYAML's scanner slows down with the square of it


class LineLoader(yaml.SafeLoader):
    """SafeLoader whose mappings remember their line (``LineMap.line``) and each key's line, and which refuses
    flow collections nested deeper than MAX_FLOW_DEPTH (a 100 kB line of ``[`` would scan for hours)."""

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        if self.flow_level >= MAX_FLOW_DEPTH:
            mark = self.get_mark()
            raise InputError(
                f"malformed YAML: nested too deeply (over {MAX_FLOW_DEPTH} levels of [ or {{)", None, mark.line + 1
            )
        super().fetch_flow_collection_start(TokenClass)


class LineMap(dict[Any, Any]):
    line: int = 0
    key_lines: dict[Any, int]


def _construct_map(loader: LineLoader, node: yaml.MappingNode) -> LineMap:
    loader.flatten_mapping(node)
    m = LineMap()
    m.line = node.start_mark.line + 1
    m.key_lines = {}
    for knode, vnode in node.value:
        key = loader.construct_object(knode, deep=True)
        if not isinstance(key, (str, int, float, bool)) or key is None:
            raise InputError(f"mapping keys must be plain scalars, got {shown(key)}", None, knode.start_mark.line + 1)
        if key in m:
            raise InputError(f"duplicate key {shown(key)}", None, knode.start_mark.line + 1)
        m[key] = loader.construct_object(vnode, deep=True)
        m.key_lines[key] = knode.start_mark.line + 1
    return m


LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_map)


class YamlContext:
    """Where we are while validating: the file, for error messages."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, message: str, line: int | None = None) -> InputError:
        return InputError(message, self.path, line)

    def check_keys(self, m: Any, known: set[str], what: str, line: int | None) -> LineMap:
        if not isinstance(m, dict):
            raise self.fail(f"{what} must be a mapping, got {type(m).__name__}", line)
        for k in m:
            if k not in known:
                kl = getattr(m, "key_lines", {}).get(k, line)
                raise self.fail(f"unknown key {shown(k)} in {what}; known: {', '.join(sorted(known))}", kl)
        return m  # type: ignore[return-value]

    def line_of(self, m: Any, key: str | None = None) -> int | None:
        if key is not None and hasattr(m, "key_lines") and key in m.key_lines:
            return int(m.key_lines[key])
        line = getattr(m, "line", None)
        return None if line is None else int(line)


def pos_int(ctx: YamlContext, v: Any, what: str, line: int | None, minimum: int = 1, maximum: int | None = None) -> int:
    """``v`` if it is an int in [minimum, maximum]; else InputError naming ``what`` and the line."""
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ctx.fail(f"{what} must be an integer >= {minimum}, got {shown(v)}", line)
    if maximum is not None and v > maximum:
        raise ctx.fail(f"{what} must be at most {maximum:,}, got {v:,}"[:200], line)
    return v


def scalar_text(ctx: YamlContext, v: Any, what: str, line: int | None) -> str:
    """A name-like value as text: a string or a number (``conversation: 7``); InputError for lists, mappings,
    null (so that an alias bomb is never turned into a string)."""
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise ctx.fail(f"{what} must be a string, got {shown(v)}", line)
    return str(v)
