"""Print the lowest version pyproject.toml's hf extra allows for a package (``python3 .ci/floor.py transformers``):
the release .ci/run installs for its second, lower-bound test run. Exits 1 when the extra has no ``>=`` bound."""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def floor(package: str) -> str:
    """The ``>=`` bound of ``package`` in the hf extra, or SystemExit naming what is missing."""
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    for requirement in project["optional-dependencies"]["hf"]:
        m = re.fullmatch(rf"{re.escape(package)}\s*(.*)", requirement.strip())
        if m:
            low = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", m.group(1))
            if low is None:
                raise SystemExit(f"the hf extra gives {package} no >= bound: {requirement}")
            return low.group(1)
    raise SystemExit(f"the hf extra does not name {package}")


if __name__ == "__main__":
    print(floor(sys.argv[1]))
