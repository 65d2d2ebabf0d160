"""Helpers for the CLI tests."""

from __future__ import annotations


def one_line_error(r, *fragments: str) -> str:
    """Exit 2, no traceback, stderr is exactly one `error:` line holding every fragment; returns that line."""
    assert "Traceback" not in r.output, r.output
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]
