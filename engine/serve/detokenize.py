"""Incremental detokenization: the text of a growing list of token ids, decoding only the new ids each time.

Decoding the whole reply after every token costs work that grows with the reply. ``IncrementalText`` decodes a
short window instead: the ids since the last confirmed point (plus the ids of the push before, as look-back, so a
tokenizer that renders a token differently at the start of a text, e.g. a leading space, still gives the right
delta). Text whose window ends in U+FFFD (an incomplete UTF-8 character: the next byte may complete it) is held back
until a later push confirms it; ``rest()`` gives what is held back, decoded as the whole text would end now.

For a tokenizer whose decoding of a concatenation is the concatenation of the decodings at character boundaries
(byte-level BPE: every preset here, GPT-2/Llama-3 style tokenizers), ``text + rest()`` equals decoding all the ids at
once. A server renders a reply's end from one whole decode anyway (``engine.serve.app``), so another tokenizer can
at most delay streamed text, never change the reply.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalText:
    """The confirmed text of ``ids`` pushed so far (``text``), grown by decoding windows of new ids."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""  # confirmed: ids[:_read] decode to it
        self._prefix = 0  # window start (look-back): ids[_prefix:_read] were confirmed by the previous push
        self._read = 0  # ids[:_read] are confirmed

    def push(self, ids: list[int]) -> str:
        """Add ``ids``; returns the newly confirmed text (appended to ``text``), "" while it ends in U+FFFD."""
        self.ids += ids
        if self._read == len(self.ids):
            return ""
        head, window = self._window()
        if window.endswith(REPLACEMENT) or len(window) <= len(head) or not window.startswith(head):
            return ""  # incomplete (or nothing new yet): wait for more ids
        delta = window[len(head) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def rest(self) -> str:
        """The text of the ids not confirmed yet, as if the reply ended now (may end in U+FFFD). Changes nothing."""
        if self._read == len(self.ids):
            return ""
        head, window = self._window()
        return window[len(head) :] if window.startswith(head) else window

    def _window(self) -> tuple[str, str]:
        """The look-back ids' text and the text of the look-back plus every id not confirmed yet. Changes nothing."""
        head = self.decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        return head, self.decode(self.ids[self._prefix :])
