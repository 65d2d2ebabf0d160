"""What a scenario asks for: requests as text, chat messages or token ids (plain values, no I/O), and the
limits a scenario is held to (so that a typo like ``repeat: 1000000000000`` is refused, not run out of memory)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prefixcache.core import DEFAULT_NAMESPACE

MAX_REQUESTS = 10_000_000  # requests a scenario may expand to (repeat and generators included)
MAX_TOKENS = 10_000_000  # any length in tokens a scenario gives (max_new_tokens, a generator's *_tokens)


def finite_number(v: Any) -> bool:
    """True for an int or float (not a bool) that is finite as a float (a huge int is not)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond the float range
        return False


@dataclass(frozen=True)
class ImageRef:
    """An image a message carries, as the simulator sees it: its content id (equal ids: the same picture) and
    how many placeholder tokens the model's processor gives it."""

    id: str
    tokens: int


@dataclass(frozen=True)
class Message:
    """A chat message; ``images`` come before its text, as a chat client sends a picture with a question."""

    role: str
    content: str
    images: tuple[ImageRef, ...] = ()


@dataclass(frozen=True)
class ScenarioRequest:
    """One request of a scenario: exactly one of ``text``, ``messages``, ``tokens``.

    ``conversation``: requests sharing this id form one multi-turn chat; each turn's ``messages`` are only the
    NEW messages, and the history (earlier turns' messages and the replies generated for them) comes first.
    """

    text: str | None = None
    messages: tuple[Message, ...] | None = None
    tokens: tuple[int, ...] | None = None
    conversation: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    timestamp: float | None = None
    max_new_tokens: int | None = None
    line: int | None = None  # where it was written, for error messages

    @property
    def kind(self) -> str:
        return "text" if self.text is not None else "chat" if self.messages is not None else "tokens"
