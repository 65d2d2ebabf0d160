"""Turning scenario requests into prompt token ids, and carrying multi-turn chat history.

A :class:`Renderer` encodes text and chat messages. :class:`ByteRenderer` is a pure-Python twin of the
built-in byte-level tokenizer (engine/models.py): utf-8 bytes are ids 0-255, ``<|bos|>`` is 256, role
markers and ``<|end|>`` follow, and chat uses the same template
``<|bos|>`` + ``<|role|>content<|end|>`` per message + ``<|assistant|>``. So ``simulate`` needs no transformers
and gives the same token ids as ``replay`` on a built-in model. Like that tokenizer (and every Hugging Face
tokenizer by default), a special token's string inside text or a message is read as that special token:
"a<|end|>b" is 3 tokens after ``<|bos|>``, not 9; other roles' markers (``<|tool|>``) are plain bytes.

:class:`Conversations` keeps each conversation's history: a turn's prompt is the history (earlier messages
and the replies given to them, as text, like a chat client resends them) plus the turn's new messages.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from prefixcache.workload.requests import Message, ScenarioRequest

# The built-in tokenizer's special tokens, in id order from 256 (mirrors engine/models.py SPECIAL_TOKENS).
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_IDS = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
BOS_ID = SPECIAL_IDS["<|bos|>"]
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
REPLY_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      .,", dtype=np.uint8)


class Renderer(Protocol):
    """Encodes requests into prompt token ids."""

    def encode_text(self, text: str) -> list[int]: ...
    def encode_chat(self, messages: Sequence[Message]) -> list[int]: ...


class ByteRenderer:
    """utf-8 bytes as ids plus the built-in special tokens; no dependencies."""

    def encode_text(self, text: str) -> list[int]:
        """``<|bos|>`` then the text (what the built-in tokenizer gives with special tokens)."""
        return [BOS_ID, *_encode(text)]

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        """The chat template, rendered to one string and encoded: ``<|bos|>`` ``<|role|>content<|end|>``...
        ``<|assistant|>``."""
        body = "".join(f"<|{m.role}|>{m.content}<|end|>" for m in messages)
        return _encode(f"<|bos|>{body}<|assistant|>")

    def decode(self, ids: Sequence[int], *, specials: bool = False) -> str:
        """Bytes back to text; special tokens are dropped, or written by name with ``specials``."""
        if not specials:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            k = i - 256
            out.append(SPECIAL_TOKENS[k] if k < len(SPECIAL_TOKENS) else f"<|{i}|>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def _encode(text: str) -> list[int]:
    """Special tokens' strings as their ids, everything else as utf-8 bytes."""
    out: list[int] = []
    for i, part in enumerate(_SPECIAL_RE.split(text)):
        if i % 2:  # split() puts the captured specials at odd positions
            out.append(SPECIAL_IDS[part])
        else:
            out.extend(part.encode("utf-8"))
    return out


def synthetic_reply(seed: int, index: int, length: int) -> str:
    """A seeded stand-in for a model's reply (lowercase ASCII words), ``length`` characters = byte tokens."""
    rng = np.random.default_rng([seed, index, 0x5EED])
    return rng.choice(REPLY_ALPHABET, size=length).tobytes().decode("ascii")


class Conversations:
    """Chat histories by conversation id. ``prompt`` reads them; ``add_reply`` extends them."""

    def __init__(self) -> None:
        self._history: dict[str, list[Message]] = {}

    def messages(self, req: ScenarioRequest) -> list[Message]:
        """The full message list of a chat request: its conversation's history, then its own messages."""
        assert req.messages is not None
        history = self._history.get(req.conversation, []) if req.conversation is not None else []
        return [*history, *req.messages]

    def prompt(self, req: ScenarioRequest, renderer: Renderer) -> list[int]:
        """Prompt token ids of ``req`` (text, chat with history, or raw tokens). Changes nothing."""
        if req.tokens is not None:
            return list(req.tokens)
        if req.text is not None:
            return renderer.encode_text(req.text)
        return renderer.encode_chat(self.messages(req))

    def add_reply(self, req: ScenarioRequest, reply: str) -> None:
        """Record the reply to ``req``: later turns of its conversation see its messages and this reply."""
        if req.messages is None or req.conversation is None:
            return
        self._history[req.conversation] = [*self.messages(req), Message("assistant", reply)]
