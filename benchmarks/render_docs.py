"""Render the docs' measured figures from ``benchmarks/results/*.json``.

    python benchmarks/render_docs.py            # rewrite the rendered docs (below) from their templates
    python benchmarks/render_docs.py --check    # change nothing; exit 1 naming every figure a doc has wrong

The prose lives in ``docs/templates/``; every figure in it names the JSON value it shows, so a doc edited by hand
or a JSON rerun without re-rendering fails ``--check`` (CI runs it, and so does tests/test_docs.py). Outputs:
``docs/benchmarks.md`` (whole), and the regions between ``<!-- begin NAME ... -->`` and ``<!-- end NAME -->`` in
README.md (the headline results), docs/tiers-simulation.md (the shared-tier cluster table) and docs/tiers.md (its
measured figures), docs/hybrid.md, docs/compatibility.md, docs/multimodal.md, docs/serving.md and docs/sliding.md: ``TARGETS``.

Template syntax:

    {{ EXPR | FORMAT }}        a figure. EXPR: SOURCE:PATH references, numbers, + - * / ( ), and min max sum len
                               mean median (...) over values or lists. SOURCE is a file's stem in benchmarks/results
                               (or a ``let`` name); PATH is keys joined by '.', with [N] an index, [k=v,...] the one
                               list item whose fields equal those (quote a value with "..." if it holds , ] or "),
                               [*k=v,...] or [*] every matching item: a list, to which the keys after it and
                               arithmetic apply item by item (two lists pair up in order), and which a selector
                               after it narrows down (``rows[*trace=x][router=y]``: the one row with both).
    {{? EXPR | FORMAT }}       a figure its JSON may not hold yet: rendered "(not yet measured: rerun `COMMAND`)".
    {%? SOURCE:PATH %}...{% end %}      text (lines too) rendered only if the JSON holds PATH (not null), else the
                               same marker once: for a sentence of figures a rerun will add.
    {{ load SOURCE }}          the load average of the machine during the run that wrote SOURCE, or "not recorded".
    {% let NAME = SOURCE:PATH %}        an abbreviation for the rest of the template (a line of its own).
    {% rerun SOURCE: COMMAND %}         the command that rewrites SOURCE (a line of its own; shared by all templates).

FORMAT: fN (N decimals, thousands separators: 4,105), xN (the same and "x": 17.9x), pctN (a fraction as a percent:
83.4%), msN (seconds as milliseconds), eN (2.7e-5), yes (true/false as yes/no), str; none: integers as 4,105,
strings as they are.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Target:
    template: str  # under docs/templates
    output: str  # relative to the repository root
    region: str | None = None  # None: the whole file


TARGETS = (
    Target("benchmarks.md", "docs/benchmarks.md"),
    Target("readme_results.md", "README.md", "headline-results"),
    Target("tiers_simulation_cluster.md", "docs/tiers-simulation.md", "cluster-shared-tier"),
    Target("tiers_measured.md", "docs/tiers.md", "tier-measured"),
    Target("hybrid_measured.md", "docs/hybrid.md", "hybrid-measured"),
    Target("compat_measured.md", "docs/compatibility.md", "compat-measured"),
    Target("multimodal_measured.md", "docs/multimodal.md", "multimodal-measured"),
    Target("soak_measured.md", "docs/serving.md", "soak-measured"),
    Target("sliding_measured.md", "docs/sliding.md", "sliding-measured"),
)

# Where a JSON keeps the 1-minute load average before and after its run: _meta.py's record first, then the
# layouts benchmarks (and the peer harnesses) wrote before it.
LOAD_KEYS = (
    ("meta.load_before", "meta.load_after"),
    ("load_average.before", "load_average.after"),
    ("host.load_before", "host.load_after"),
    ("load_before", "load_after"),
    ("env.loadavg_start", "env.loadavg_end"),
)


class TemplateError(Exception):
    """A template names something the JSON cannot give, or is malformed."""


class Missing(TemplateError):
    """The JSON lacks a key the template names (a figure awaiting a rerun, when marked ``{{? ...}}``)."""

    source = ""  # the JSON's stem, set where the reference is resolved


# ---- paths -----------------------------------------------------------------------------------------------------


def _split_conds(text: str) -> list[tuple[str, str]]:
    """``k=v,k="v, w"`` -> [(k, v), (k, "v, w")]."""
    out, i = [], 0
    while i < len(text):
        m = re.compile(r'\s*(\w+)=("([^"]*)"|[^,]*)\s*(,|$)').match(text, i)
        if not m or m.end() == i:
            raise TemplateError(f"bad selector [{text}]")
        out.append((m.group(1), m.group(3) if m.group(3) is not None else m.group(2).strip()))
        i = m.end()
    return out


def _segments(path: str) -> Iterator[tuple[str, Any]]:
    """The steps of ``path``: ("key", name), ("index", n), ("one", conds), ("all", conds)."""
    i = 0
    while i < len(path):
        if path[i] == ".":
            i += 1
        elif path[i] == "[":
            j, quoted = i + 1, False
            while j < len(path) and (quoted or path[j] != "]"):
                quoted ^= path[j] == '"'
                j += 1
            inner = path[i + 1 : j]
            i = j + 1
            if re.fullmatch(r"-?\d+", inner):
                yield "index", int(inner)
            elif inner == "*":
                yield "all", []
            elif inner.startswith("*"):
                yield "all", _split_conds(inner[1:])
            else:
                yield "one", _split_conds(inner)
        else:
            m = re.compile(r"\w+").match(path, i)
            if not m:
                raise TemplateError(f"bad path {path!r} at {path[i:]!r}")
            yield "key", m.group()
            i = m.end()


def _matches(item: Any, conds: list[tuple[str, str]]) -> bool:
    if not isinstance(item, dict):
        return False
    for key, want in conds:
        if key not in item:
            return False
        got = item[key]
        if isinstance(got, (int, float)) and not isinstance(got, bool) and re.fullmatch(r"-?[\d.]+(e-?\d+)?", want):
            if float(got) != float(want):
                return False
        elif str(got) != want:
            return False
    return True


def _step(value: Any, kind: str, arg: Any, where: str) -> Any:
    if value is None:
        raise Missing(f"{where}: null")
    if kind == "all" and isinstance(value, dict):  # [*] over an object: its values, in order
        value = list(value.values())
    if kind == "key":
        if not isinstance(value, dict) or arg not in value:
            raise Missing(f"{where}: no key {arg!r}")
        return value[arg]
    if not isinstance(value, list):
        raise TemplateError(f"{where}: not a list")
    if kind == "index":
        if not -len(value) <= arg < len(value):
            raise Missing(f"{where}: no item [{arg}]")
        return value[arg]
    found = [v for v in value if _matches(v, arg)]
    if kind == "all":
        return found
    if len(found) != 1:
        raise Missing(f"{where}: {len(found)} items match {arg} (one expected)")
    return found[0]


def resolve(doc: Any, path: str, where: str) -> Any:
    """The value at ``path`` in ``doc`` (a list after a [*...] step). Changes nothing."""
    value, spread = doc, False
    for kind, arg in _segments(path):
        if spread and kind == "key":  # a key after [*...] applies to every item
            value = [_step(v, kind, arg, where) for v in value]
        else:  # a selector after [*...] narrows the matches down
            value = _step(value, kind, arg, where)
            spread = kind == "all" or (spread and kind not in ("one", "index"))
    return value


# ---- expressions -----------------------------------------------------------------------------------------------

FUNCTIONS: dict[str, Callable[[list[float]], float]] = {
    "min": min,
    "max": max,
    "sum": sum,
    "len": len,
    "mean": statistics.mean,
    "median": statistics.median,
}
OPS: dict[str, Callable[[float, float], float]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
}
TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d+)?(?:e-?\d+)?)(?![\w:])|(?P<func>[a-z]+)\(|(?P<ref>\w+:)|(?P<op>[-+*/(),]))"
)


def _apply(op: str, a: Any, b: Any, where: str) -> Any:
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            raise TemplateError(f"{where}: lists of {len(a)} and {len(b)} items")
        return [OPS[op](x, y) for x, y in zip(a, b)]
    if isinstance(a, list):
        return [OPS[op](x, b) for x in a]
    if isinstance(b, list):
        return [OPS[op](a, y) for y in b]
    return OPS[op](a, b)


@dataclass
class Expr:
    """A recursive-descent evaluator of one figure's expression over the loaded JSONs."""

    text: str
    load: Callable[[str], Any]
    pos: int = 0

    def value(self) -> Any:
        out = self.sum()
        if self.text[self.pos :].strip():
            raise TemplateError(f"{self.text!r}: unexpected {self.text[self.pos :]!r}")
        return out

    def _peek_op(self, ops: str) -> str | None:
        m = re.compile(r"\s*([-+*/])").match(self.text, self.pos)
        return m.group(1) if m and m.group(1) in ops else None

    def _expect(self, ch: str) -> None:
        m = re.compile(r"\s*" + re.escape(ch)).match(self.text, self.pos)
        if not m:
            raise TemplateError(f"{self.text!r}: expected {ch!r} at {self.text[self.pos :]!r}")
        self.pos = m.end()

    def sum(self) -> Any:
        out = self.product()
        while op := self._peek_op("+-"):
            self._expect(op)
            out = _apply(op, out, self.product(), self.text)
        return out

    def product(self) -> Any:
        out = self.atom()
        while op := self._peek_op("*/"):
            self._expect(op)
            out = _apply(op, out, self.atom(), self.text)
        return out

    def atom(self) -> Any:
        m = TOKEN.match(self.text, self.pos)
        if not m:
            raise TemplateError(f"{self.text!r}: unexpected {self.text[self.pos :]!r}")
        self.pos = m.end()
        if m.group("num"):
            return float(m.group("num"))
        if m.group("op") == "(":
            out = self.sum()
            self._expect(")")
            return out
        if m.group("func"):
            name = m.group("func")
            if name not in FUNCTIONS:
                raise TemplateError(f"{self.text!r}: no function {name}()")
            args = [self.sum()]
            while re.compile(r"\s*,").match(self.text, self.pos):
                self._expect(",")
                args.append(self.sum())
            self._expect(")")
            flat = [x for a in args for x in (a if isinstance(a, list) else [a])]
            return len(flat) if name == "len" else FUNCTIONS[name](flat)
        if m.group("ref"):
            return self.reference(m.group("ref")[:-1])
        raise TemplateError(f"{self.text!r}: unexpected {m.group().strip()!r}")

    def reference(self, source: str) -> Any:
        start = self.pos
        depth, quoted = 0, False
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if quoted:
                quoted = ch != '"'
            elif ch == '"':
                quoted = True
            elif ch == "[":
                depth += 1
            elif ch == "]":
                depth -= 1
            elif depth == 0 and not (ch.isalnum() or ch in "._"):
                break
            self.pos += 1
        path = self.text[start : self.pos]
        try:
            return resolve(self.load(source), path, f"{source}:{path}")
        except Missing as e:
            e.source = source
            raise


