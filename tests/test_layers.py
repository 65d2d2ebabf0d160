"""The layering of prefixcache/, enforced for every module by walking its imports (AST, no import needed).

core <- workload <- sim <- reports <- cli: a layer imports only the layers before it, the third-party
packages listed for it, and the standard library. Nothing under prefixcache/ imports torch or transformers;
the CLI may import ``engine`` (and the server's packages, lm-eval) only lazily, inside a function. Module-level
imports between prefixcache modules form no cycle. ``engine`` uses prefixcache's layers below the CLI and never
``prefixcache.cli``, not even lazily (the arrows go one way: the CLI calls the engine, never the reverse).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "prefixcache"
ORDER = ["core", "workload", "sim", "reports", "cli"]
THIRD_PARTY = {
    "core": {"numpy", "xxhash", "sortedcontainers"},
    "workload": {"yaml", "orjson"},
    "sim": set(),
    "reports": {"rich", "matplotlib", "orjson"},
    "cli": {"typer", "rich", "click"},
}
LAZY_ONLY = {"cli": {"engine", "fastapi", "uvicorn", "ray", "httpx", "openai", "prometheus_client", "lm_eval"}}
NEVER = {"torch", "transformers", "tokenizers"}
TOP = {"__init__.py": "cli", "__main__.py": "cli", "_version.py": "core"}  # what the top-level files may use


def layer_of(module_path: Path) -> str:
    rel = module_path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else TOP[rel.name]


def allowed(layer: str) -> tuple[set[str], set[str]]:
    """(prefixcache layers, third-party top-level packages) a module of ``layer`` may import."""
    k = ORDER.index(layer)
    layers = set(ORDER[: k + 1])
    third = set().union(*(THIRD_PARTY[x] for x in ORDER[: k + 1]))
    return layers, third


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, modname: str, is_package: bool) -> list[tuple[str, bool, int]]:
    """(imported module, at module level?, line) for every import in ``source``."""
    tree = ast.parse(source)
    out: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, top, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = modname.split(".") if is_package else modname.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                if child.module is None or child.level:
                    out.extend((f"{mod}.{a.name}", top, child.lineno) for a in child.names)
                else:
                    out.append((mod, top, child.lineno))
                    out.extend((f"{mod}.{a.name}", top, child.lineno) for a in child.names if mod == "prefixcache")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # annotations only
            visit(child, nested)

    visit(tree, True)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def violations(path: Path, source: str | None = None) -> list[str]:
    """Every import of the module at ``path`` that breaks the rules in the module docstring."""
    layer = layer_of(path)
    layers, third = allowed(layer)
    lazy = LAZY_ONLY.get(layer, set())
    name = module_name(path)
    text = path.read_text(encoding="utf-8") if source is None else source
    bad = []
    for mod, top, line in imports(text, name, path.name == "__init__.py"):
        root = mod.split(".")[0]
        where = f"{path.relative_to(ROOT)}:{line}: {mod}"
        if root in NEVER:
            bad.append(f"{where} (prefixcache never imports {root})")
        elif root == "prefixcache":
            parts = mod.split(".")
            target = parts[1] if len(parts) > 1 else "cli"
            target = target if target in ORDER else "core"  # prefixcache._version / top-level names
            if target not in layers:
                bad.append(f"{where} ({layer} may not import {target})")
        elif root in lazy:
            if top:
                bad.append(f"{where} ({root} only inside a function, lazily)")
        elif root in sys.stdlib_module_names or root == "__future__":
            continue
        elif root not in third:
            bad.append(f"{where} ({layer} may not import the third-party package {root})")
    return bad


MODULES = sorted(PKG.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_module_respects_the_layers(path):
    assert violations(path) == []


def test_every_module_sits_in_a_layer():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert set(top) <= set(TOP), f"modules outside a layer: {sorted(set(top) - set(TOP))}"
    assert {p.relative_to(PKG).parts[0] for p in MODULES if len(p.relative_to(PKG).parts) > 1} <= set(ORDER)


def test_no_import_cycle_between_modules():
    names = {module_name(p): p for p in MODULES}
    graph: dict[str, set[str]] = {n: set() for n in names}
    for n, p in names.items():
        for mod, top, _ in imports(p.read_text(encoding="utf-8"), n, p.name == "__init__.py"):
            if not top:
                continue
            for cand in (mod, mod.rsplit(".", 1)[0]):
                if cand in names and cand != n and not (p.name == "__init__.py" and cand.startswith(n + ".")):
                    graph[n].add(cand)
                    break
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(v: str) -> None:
        state[v] = 1
        stack.append(v)
        for w in graph[v]:
            if state.get(w) == 1:
                cycle = stack[stack.index(w) :] + [w]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if w not in state:
                dfs(w)
        stack.pop()
        state[v] = 2

    for v in sorted(graph):
        if v not in state:
            dfs(v)


@pytest.mark.parametrize(
    ("where", "source", "message"),
    [
        ("core/x.py", "from prefixcache.sim.replay import replay\n", "core may not import sim"),
        ("workload/x.py", "import prefixcache.reports.record\n", "workload may not import reports"),
        ("sim/x.py", "from prefixcache.cli import app\n", "sim may not import cli"),
        ("core/x.py", "import yaml\n", "third-party package yaml"),
        ("sim/x.py", "def f():\n    import torch\n", "never imports torch"),
        ("cli/x.py", "import engine.replay\n", "only inside a function"),
        ("cli/x.py", "from lm_eval.__main__ import cli_evaluate\n", "only inside a function"),
        ("reports/x.py", "from ..cli import console\n", "reports may not import cli"),
    ],
)
def test_the_checker_catches_broken_rules(where, source, message):
    found = violations(PKG / where, source)
    assert any(message in v for v in found), found


def test_the_checker_allows_lazy_engine_in_cli():
    assert violations(PKG / "cli" / "x.py", "def f():\n    from engine.replay import replay\n") == []


ENGINE = ROOT / "engine"
ENGINE_MODULES = sorted(ENGINE.rglob("*.py"))


def engine_violations(path: Path, source: str | None = None) -> list[str]:
    """Every import of the engine module at ``path`` that reaches up into ``prefixcache.cli``, at any depth."""
    text = path.read_text(encoding="utf-8") if source is None else source
    name = module_name(path)
    bad = []
    for mod, _top, line in imports(text, name, path.name == "__init__.py"):
        if mod == "prefixcache.cli" or mod.startswith("prefixcache.cli."):
            bad.append(f"{path.relative_to(ROOT)}:{line}: {mod} (engine may not import prefixcache.cli)")
    return bad


@pytest.mark.parametrize("path", ENGINE_MODULES, ids=lambda p: str(p.relative_to(ENGINE)))
def test_engine_never_imports_the_cli(path):
    assert engine_violations(path) == []


@pytest.mark.parametrize(
    "source",
    [
        "from prefixcache.cli import console\n",
        "def f():\n    from prefixcache.cli import console\n",
        "import prefixcache.cli.console\n",
        "def f():\n    from prefixcache.cli.app import app\n",
    ],
)
def test_the_engine_checker_catches_the_cli(source):
    assert engine_violations(ENGINE / "serve" / "x.py", source) != []


def test_the_engine_checker_allows_the_layers_below_the_cli():
    source = "from prefixcache.sim.causes import Fork\nfrom prefixcache.reports.record import TOP_SITES\n"
    assert engine_violations(ENGINE / "x.py", source) == []
