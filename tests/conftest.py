"""Shared fixtures: the traces folder (a sibling of the repo root) and a one-request helper."""

from __future__ import annotations

from pathlib import Path

import pytest

TRACES = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces"


@pytest.fixture
def traces_dir() -> Path:
    """../shared/data/traces; skips the test when the folder is absent."""
    if not TRACES.is_dir():
        pytest.skip(f"traces not found at {TRACES}")
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