# ---- formats ---------------------------------------------------------------------------------------------------


def _number(value: Any, spec: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TemplateError(f"format {spec} needs a number, got {value!r}")
    return value


def fmt(value: Any, spec: str | None) -> str:
    """``value`` written as the docs write it (see the module docstring). Changes nothing."""
    if isinstance(value, list):
        return ", ".join(fmt(v, spec) for v in value)
    if spec == "str":
        return str(value)
    if spec == "yes":
        if not isinstance(value, bool):
            raise TemplateError(f"format yes needs true or false, got {value!r}")
        return "yes" if value else "no"
    if spec is None:
        if isinstance(value, str):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value:,}"
        raise TemplateError(f"{value!r} needs a format")
    m = re.fullmatch(r"(f|x|pct|ms|e)(\d)", spec)
    if not m:
        raise TemplateError(f"unknown format {spec!r}")
    kind, n = m.group(1), int(m.group(2))
    v = _number(value, spec)
    if kind == "e":
        mantissa, exp = f"{v:.{n}e}".split("e")
        return f"{mantissa}e{int(exp)}"
    scaled = {"pct": 100 * v, "ms": 1000 * v}.get(kind, v)
    return f"{scaled:,.{n}f}" + {"x": "x", "pct": "%"}.get(kind, "")


