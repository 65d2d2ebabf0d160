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
# The image-text presets' tokens after them (engine/models.py VISION_TOKENS): an image is written as
# <|vision_start|>, one <|image_pad|> per placeholder token, <|vision_end|> (Qwen2-VL's layout)
VISION_START, VISION_END, IMAGE_PAD = 256 + len(SPECIAL_TOKENS), 257 + len(SPECIAL_TOKENS), 258 + len(SPECIAL_TOKENS)
Span = tuple[int, int, str]  # an image's placeholder tokens [start, stop) in a prompt, and its content id
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
        return self.encode_chat_spans(messages)[0]

    def encode_chat_spans(self, messages: Sequence[Message]) -> tuple[list[int], list[Span]]:
        """``encode_chat`` with images: a message's images come before its text, each as the image-text presets'
        tokenizer writes it; returns the ids and each image's placeholder span and id."""
        if not any(m.images for m in messages):
            body = "".join(f"<|{m.role}|>{m.content}<|end|>" for m in messages)
            return _encode(f"<|bos|>{body}<|assistant|>"), []
        ids, spans = [BOS_ID], []
        for m in messages:
            ids += _encode(f"<|{m.role}|>")
            for img in m.images:
                ids.append(VISION_START)
                spans.append((len(ids), len(ids) + img.tokens, img.id))
                ids += [IMAGE_PAD] * img.tokens
                ids.append(VISION_END)
            ids += _encode(f"{m.content}<|end|>")
        return ids + [SPECIAL_IDS["<|assistant|>"]], spans

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
        return self.prompt_spans(req, renderer)[0]

    def prompt_spans(self, req: ScenarioRequest, renderer: Renderer) -> tuple[list[int], list[Span]]:
        """``prompt`` and its images' spans (a chat whose messages carry images; ValueError for a renderer that
        cannot write images). Changes nothing."""
        if req.tokens is not None:
            return list(req.tokens), []
        if req.text is not None:
            return renderer.encode_text(req.text), []
        messages = self.messages(req)
        if not any(m.images for m in messages):
            return renderer.encode_chat(messages), []
        spans_of = getattr(renderer, "encode_chat_spans", None)
        if spans_of is None:
            raise ValueError("messages with images are rendered by the simulator only (simulate, plan, explain)")
        ids, spans = spans_of(messages)
        return list(ids), list(spans)

    def add_reply(self, req: ScenarioRequest, reply: str) -> None:
        """Record the reply to ``req``: later turns of its conversation see its messages and this reply."""
        if req.messages is None or req.conversation is None:
            return
        self._history[req.conversation] = [*self.messages(req), Message("assistant", reply)]
