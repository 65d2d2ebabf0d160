"""Shared fixtures: the shipped traces folder (scenarios/traces) and a one-request helper."""

from __future__ import annotations

from pathlib import Path

import pytest

TRACES = Path(__file__).resolve().parents[1] / "scenarios" / "traces"
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def traces_dir() -> Path:
    """scenarios/traces: the Mooncake traces shipped with the project (gzipped)."""
    return TRACES


@pytest.fixture
def serve():
    """``serve(cache, tokens, full=None)``: match, commit (``full`` or the prompt), release, check_integrity.

    Returns (MatchResult, CommitResult)."""

    def run(cache, tokens, full=None):
        m = cache.match(tokens)
        r = cache.commit(m.handle, full)
        cache.release(m.handle)
        cache.check_integrity()
        return m, r

    return run