# ---- templates -------------------------------------------------------------------------------------------------

FIGURE = re.compile(r"\{\{(\?)?\s*(.*?)\s*\}\}")
LET = re.compile(r"^\{% let (\w+) = (\w+):(.+?) %\}$")
GUARD = re.compile(r"\{%\? (\w+):(.+?) %\}(.*?)\{% end %\}", re.S)
RERUN = re.compile(r"^\{% rerun (\w+): (.+?) %\}$")


@dataclass
class Figure:
    line: int  # in the rendered text, from 0
    expr: str
    text: str


@dataclass
class Rendered:
    lines: list[str]
    figures: list[Figure] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)  # "{{? ...}}" figures the JSON does not hold yet


class Results:
    """The JSONs under benchmarks/results, loaded once each; a top-level list is read as ``{"rows": [...]}``."""

    def __init__(self, folder: Path = RESULTS) -> None:
        self.folder = folder
        self.docs: dict[str, Any] = {}

    def __call__(self, source: str) -> Any:
        if source not in self.docs:
            path = self.folder / f"{source}.json"
            if not path.exists():
                raise Missing(f"no {path.relative_to(ROOT)}")
            doc = json.loads(path.read_text(encoding="utf-8"))
            self.docs[source] = {"rows": doc} if isinstance(doc, list) else doc
        return self.docs[source]


