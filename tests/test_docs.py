"""The docs hold together: every relative link in README.md, CHANGELOG.md, docs/ and scenarios/README.md points at
a file that exists (and a heading that exists, for ``#anchor`` links), README.md stays a short front door that
names nothing outside the repository, and every example is run by examples/run_all.sh."""

from __future__ import annotations

import re
from pathlib import Path

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
