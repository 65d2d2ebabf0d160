"""Stop strings (engine/serve/stop_strings.py) against brute force: the cut is the text before the earliest
occurrence of any stop string; text streamed while it grows is always a prefix of the final reply and never shows
a stop string."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.serve.stop_strings import StopStrings, cut, find, visible

texts = st.text(alphabet="ab\n", max_size=30)
stop_lists = st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=3)


def brute_cut(text: str, stops: list[str]) -> str:
    for i in range(len(text)):
        if any(text.startswith(s, i) for s in stops):
            return text[:i]
    return text


@given(texts, stop_lists)
def test_cut_is_the_text_before_the_earliest_stop(text, stops):
    assert cut(text, stops) == brute_cut(text, stops)
    assert (find(text, stops) is None) == (cut(text, stops) == text and not any(s in text for s in stops))


@given(texts, stop_lists)
def test_streaming_shows_only_what_the_final_reply_keeps(text, stops):
    """Generation stops at the first character after which the text holds a stop string; the reply is that text
    cut; while it grows, what is shown only grows and is always the start of the reply."""
    end = next((n for n in range(len(text) + 1) if any(s in text[:n] for s in stops)), len(text))
    final = brute_cut(text[:end], stops)
    shown = ""
    for n in range(end + 1):
        now = visible(text[:n], stops)
        assert now.startswith(shown)  # never takes back what it showed
        assert final.startswith(now)  # never shows what the reply will not hold
        shown = now
    assert cut(text[:end], stops) == final


def test_the_check_decodes_the_output():
    check = StopStrings(["\n\n", "Q:"], lambda ids: "".join(chr(i) for i in ids))
    assert not check([ord(c) for c in "A: yes\n"])
    assert check([ord(c) for c in "A: yes\n\n"])
    assert check([ord(c) for c in "yes Q:"])
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(["a", ""], str)