def reruns(templates: list[str]) -> dict[str, str]:
    """Every ``{% rerun SOURCE: COMMAND %}`` of the templates, by source."""
    return {m.group(1): m.group(2) for text in templates for line in text.splitlines() if (m := RERUN.match(line))}


def load_line(source: str, results: Results, rerun: dict[str, str]) -> str:
    """One sentence: the machine's 1-minute load average before and after the run that wrote ``source``."""
    doc = results(source)
    for before_key, after_key in LOAD_KEYS:
        got = []
        for key in (before_key, after_key):
            try:
                got.append(resolve(doc, key, source)[0])
            except (Missing, TemplateError, TypeError, IndexError):
                got.append(None)
        if got != [None, None]:
            parts = [f"{v:.2f} {when}" for v, when in zip(got, ("before the run", "after")) if v is not None]
            if got[0] is None:
                parts = [f"{got[1]:.2f} at the end of the run"]
            return f"Load average (1 min) of the machine: {', '.join(parts)} (`{source}.json`)."
    hint = f" (rerun `{rerun[source]}` to record it)" if source in rerun else ""
    return f"Load average of the machine: not recorded in `{source}.json`{hint}."


def render(text: str, results: Results, rerun: dict[str, str]) -> Rendered:
    """The template ``text`` with every figure filled in from ``results``. Changes nothing on disk."""
    out = Rendered([])
    aliases: dict[str, str] = {}

    def guard(m: re.Match[str]) -> str:
        source, path = m.group(1), m.group(2)
        try:
            if resolve(results(source), path, f"{source}:{path}") is not None:
                return m.group(3)
        except Missing:
            pass
        if source not in rerun:
            raise TemplateError(f"{{%? {source}:{path} %}}: no {{% rerun {source}: ... %}}")
        out.pending.append(f"{source}:{path}  <-  {rerun[source]}")
        return f"(not yet measured: rerun `{rerun[source]}`)"

    text = GUARD.sub(guard, text)

    def expand(expr: str) -> str:
        def one(m: re.Match[str]) -> str:
            name, path = m.group(1), m.group(2)
            if name not in aliases:
                return m.group()
            base = aliases[name]
            return base + ("" if not path or path.startswith("[") else ".") + path

        return re.sub(r"(?<![\w\"])(\w+):([\w.\[\]]*)", one, expr)

    for line in text.splitlines():
        if m := LET.match(line):
            aliases[m.group(1)] = expand(f"{m.group(2)}:{m.group(3)}")
            continue
        if RERUN.match(line):
            continue

        def figure(m: re.Match[str], line_no: int = len(out.lines)) -> str:
            pending, body = m.group(1) == "?", m.group(2)
            if body.startswith("load "):
                return load_line(body[5:].strip(), results, rerun)
            expr, _, spec = body.partition(" | ")
            expr = expand(expr.strip())
            try:
                value = Expr(expr, results).value()
                if value is None:
                    raise Missing(f"{expr}: null")
                shown = fmt(value, spec.strip() or None)
            except Missing as e:
                if not pending:
                    raise TemplateError(f"{{{{ {body} }}}}: {e}") from e
                if e.source not in rerun:
                    raise TemplateError(f"{{{{? {body} }}}}: no {{% rerun {e.source}: ... %}}") from e
                out.pending.append(f"{body}  <-  {rerun[e.source]}")
                shown = f"(not yet measured: rerun `{rerun[e.source]}`)"
            except TemplateError as e:
                raise TemplateError(f"{{{{ {body} }}}}: {e}") from e
            out.figures.append(Figure(line_no, body, shown))
            return shown

        out.lines.extend(FIGURE.sub(figure, line).split("\n"))  # a figure may be lines (a table from its JSON)
    return out


