"""The run conditions every benchmark JSON records under ``"meta"``: the command line, the git commit, the machine's
CPU count and load average before and after the run, and the versions of what was measured (torch,
transformers, and the peer a benchmark compares against, where it has one).

    meta = _meta.begin(peers=("transformers",))   # at the start: load average now
    ...
    payload["meta"] = _meta.end(meta)             # when writing the JSON: load average now, wall time

``benchmarks/render_docs.py`` prints the load beside each figure it renders. Versions are read from the installed
distributions' metadata, so nothing (torch included) is imported here.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None when it is not installed. Changes nothing."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit(checkout: Path = ROOT) -> str | None:
    """HEAD's commit of ``checkout`` (default: this one), ``+dirty`` when tracked files differ from it; None
    without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=checkout, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def command_line() -> str:
    """This process's command line as it would be typed from the repository root."""
    script = Path(sys.argv[0])
    with contextlib.suppress(ValueError):  # a script outside the repository keeps its own path
        script = script.resolve().relative_to(ROOT)
    return shlex.join(["python", str(script), *sys.argv[1:]])


def begin(peers: Iterable[str] = (), **peer_versions: str | None) -> dict[str, Any]:
    """A new meta record, taken now: command, commit, CPUs, versions, ``load_before``. ``peers`` names the
    distributions a benchmark compares against (their installed versions are recorded); ``peer_versions`` gives
    versions found another way (a server's own report). Changes nothing."""
    peer = {name: version(name) for name in peers} | dict(peer_versions)
    return {
        "command": command_line(),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "peer": peer,
        "load_before": list(os.getloadavg()),
        "started_unix": time.time(),
    }


def end(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` completed at the end of a run: ``load_after`` and ``wall_s`` added. Returns a new dict."""
    return {**meta, "load_after": list(os.getloadavg()), "wall_s": time.time() - meta["started_unix"]}
