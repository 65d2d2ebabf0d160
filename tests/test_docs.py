"""The docs hold together: every relative link in README.md, CHANGELOG.md, docs/ and scenarios/README.md points at
a file that exists (and a heading that exists, for ``#anchor`` links), README.md stays a short front door that
names nothing outside the repository, every example is run by examples/run_all.sh, and every rendered figure
(docs/benchmarks.md, README's headline results) is what benchmarks/render_docs.py makes of benchmarks/results/."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "scenarios" / "README.md", *(ROOT / "docs").glob("*.md")]
)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``."""
    out = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = re.match(r"^#+ (.*)", line)
        if heading and not in_code:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            out.add(text.replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for link in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link} (no such heading)")
        elif ROOT not in target.parents and target != ROOT:
            broken.append(f"{link} (outside the repository)")
    assert broken == [], f"{page.relative_to(ROOT)}: broken links"


def test_readme_is_a_short_front_door() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    assert "../" not in text, "README.md names a path outside the repository"


def test_run_all_runs_every_example() -> None:
    run_all = (ROOT / "examples" / "run_all.sh").read_text(encoding="utf-8")
    examples = [p.name for p in (ROOT / "examples").iterdir() if p.suffix in (".py", ".sh") and p.name != "run_all.sh"]
    assert examples, "no examples"
    assert [name for name in examples if f"examples/{name}" not in run_all] == []


@functools.cache
def _render_docs() -> ModuleType:
    """benchmarks/render_docs.py as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "benchmarks" / "render_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_rendered_docs_match_the_json() -> None:
    problems, _ = _render_docs().run(check=True)
    assert problems == [], "a doc differs from benchmarks/results/*.json (python benchmarks/render_docs.py --check)"


def test_render_check_names_a_figure_that_drifted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rd = _render_docs()
    monkeypatch.setattr(rd, "TARGETS", (rd.Target("page.md", "page.md"),))
    (tmp_path / "docs" / "templates").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "templates" / "page.md").write_text(
        "# Page\n{% let r = x:rows[*rate=10000] %}\n"
        "| {{ r:[router=pb].hit | pct1 }} | {{ x:rows[router=rr,rate=20000].hit / 0.001 | f0 }} | {{? x:missing | x2 }} |\n"
        "{% rerun x: python bench_x.py %}\n"
    )
    rows = [{"router": "pb", "rate": 10000.0, "hit": 0.2108}, {"router": "rr", "rate": 20000, "hit": 4.105}]
    (tmp_path / "benchmarks" / "results" / "x.json").write_text(json.dumps({"rows": rows}))
    assert rd.run(check=False, root=tmp_path) == ([], ["page.md: x:missing | x2  <-  python bench_x.py"])
    page = (tmp_path / "page.md").read_text()
    assert page == "# Page\n| 21.1% | 4,105 | (not yet measured: rerun `python bench_x.py`) |\n"
    assert rd.run(check=True, root=tmp_path)[0] == []
    rows[0]["hit"] = 0.2119  # the JSON rerun, the doc not re-rendered
    (tmp_path / "benchmarks" / "results" / "x.json").write_text(json.dumps({"rows": rows}))
    (problem,) = rd.run(check=True, root=tmp_path)[0]
    assert "§ Page" in problem and "'21.2%' in the JSON" in problem and "21.1%" in problem


@pytest.mark.parametrize(
    ("value", "spec", "shown"),
    [
        (4105.04, "f0", "4,105"),
        (17.876, "x1", "17.9x"),
        (0.8336, "pct1", "83.4%"),
        (0.22364, "ms0", "224"),
        (2.67e-05, "e1", "2.7e-5"),
        ([1.04, 1.06], "f2", "1.04, 1.06"),
        (2048, None, "2,048"),
    ],
)
def test_render_formats(value: object, spec: str | None, shown: str) -> None:
    assert _render_docs().fmt(value, spec) == shown
