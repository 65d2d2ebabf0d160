"""docs/config.md against the code: every CLI option of every command and every argument of the configurable
classes is documented there with its default, and nothing documented there is missing from the code.

The page has one section per command (``## `prefixcache simulate` ``) or class (``## `CacheConfig` ``), each with
one table whose rows start with the option's flags (or name) in backticks, then its default: a value in
backticks, ``none`` or ``required``."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import typer.main

from prefixcache.cli import app

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "config.md"
SECTION = re.compile(r"^## `([^`]+)`\s*$")
SPAN = re.compile(r"`([^`]+)`")


def _sections() -> dict[str, dict[str, str]]:
    """``{section: {option key: default cell}}``; an option key is its flags, sorted and joined by spaces."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        heading = SECTION.match(line)
        if heading:
            current = sections.setdefault(heading.group(1), {})
            continue
        if line.startswith("## "):
            current = None
        if current is None or not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        key = " ".join(sorted(SPAN.findall(cells[0])))
        assert key not in current, f"docs/config.md: {key} documented twice"
        current[key] = cells[1]
    return sections


DOCS = _sections()


def _cli_default(param: Any) -> str:
    """A click parameter's default as the reference writes it."""
    if param.required:
        return "required"
    value = param.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _doc_default(cell: str) -> str:
    """The default a reference cell names: its first backticked value, else its first word."""
    span = SPAN.match(cell)
    return span.group(1) if span else cell.split()[0]


def _same_cli(doc: str, code: str) -> bool:
    try:
        return float(doc.replace(",", "")) == float(code)
    except ValueError:
        return doc == code


def _commands() -> dict[str, Any]:
    group = typer.main.get_command(app)
    commands = {"prefixcache": group}
    commands.update({f"prefixcache {name}": cmd for name, cmd in group.commands.items()})  # type: ignore[attr-defined]
    return commands


def _cli_options(command: Any, documented: dict[str, str] | None = None) -> dict[str, Any]:
    """``{key: click parameter}``: an option's flags sorted and joined, an argument's name or metavar in capitals
    (whichever the reference uses; the name when it uses neither)."""
    options = {}
    for param in command.params:
        if param.param_type_name == "argument":
            names = [n.upper() for n in (param.metavar, param.name) if n]
            key = next((n for n in names if n in (documented or {})), param.name.upper())
        else:
            key = " ".join(sorted([*param.opts, *param.secondary_opts]))
        options[key] = param
    return options


COMMANDS = _commands()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_cli_option_is_documented_with_its_default(name: str) -> None:
    assert name in DOCS, f"docs/config.md has no section for {name}"
    documented = DOCS[name]
    code = _cli_options(COMMANDS[name], documented)
    assert sorted(set(code) - set(documented)) == [], f"{name}: options missing from docs/config.md"
    assert sorted(set(documented) - set(code)) == [], f"{name}: docs/config.md documents options the code lacks"
    for key, param in code.items():
        doc, actual = _doc_default(documented[key]), _cli_default(param)
        assert _same_cli(doc, actual), f"{name} {key}: docs/config.md says default {doc!r}, the code has {actual!r}"


def test_every_command_section_is_a_command() -> None:
    cli_sections = {s for s in DOCS if s.startswith("prefixcache")}
    assert sorted(cli_sections - set(COMMANDS)) == []


def _python_options(target: Any) -> dict[str, str]:
    """``{argument: default as Python source, or 'required'}`` of a dataclass or a class's ``__init__``."""
    if dataclasses.is_dataclass(target):
        out = {}
        for f in dataclasses.fields(target):
            if f.default is not dataclasses.MISSING:
                out[f.name] = repr(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = repr(f.default_factory())
            else:
                out[f.name] = "required"
        return out
    out = {}
    for p in list(inspect.signature(target.__init__).parameters.values())[1:]:  # not self
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            out[f"**{p.name}"] = "—"
        elif p.kind is inspect.Parameter.VAR_POSITIONAL:
            out[f"*{p.name}"] = "—"
        else:
            out[p.name] = "required" if p.default is inspect.Parameter.empty else repr(p.default)
    return out


def _same_python(doc: str, code: str) -> bool:
    if doc in ("required", "—") or code in ("required", "—"):
        return doc == code
    try:
        return bool(ast.literal_eval(doc) == ast.literal_eval(code))
    except (ValueError, SyntaxError):
        return doc == code


def _check_python(name: str, target: Any) -> None:
    assert name in DOCS, f"docs/config.md has no section for {name}"
    code, documented = _python_options(target), DOCS[name]
    assert sorted(set(code) - set(documented)) == [], f"{name}: arguments missing from docs/config.md"
    assert sorted(set(documented) - set(code)) == [], f"{name}: docs/config.md documents arguments the code lacks"
    for key, actual in code.items():
        doc = _doc_default(documented[key])
        assert _same_python(doc, actual), f"{name}.{key}: docs/config.md says default {doc!r}, the code has {actual!r}"


def test_cache_config() -> None:
    from prefixcache import CacheConfig

    _check_python("CacheConfig", CacheConfig)


def test_engine_classes() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from engine import ModelRuntime, PrefixCachedModel, RuntimeConfig
    from engine.batching.scheduler import SchedulerConfig

    _check_python("PrefixCachedModel", PrefixCachedModel)
    _check_python("SchedulerConfig", SchedulerConfig)
    _check_python("RuntimeConfig", RuntimeConfig)
    _check_python("ModelRuntime", ModelRuntime)


def test_lm_eval_model() -> None:
    pytest.importorskip("lm_eval")
    from engine.lm_eval_model import PrefixCacheLM

    _check_python("PrefixCacheLM", PrefixCacheLM)


def test_every_section_is_checked() -> None:
    """A section nobody checks would drift: each one is a command or a class above."""
    classes = {"PrefixCachedModel", "CacheConfig", "SchedulerConfig", "PrefixCacheLM", "RuntimeConfig", "ModelRuntime"}
    assert sorted(set(DOCS) - set(COMMANDS) - classes) == []


def test_the_checks_catch_drift() -> None:
    """The comparisons themselves: a wrong default or a missing flag is noticed."""
    serve = _cli_options(COMMANDS["prefixcache serve"])
    assert not _same_cli("8001", _cli_default(serve["--port"]))
    assert _same_cli("10,000", "10000.0")
    assert "--no-progress --progress" in _cli_options(COMMANDS["prefixcache simulate"])
    assert not _same_python("'fifo'", "'lru'") and _same_python("True", "True")
