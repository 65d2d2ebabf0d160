"""Incremental detokenization (engine/serve/detokenize.py) against whole-text decoding, on the byte tokenizer with
random ids (stray bytes >= 0x80, incomplete and invalid UTF-8, special tokens): the confirmed text only grows, is
always the start of the whole decode, holds back only a tail that ends in U+FFFD, and ``text + rest()`` is the
whole decode. The app's streamed deltas are the same as with whole-reply decoding after every push."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models import byte_tokenizer
from engine.serve.app import _Detokenizer
from engine.serve.detokenize import REPLACEMENT, IncrementalText
from engine.serve.stop_strings import cut, visible

TOK = byte_tokenizer()
VOCAB = len(TOK)


def decode(ids: list[int]) -> str:
    return str(TOK.decode(ids, skip_special_tokens=True))


# bytes weighted towards UTF-8 lead and continuation bytes, a few ASCII and special tokens
token = st.one_of(st.integers(0x80, 0xBF), st.integers(0xC2, 0xF4), st.integers(0x20, 0x7E), st.integers(0, VOCAB - 1))
chunks = st.lists(st.lists(token, min_size=1, max_size=4), max_size=25)


@settings(max_examples=300, deadline=None)
@given(chunks)
def test_increments_are_the_whole_decode(pushes: list[list[int]]) -> None:
    inc = IncrementalText(decode)
    ids: list[int] = []
    shown = ""
    for chunk in pushes:
        ids += chunk
        shown += inc.push(chunk)
        whole = decode(ids)
        assert shown == inc.text
        assert whole.startswith(shown)
        held = whole[len(shown) :]
        assert held == "" or held.endswith(REPLACEMENT)  # only an unfinished (U+FFFD) tail is held back
        assert inc.rest() == held
    assert inc.text + inc.rest() == decode(ids)


def test_a_multibyte_character_waits_for_its_last_byte() -> None:
    inc = IncrementalText(decode)
    e_acute = list("é".encode())
    assert inc.push([ord("a")]) == "a"
    assert inc.push(e_acute[:1]) == ""
    assert inc.rest() == REPLACEMENT
    assert inc.push(e_acute[1:]) == "é"
    assert inc.text == "aé"


def test_only_the_new_ids_are_decoded() -> None:
    """Each push decodes a window of the last two pushes' ids, never the whole reply."""
    seen: list[int] = []

    def counting(ids: list[int]) -> str:
        seen.append(len(ids))
        return decode(ids)

    inc = IncrementalText(counting)
    for _ in range(200):
        inc.push([ord("x")])
    assert inc.text == "x" * 200
    assert max(seen) <= 2


class _WholeDecode:
    """The app's streaming detokenizer before IncrementalText: the whole reply decoded after every push."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer, self.stops, self.ids, self.emitted = tokenizer, stops, [], ""

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text: str = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith(REPLACEMENT):
            return ""
        return self._emit(visible(text, self.stops) if self.stops else text)

    def flush(self) -> str:
        text: str = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self._emit(cut(text, self.stops) if self.stops else text)

    def _emit(self, text: str) -> str:
        if not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta


@pytest.mark.parametrize("stops", [(), ("ab",), ("\u00e9", "x\n")])
@settings(max_examples=150, deadline=None)
@given(
    pushes=st.lists(
        st.lists(st.one_of(token, st.sampled_from([ord("a"), ord("b"), ord("x"), 10])), min_size=1, max_size=3),
        max_size=20,
    )
)
def test_streamed_deltas_match_whole_reply_decoding(stops: tuple[str, ...], pushes: list[list[int]]) -> None:
    new, old = _Detokenizer(TOK, stops), _WholeDecode(TOK, stops)
    for chunk in pushes:
        assert new.push(chunk) == old.push(chunk)
    assert new.flush() == old.flush()
    assert new.emitted == old.emitted