def region(text: str, name: str) -> tuple[int, int] | None:
    """Line numbers (from 0) of the first and one past the last line between the markers of ``name``."""
    lines = text.splitlines()
    begin = [i for i, ln in enumerate(lines) if re.match(rf"<!-- begin {re.escape(name)}\b.*-->$", ln)]
    end = [i for i, ln in enumerate(lines) if ln == f"<!-- end {name} -->"]
    if len(begin) != 1 or len(end) != 1 or end[0] < begin[0]:
        return None
    return begin[0] + 1, end[0]


def _section(lines: list[str], upto: int) -> str:
    heads = [ln.lstrip("#").strip() for ln in lines[: upto + 1] if ln.startswith("#")]
    return heads[-1] if heads else "(top)"


def differences(where: str, actual: list[str], want: Rendered, above: list[str]) -> list[str]:
    """One message per figure (or, where no figure explains it, per line) that ``actual`` has wrong; ``above``:
    the file's lines before the rendered part (for section names)."""
    out = []
    ops = difflib.SequenceMatcher(None, actual, want.lines, autojunk=False).get_opcodes()
    for tag, a0, a1, b0, b1 in ops:
        if tag == "equal":
            continue
        pairs = list(zip(range(a0, a1), range(b0, b1))) if a1 - a0 == b1 - b0 else []
        for a, b in pairs:
            section = _section(above + want.lines, len(above) + b)
            wrong = [f for f in want.figures if f.line == b and f.text not in actual[a]]
            for f in wrong:
                out.append(
                    f"{where} § {section}: {{{{ {f.expr} }}}} is {f.text!r} in the JSON; the doc has: {actual[a]!r}"
                )
            if not wrong:
                out.append(f"{where} § {section}: the doc has {actual[a]!r} where the template gives {want.lines[b]!r}")
        if not pairs:
            section = _section(above + want.lines, len(above) + b0)
            if b1 > b0:
                out.append(f"{where} § {section}: {b1 - b0} line(s) missing, from {want.lines[b0]!r}")
            if a1 > a0:
                out.append(f"{where} § {section}: {a1 - a0} line(s) not in the template, from {actual[a0]!r}")
    return out


def run(check: bool, root: Path = ROOT) -> tuple[list[str], list[str]]:
    """Render every target; write them unless ``check``. Returns (problems, pending figures)."""
    results = Results(root / "benchmarks" / "results")
    templates = {t.template: (root / "docs" / "templates" / t.template).read_text(encoding="utf-8") for t in TARGETS}
    rerun = reruns(list(templates.values()))
    problems: list[str] = []
    pending: list[str] = []
    for t in TARGETS:
        got = render(templates[t.template], results, rerun)
        pending += [f"{t.output}: {p}" for p in got.pending]
        path = root / t.output
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        lines = current.splitlines()
        span = (0, len(lines)) if t.region is None else region(current, t.region)
        if span is None:
            problems.append(f"{t.output}: no single <!-- begin {t.region} --> ... <!-- end {t.region} --> pair")
            continue
        actual = lines[span[0] : span[1]]
        if actual == got.lines:
            continue
        if check:
            problems += differences(t.output, actual, got, lines[: span[0]])
        else:
            path.write_text("\n".join([*lines[: span[0]], *got.lines, *lines[span[1] :]]) + "\n", encoding="utf-8")
            print(f"wrote {t.output}")
    return problems, pending


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a rendered doc differs")
    args = ap.parse_args()
    try:
        problems, pending = run(args.check)
    except TemplateError as e:
        sys.exit(f"render_docs: {e}")
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(
            f"{len(problems)} difference(s) between the docs and benchmarks/results/*.json: edit docs/templates/ "
            "(not the rendered docs) and run `python benchmarks/render_docs.py`",
            file=sys.stderr,
        )
        sys.exit(1)
    if pending and not args.check:
        print(f"{len(pending)} figure(s) not yet measured (their JSON lacks them until the benchmark is rerun):")
        for p in pending:
            print(f"  {p}")


if __name__ == "__main__":
    main()
